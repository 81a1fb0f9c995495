// Package heartbeat keeps an enrolled agent known to its controller: it
// calls Agents.Heartbeat with the agent's address, version and the hash
// of its facts, at the interval the controller asks for, and backs off
// exponentially while the controller cannot be reached or refuses. The
// facts go in full only when their hash changed since the controller last
// took them, or when the controller asks (facts_wanted): an idle agent's
// heartbeat is a few hundred bytes and writes nothing on the controller.
package heartbeat

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/factshash"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Defaults.
const (
	DefaultInterval      = 10 * time.Second
	DefaultFactsInterval = time.Minute
	DefaultTimeout       = 10 * time.Second
)

// Client is the part of controllerv1.AgentsClient the loop calls.
type Client interface {
	Heartbeat(ctx context.Context, in *controllerv1.HeartbeatRequest, opts ...grpc.CallOption) (*controllerv1.HeartbeatResponse, error)
}

var _ Client = controllerv1.AgentsClient(nil)

// Facter gathers the host's facts.
type Facter interface {
	Facts(ctx context.Context) (*typesv1.Facts, error)
}

// Options tune a Loop.
type Options struct {
	Client Client
	// Address returns the agent API address to advertise (host:port).
	Address func() string
	// Facts, when set, are gathered on the first heartbeat and then at
	// most every FactsInterval; every heartbeat carries their hash, and
	// the facts themselves go only when the hash changed since the
	// controller last took them or when it asks for them.
	Facts         Facter
	FactsInterval time.Duration
	Version       string
	// Interval is used until the controller names one (DefaultInterval).
	Interval time.Duration
	// Timeout bounds one call (DefaultTimeout).
	Timeout time.Duration
	// Backoff is the retry policy after a failed heartbeat
	// (1s doubling to 1m).
	Backoff backoff.Policy
	// Observe, when set, is called after every heartbeat with its error.
	Observe func(*controllerv1.HeartbeatResponse, error)
	Log     *slog.Logger
}

// Loop sends heartbeats.
type Loop struct {
	o   Options
	log *slog.Logger
	rnd *rand.Rand
}

// New returns a Loop over o.
func New(o Options) *Loop {
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.FactsInterval <= 0 {
		o.FactsInterval = DefaultFactsInterval
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Backoff.Base <= 0 {
		o.Backoff = backoff.Policy{Base: time.Second, Max: time.Minute, Factor: 2, Jitter: 0.2}
	}
	if o.Address == nil {
		o.Address = func() string { return "" }
	}
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Loop{o: o, log: log.With("component", "heartbeat"), rnd: rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))}
}

// Run sends heartbeats until ctx is done, then returns nil. It blocks.
func (l *Loop) Run(ctx context.Context) error {
	interval := l.o.Interval
	var (
		facts     *typesv1.Facts
		sum       string    // factshash.Sum(facts)
		delivered string    // the sum of the facts the controller last took
		gathered  time.Time // when facts were gathered
		wanted    bool      // the controller asked for the facts
	)
	failures := 0
	for {
		req := &controllerv1.HeartbeatRequest{AgentAddress: l.o.Address(), Version: l.o.Version}
		if l.o.Facts != nil && (gathered.IsZero() || time.Since(gathered) >= l.o.FactsInterval) {
			f, err := l.o.Facts.Facts(ctx)
			if err != nil {
				l.log.Warn("gathering facts failed; heartbeat with the last facts' hash", "error", err)
			} else {
				facts, sum, gathered = f, factshash.Sum(f), time.Now()
			}
		}
		req.FactsSha256 = sum
		if facts != nil && (sum != delivered || wanted) {
			req.Facts = facts
		}
		cctx, cancel := context.WithTimeout(ctx, l.o.Timeout)
		resp, err := l.o.Client.Heartbeat(cctx, req)
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		err = errgrpc.FromGRPC(err)
		if l.o.Observe != nil {
			l.o.Observe(resp, err)
		}
		var wait time.Duration
		if err != nil {
			wait = l.o.Backoff.Delay(failures, l.rnd)
			failures++
			l.log.Warn("heartbeat failed", "error", err, "attempt", failures, "retry_in", wait)
		} else {
			if failures > 0 {
				l.log.Info("heartbeat succeeded again", "after_failures", failures)
			}
			failures = 0
			if req.Facts != nil {
				delivered = req.FactsSha256
			}
			if s := resp.GetIntervalSeconds(); s > 0 {
				interval = time.Duration(s) * time.Second
			}
			wait = interval
			// A controller that does not hold the facts of our hash asks
			// for them: send them now (once; if it asks again after
			// getting them, at the next interval).
			wanted = resp.GetFactsWanted()
			if wanted && req.Facts == nil && facts != nil {
				wait = 0
			}
			if req.AgentAddress == "" && l.o.Address() != "" {
				wait = 0 // the address became known with this connection: tell it now
			}
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// LocalAddr records the local address of the connections a dialer makes:
// the address on which the controller reaches this host, used as the
// advertised agent address when none is configured.
type LocalAddr struct {
	mu   sync.Mutex
	addr net.Addr
}

// Dialer returns a gRPC context dialer that records local addresses.
func (la *LocalAddr) Dialer() func(ctx context.Context, addr string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		la.mu.Lock()
		la.addr = c.LocalAddr()
		la.mu.Unlock()
		return c, nil
	}
}

// Host returns the IP of the last connection's local address, or "".
func (la *LocalAddr) Host() string {
	la.mu.Lock()
	defer la.mu.Unlock()
	if ta, ok := la.addr.(*net.TCPAddr); ok {
		return ta.IP.String()
	}
	return ""
}

// Advertise returns the address to advertise for an API listening on
// listen: listen itself when it names a host, otherwise the local IP of
// the connection to the controller with listen's port.
func Advertise(listen string, la *LocalAddr) func() string {
	host, port, err := net.SplitHostPort(listen)
	if err == nil && host != "" {
		if ip := net.ParseIP(host); ip == nil || !ip.IsUnspecified() {
			return func() string { return listen }
		}
	}
	return func() string {
		h := la.Host()
		if h == "" {
			return ""
		}
		return net.JoinHostPort(h, port)
	}
}
