package bmc

import (
	"context"
	"sync"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// ManagerOptions configure a Manager.
type ManagerOptions struct {
	// MaxConcurrent is the number of BMC operations allowed at once across
	// all BMCs (default 32).
	MaxConcurrent int
	// Defaults are the Options every BMC gets (Name is set per BMC).
	Defaults Options
}

// Manager holds the fleet's BMCs, one per host name, under one global
// concurrency limit. It is safe for concurrent use.
type Manager struct {
	opts ManagerOptions
	lim  *limiter

	mu   sync.Mutex
	bmcs map[string]*BMC
}

// ManagerStats are the global concurrency counters.
type ManagerStats struct {
	InFlight    int
	MaxInFlight int
	// MaxPerBMC is the largest MaxInFlight of any BMC (1 when per-BMC
	// serialisation holds).
	MaxPerBMC int
}

// NewManager returns an empty Manager.
func NewManager(opts ManagerOptions) *Manager {
	if opts.MaxConcurrent <= 0 {
		opts.MaxConcurrent = 32
	}
	return &Manager{opts: opts, lim: newLimiter(opts.MaxConcurrent), bmcs: map[string]*BMC{}}
}

// Dial returns the BMC of host name, creating it when there is none or
// when ep changed (a changed endpoint or password gets a fresh BMC with a
// fresh circuit breaker). Errors are those of Dial.
func (m *Manager) Dial(ctx context.Context, name string, ep Endpoint) (*BMC, error) {
	if name == "" {
		return nil, errdefs.InvalidArgument("bmc manager: empty host name")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if b, ok := m.bmcs[name]; ok && b.ep == ep {
		return b, nil
	}
	opts := m.opts.Defaults
	opts.Name = name
	b, err := dial(ctx, ep, opts, m.lim)
	if err != nil {
		return nil, err
	}
	m.bmcs[name] = b
	return b, nil
}

// Get returns the BMC of host name, if dialled.
func (m *Manager) Get(name string) (*BMC, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.bmcs[name]
	return b, ok
}

// Remove forgets the BMC of host name (a deleted host).
func (m *Manager) Remove(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.bmcs, name)
}

// Stats returns the concurrency counters.
func (m *Manager) Stats() ManagerStats {
	m.lim.mu.Lock()
	s := ManagerStats{InFlight: m.lim.inFlight, MaxInFlight: m.lim.maxInFlight}
	m.lim.mu.Unlock()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, b := range m.bmcs {
		s.MaxPerBMC = max(s.MaxPerBMC, b.Stats().MaxInFlight)
	}
	return s
}
