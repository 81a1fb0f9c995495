package machine

import (
	"context"
	"fmt"
	"sync"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Event is one recorded call on a Memory machine.
type Event struct {
	// Op is "on", "off", "soft-off", "reset" or "media".
	Op string
	// Arg is the boot device of "on" and the URL of "media".
	Arg string
}

func (e Event) String() string {
	if e.Arg == "" {
		return e.Op
	}
	return e.Op + ":" + e.Arg
}

// Memory is an in-memory Machine that records every call and can be told
// to fail. The zero value is a powered-off machine ready to use.
type Memory struct {
	mu     sync.Mutex
	on     bool
	boot   string
	media  string
	events []Event
	// failNext maps an Op to the error its next calls return.
	failNext map[string][]error
}

var _ Machine = (*Memory)(nil)

// FailNext makes the next call of op ("on", "off", "soft-off", "reset",
// "media") return err, once per call of FailNext.
func (m *Memory) FailNext(op string, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.failNext == nil {
		m.failNext = map[string][]error{}
	}
	m.failNext[op] = append(m.failNext[op], err)
}

func (m *Memory) record(op, arg string) error {
	m.events = append(m.events, Event{Op: op, Arg: arg})
	if q := m.failNext[op]; len(q) > 0 {
		m.failNext[op] = q[1:]
		return q[0]
	}
	return nil
}

// PowerOn implements Machine.
func (m *Memory) PowerOn(ctx context.Context, bootDevice string) error {
	if err := ValidBootDevice(bootDevice); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.record("on", bootDevice); err != nil {
		return err
	}
	if !m.on {
		m.on = true
		m.boot = bootDevice
	}
	return nil
}

// PowerOff implements Machine.
func (m *Memory) PowerOff(ctx context.Context, graceful bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	op := "off"
	if graceful {
		op = "soft-off"
	}
	if err := m.record(op, ""); err != nil {
		return err
	}
	m.on = false
	return nil
}

// Reset implements Machine.
func (m *Memory) Reset(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.record("reset", ""); err != nil {
		return err
	}
	if !m.on {
		return errdefs.FailedPrecondition("reset: machine is off")
	}
	return nil
}

// State implements Machine.
func (m *Memory) State() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.on
}

// InsertMedia implements Machine.
func (m *Memory) InsertMedia(url string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.record("media", url); err != nil {
		return err
	}
	m.media = url
	return nil
}

// Media returns the URL in the virtual CD drive, "" when empty.
func (m *Memory) Media() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.media
}

// BootSource implements Machine.
func (m *Memory) BootSource() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.boot
}

// Events returns the calls recorded so far, oldest first.
func (m *Memory) Events() []Event {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Event(nil), m.events...)
}

// String describes the machine for test failure messages.
func (m *Memory) String() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return fmt.Sprintf("on=%v boot=%q media=%q", m.on, m.boot, m.media)
}
