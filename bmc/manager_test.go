package bmc_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
)

type rack struct {
	mgr       *bmc.Manager
	names     []string
	emulators []*redfish.BMC
	machines  []*machine.Memory
}

func newRack(tb testing.TB, hosts, limit int) *rack {
	tb.Helper()
	opts := fastOpts("")
	opts.PollInterval = 10 * time.Millisecond
	r := &rack{mgr: bmc.NewManager(bmc.ManagerOptions{MaxConcurrent: limit, Defaults: opts})}
	for i := range hosts {
		m := &machine.Memory{}
		e, err := redfish.New(redfish.Config{
			Username: testUser, Password: testPassword,
			Systems: []redfish.System{{ID: fmt.Sprintf("SYS%03d", i), Model: "lab", Machine: m}},
		})
		require.NoError(tb, err)
		e.Start()
		tb.Cleanup(e.Close)
		name := fmt.Sprintf("host-%03d", i)
		_, err = r.mgr.Dial(context.Background(), name, bmc.Endpoint{
			Protocol: bmc.ProtocolRedfish, Address: e.URL(), Username: testUser, Password: testPassword,
		})
		require.NoError(tb, err)
		r.names = append(r.names, name)
		r.emulators = append(r.emulators, e)
		r.machines = append(r.machines, m)
	}
	return r
}

// cycleAll power-cycles every host while also reading its power state from
// a second goroutine, so that per-BMC serialisation is exercised.
func (r *rack) cycleAll(ctx context.Context) error {
	var wg sync.WaitGroup
	errs := make(chan error, 2*len(r.names))
	for _, name := range r.names {
		b, _ := r.mgr.Get(name)
		wg.Add(2)
		go func() {
			defer wg.Done()
			if err := b.PowerCycle(ctx); err != nil {
				errs <- err
			}
		}()
		go func() {
			defer wg.Done()
			if _, err := b.PowerState(ctx); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// maxServerInFlight is the most requests any emulator served at once.
func (r *rack) maxServerInFlight() int {
	m := 0
	for _, e := range r.emulators {
		m = max(m, e.Stats().MaxInFlight)
	}
	return m
}

func TestManagerSerialisesPerBMCAndLimitsGlobally(t *testing.T) {
	const hosts, limit = 20, 4
	r := newRack(t, hosts, limit)
	require.NoError(t, r.cycleAll(ctxTimeout(t, time.Minute)))
	for i, m := range r.machines {
		if !m.State() {
			t.Errorf("host %d is off after PowerCycle", i)
		}
	}
	st := r.mgr.Stats()
	if st.MaxPerBMC != 1 {
		t.Errorf("Stats().MaxPerBMC = %d, want 1", st.MaxPerBMC)
	}
	if st.MaxInFlight > limit || st.MaxInFlight < 2 {
		t.Errorf("Stats().MaxInFlight = %d, want between 2 and %d", st.MaxInFlight, limit)
	}
	if got := r.maxServerInFlight(); got != 1 {
		t.Errorf("an emulator served %d requests at once, want 1", got)
	}
	if st.InFlight != 0 {
		t.Errorf("Stats().InFlight = %d after all calls returned, want 0", st.InFlight)
	}
}

func TestManagerRedialsOnEndpointChange(t *testing.T) {
	mgr := bmc.NewManager(bmc.ManagerOptions{})
	ep := bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: "https://127.0.0.1:1", Username: "u", Password: "p1"}
	b1, err := mgr.Dial(context.Background(), "h", ep)
	require.NoError(t, err)
	b2, err := mgr.Dial(context.Background(), "h", ep)
	require.NoError(t, err)
	if b1 != b2 {
		t.Fatalf("Dial() twice with the same endpoint gave two BMCs")
	}
	ep.Password = "p2"
	b3, err := mgr.Dial(context.Background(), "h", ep)
	require.NoError(t, err)
	if b3 == b1 {
		t.Fatalf("Dial() with a new password returned the old BMC")
	}
}

// BenchmarkPowerCycle100Hosts power-cycles 100 hosts behind Redfish
// emulators on loopback through one Manager (global limit 32), with a
// concurrent power-state read per host. Results: docs/bench/bmc.md.
func BenchmarkPowerCycle100Hosts(b *testing.B) {
	const hosts, limit = 100, 32
	r := newRack(b, hosts, limit)
	b.ResetTimer()
	for b.Loop() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		err := r.cycleAll(ctx)
		cancel()
		if err != nil {
			b.Fatal(err)
		}
	}
	st := r.mgr.Stats()
	b.ReportMetric(float64(st.MaxInFlight), "max-global-inflight")
	b.ReportMetric(float64(st.MaxPerBMC), "max-per-bmc-inflight")
	b.ReportMetric(float64(r.maxServerInFlight()), "max-requests-at-one-bmc")
}

// BenchmarkPowerCycleIPMI power-cycles three ipmi_sim BMCs at once.
func BenchmarkPowerCycleIPMI(b *testing.B) {
	requireIPMITools(b)
	opts := fastOpts("")
	opts.AttemptTimeout = 20 * time.Second
	opts.PollInterval = 50 * time.Millisecond
	hosts := startIPMIHosts(b, 3, opts)
	b.ResetTimer()
	for b.Loop() {
		var wg sync.WaitGroup
		for _, h := range hosts {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				if err := h.b.PowerCycle(ctx); err != nil {
					b.Error(err)
				}
			}()
		}
		wg.Wait()
	}
	maxPer := 0
	for _, h := range hosts {
		maxPer = max(maxPer, h.b.Stats().MaxInFlight)
	}
	b.ReportMetric(float64(maxPer), "max-per-bmc-inflight")
}
