package clusterexec_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/machineplan"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/sim"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// world is a real store (embedded etcd, sealed secrets), the real
// enrollment service for check-ins, a simulated fleet with simulated
// kubeadm, and the host lifecycle and cluster executors over them: the
// leader's work of a controller in simulation mode.
type world struct {
	t       testing.TB
	ctx     context.Context
	st      *store.Store
	rec     *events.Recorder
	fleet   *sim.Fleet
	kubeadm *sim.Kubeadm
	kube    clusterexec.KubeClientFunc // nil: client-go's
	drain   clusterexec.DrainFunc      // nil: drains are skipped
	// drainTimeout is the executor's Config.DrainTimeout (0: its default).
	drainTimeout time.Duration
	// observer is told of the executors' reconciles (nil: none).
	observer clusterexec.Observer
	// machineCfg is the executor's Config.Machines (refusals retried
	// after 100 ms doubling to 1 s unless a test says otherwise).
	machineCfg machineplan.Config
}

func newWorld(t testing.TB, kubeadmDuration time.Duration) *world {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	e, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(t.TempDir(), "etcd")})
	require.NoError(t, err)
	t.Cleanup(e.Close)
	c, err := store.Dial(e.Endpoints(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	sealer, err := seal.New(bytes.Repeat([]byte{7}, seal.KeySize))
	require.NoError(t, err)
	st := store.New(c, store.WithSealer(sealer))
	log := slog.New(slog.DiscardHandler)
	rec := events.New(c, time.Hour, nil, log)
	enr := enrollment.New(st, nil, rec, enrollment.Config{}, log)
	fleet := sim.NewFleet(ctx, sim.Config{
		BMCLatency: 2 * time.Millisecond, BootDelay: 30 * time.Millisecond, LayDuration: 80 * time.Millisecond,
		WipeDuration: 20 * time.Millisecond, HeartbeatInterval: 500 * time.Millisecond,
	}, sim.EnrollmentCheckIn(enr))
	return &world{t: t, ctx: ctx, st: st, rec: rec, fleet: fleet, kubeadm: sim.NewKubeadm(fleet, kubeadmDuration),
		machineCfg: machineplan.Config{RefusalBackoff: backoff.Policy{Base: 100 * time.Millisecond, Max: time.Second, Factor: 2}}}
}

// start runs the host lifecycle and the cluster executor (new instances,
// as a new leader would) until the returned stop is called.
func (w *world) start() (stop func()) {
	stopLife := w.startLifecycle()
	ctx, cancel := context.WithCancel(w.ctx)
	ex := w.executor()
	done := make(chan struct{})
	go func() { _ = ex.Run(ctx); close(done) }()
	return func() { cancel(); <-done; stopLife() }
}

// startLifecycle runs the host lifecycle alone until the returned stop
// is called.
func (w *world) startLifecycle() (stop func()) {
	ctx, cancel := context.WithCancel(w.ctx)
	agents := w.kubeadm.AgentDialer()
	life := provision.New(provision.Deps{Store: w.st, Recorder: w.rec, BMCs: w.fleet.BMCDialer(), Agents: agents},
		provision.Config{
			Workers: 8,
			Plan: hostlife.Config{
				PollInterval: 100 * time.Millisecond,
				Backoff:      backoff.Policy{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond, Factor: 2},
				MaxAttempts:  5,
			},
			ISOURL:         func(h string) string { return "http://boot.sim/boot/iso/" + h + ".iso" },
			ResyncInterval: time.Second,
		}, slog.New(slog.DiscardHandler))
	done := make(chan struct{})
	go func() { _ = life.Run(ctx); close(done) }()
	return func() { cancel(); <-done }
}

// executor is a new cluster executor over w.
func (w *world) executor() *clusterexec.Executor { return w.executorOn(w.st, "") }

// executorOn is a new cluster executor over st (a fenced view of w.st,
// for one leader's term); id names it in its log lines.
func (w *world) executorOn(st clusterexec.Store, id string) *clusterexec.Executor {
	log := slog.New(slog.DiscardHandler)
	if _, ok := w.t.(*testing.T); ok {
		log = slog.New(slog.NewTextHandler(testWriter{w.t}, nil))
		if id != "" {
			log = log.With("leader", id)
		}
	}
	return clusterexec.New(clusterexec.Deps{Store: st, Recorder: w.rec, Agents: clusterexec.AgentDialer(w.kubeadm.AgentDialer()), KubeClient: w.kube, Drain: w.drain, Observer: w.observer},
		clusterexec.Config{Interval: 100 * time.Millisecond, DrainTimeout: w.drainTimeout, Machines: w.machineCfg}, log)
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func (w *world) create(kind, name string, m proto.Message) {
	w.t.Helper()
	_, err := w.st.Create(w.ctx, kind, name, m)
	require.NoError(w.t, err)
}

// apply stores an image, n hosts and a cluster with a control plane of
// cpReplicas and a deployment of workers.
func (w *world) apply(hosts, cpReplicas, workers int) {
	now := timestamppb.Now()
	meta := func(name string) *typesv1.ObjectMeta {
		return &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: now}
	}
	w.create("images", sim.ImageName, &typesv1.Image{Metadata: meta(sim.ImageName), Spec: &typesv1.ImageSpec{
		Url: "http://images.sim/" + sim.ImageName + ".raw.zst", Format: "raw.zst", Sha256: strings.Repeat("ab", 32), KubernetesVersion: "v1.34.4"}})
	for i := 1; i <= hosts; i++ {
		name := fmt.Sprintf("h%d", i)
		w.create("hosts", name, &typesv1.Host{Metadata: meta(name),
			Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: "sim://" + name}, RootDiskHint: "/dev/sda", Online: true}})
	}
	clusterMeta := meta("c1")
	clusterMeta.Uid = "uid-c1" // as the API gives every resource it creates
	w.create("clusters", "c1", &typesv1.Cluster{Metadata: clusterMeta, Spec: &typesv1.ClusterSpec{
		KubernetesVersion: "v1.34.4", PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12", ControlPlaneEndpoint: "10.0.0.10:6443", DnsDomain: "cluster.local"}})
	w.create("controlplanes", "cp", &typesv1.ControlPlane{Metadata: meta("cp"), Spec: &typesv1.ControlPlaneSpec{
		Cluster: "c1", Replicas: int32(cpReplicas), Version: "v1.34.4", Image: sim.ImageName}})
	w.create("machinedeployments", "md", &typesv1.MachineDeployment{Metadata: meta("md"), Spec: &typesv1.MachineDeploymentSpec{
		Cluster: "c1", Replicas: int32(workers), Version: "v1.34.4", Image: sim.ImageName}})
}

func (w *world) machines() []*typesv1.Machine {
	items, _, err := w.st.List(w.ctx, "machines", func() proto.Message { return &typesv1.Machine{} }, store.ListOptions{})
	require.NoError(w.t, err)
	out := make([]*typesv1.Machine, len(items))
	for i, it := range items {
		out[i] = it.Msg.(*typesv1.Machine)
	}
	return out
}

// waitRunning waits until n machines are Running and NodeReady, or fails
// after a bound that only stops a hung test.
func (w *world) waitRunning(n int) []*typesv1.Machine {
	w.t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ms := w.machines()
		running := 0
		for _, m := range ms {
			require.NotEqual(w.t, clusterexec.PhaseFailed, m.GetStatus().GetPhase(), "machine %s: %v", m.GetMetadata().GetName(), m.GetStatus().GetConditions())
			if m.GetStatus().GetPhase() == clusterexec.PhaseRunning && conditions.IsTrue(m.GetStatus().GetConditions(), "NodeReady") {
				running++
			}
		}
		if running == n && len(ms) == n {
			return ms
		}
		if time.Now().After(deadline) {
			for _, m := range ms {
				w.t.Logf("machine %s: phase %s %v", m.GetMetadata().GetName(), m.GetStatus().GetPhase(), m.GetStatus().GetConditions())
			}
			w.t.Fatalf("%d of %d machines Running", running, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func count(calls []sim.Call, method string, attached bool) int {
	n := 0
	for _, c := range calls {
		if c.Method == method && c.Attached == attached {
			n++
		}
	}
	return n
}

// TestClusterConverges applies a cluster with one control-plane machine
// and two workers to four hosts: three machines end Running on
// Provisioned hosts, the control plane is initialised before any worker
// joins, the CA hash is in the cluster's status and the join credentials
// only in the sealed secret.
func TestClusterConverges(t *testing.T) {
	w := newWorld(t, 0)
	w.apply(4, 1, 2)
	stop := w.start()
	defer stop()

	ms := w.waitRunning(3)
	roles := map[string]int{}
	for _, m := range ms {
		roles[m.GetSpec().GetRole()]++
		h := &typesv1.Host{}
		_, err := w.st.Get(w.ctx, "hosts", m.GetSpec().GetHost(), h)
		require.NoError(t, err)
		require.Equal(t, typesv1.HostState_HOST_STATE_PROVISIONED, h.GetStatus().GetState(), "host %s", h.GetMetadata().GetName())
		require.Equal(t, m.GetMetadata().GetName(), h.GetStatus().GetMachine(), "host %s bound machine", h.GetMetadata().GetName())
		require.Equal(t, m.GetSpec().GetRole(), w.kubeadm.Node(m.GetSpec().GetHost()), "node role on host %s", m.GetSpec().GetHost())
		// A worker names its MachineDeployment in a label, which a
		// pool's HealthCheck selects (controller/topologyplan).
		if md, ok := strings.CutPrefix(m.GetSpec().GetOwner(), "MachineDeployment/"); ok {
			require.Equal(t, md, m.GetMetadata().GetLabels()["deployment"], "machine %s labels", m.GetMetadata().GetName())
		}
	}
	require.Equal(t, map[string]int{"control-plane": 1, "worker": 2}, roles)

	// The Cluster sums it up: Ready once every node is Ready and answers
	// a cluster DNS query.
	c := &typesv1.Cluster{}
	require.Eventually(t, func() bool {
		c = &typesv1.Cluster{}
		_, err := w.st.Get(w.ctx, "clusters", "c1", c)
		return err == nil && conditions.IsTrue(c.GetStatus().GetConditions(), clusterplan.ConditionReady)
	}, 60*time.Second, 100*time.Millisecond, "cluster c1 never Ready: %v", c.GetStatus())
	require.Equal(t, clusterplan.ClusterReady, c.GetStatus().GetPhase())
	require.Contains(t, conditions.Get(c.GetStatus().GetConditions(), clusterplan.ConditionReady).GetMessage(), "3 machines Ready")
	require.True(t, strings.HasPrefix(c.GetStatus().GetCaHash(), "sha256:"), "cluster caHash = %q", c.GetStatus().GetCaHash())

	boot, err := clusterexec.LoadBootstrap(w.ctx, w.st, "c1")
	require.NoError(t, err)
	require.NotEmpty(t, boot.JoinToken)
	for _, m := range append([]proto.Message{c}, toMsgs(ms)...) {
		b, err := proto.Marshal(m)
		require.NoError(t, err)
		require.NotContains(t, string(b), boot.JoinToken, "join token stored in a resource")
		require.NotContains(t, string(b), boot.CertificateKey, "certificate key stored in a resource")
	}
	evs, err := w.rec.List(w.ctx, "", "", 0)
	require.NoError(t, err)
	for _, ev := range evs {
		require.NotContains(t, ev.String(), boot.JoinToken, "join token in an event")
	}

	calls := w.kubeadm.Calls()
	initAt, joins := -1, 0
	for i, call := range calls {
		switch call.Method {
		case "KubeadmInit":
			if initAt < 0 {
				initAt = i
			}
		case "KubeadmJoin":
			joins++
			require.True(t, initAt >= 0 && initAt < i, "KubeadmJoin on %s (call %d) before KubeadmInit (call %d)", call.Host, i, initAt)
		}
	}
	require.Equal(t, 1, count(calls, "KubeadmInit", false), "KubeadmInit runs")
	require.Equal(t, 2, count(calls, "KubeadmJoin", false), "KubeadmJoin runs")
	require.Equal(t, 3, count(calls, "Prepare", false), "Prepare runs")
}

func toMsgs(ms []*typesv1.Machine) []proto.Message {
	out := make([]proto.Message, len(ms))
	for i, m := range ms {
		out[i] = m
	}
	return out
}

// TestRestartMidInit stops the executors while kubeadm init runs and
// starts new ones: they re-attach to the running init by its operation id
// instead of running it a second time.
func TestRestartMidInit(t *testing.T) {
	w := newWorld(t, 500*time.Millisecond)
	w.apply(3, 1, 1)
	stop := w.start()
	deadline := time.Now().Add(2 * time.Minute)
	for count(w.kubeadm.Calls(), "KubeadmInit", false) == 0 {
		require.True(t, time.Now().Before(deadline), "KubeadmInit never started")
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	c := &typesv1.Cluster{}
	_, err := w.st.Get(w.ctx, "clusters", "c1", c)
	require.NoError(t, err)
	require.Empty(t, c.GetStatus().GetCaHash(), "caHash set before the restart: the init was not cut short")

	stop = w.start()
	defer stop()
	w.waitRunning(2)
	calls := w.kubeadm.Calls()
	require.Equal(t, 1, count(calls, "KubeadmInit", false), "KubeadmInit runs across the restart")
	require.GreaterOrEqual(t, count(calls, "KubeadmInit", true), 1, "KubeadmInit re-attached after the restart")
	// The re-attached bootstrap is not prepared and checked again (on a
	// real node its preflight fails: kubeadm's ports are in use).
	require.Equal(t, 2, count(calls, "Prepare", false), "Prepare runs (control plane + worker)")
}

// TestPreflightRefuses makes the control-plane host's preflight fail: the
// machine is not bootstrapped and says why and how to fix it; once the
// host is fixed it is.
func TestPreflightRefuses(t *testing.T) {
	w := newWorld(t, 0)
	for i := 1; i <= 1; i++ {
		w.kubeadm.FailPreflight(fmt.Sprintf("h%d", i), &agentv1.Check{Name: "br_netfilter", Severity: agentv1.Severity_SEVERITY_ERROR,
			Message: "bridge-nf-call-iptables is 0", Fix: "modprobe br_netfilter"})
	}
	w.apply(1, 1, 0)
	stop := w.start()
	defer stop()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ms := w.machines()
		if len(ms) == 1 {
			if c := conditions.Get(ms[0].GetStatus().GetConditions(), clusterexec.ConditionBootstrapFailed); c != nil {
				require.Equal(t, clusterexec.PhaseFailed, ms[0].GetStatus().GetPhase())
				require.Equal(t, "PreflightFailed", c.GetReason())
				require.Contains(t, c.GetMessage(), "bridge-nf-call-iptables is 0")
				require.Contains(t, c.GetMessage(), "modprobe br_netfilter")
				break
			}
		}
		require.True(t, time.Now().Before(deadline), "no BootstrapFailed condition: %v", ms)
		time.Sleep(50 * time.Millisecond)
	}
	require.Equal(t, 0, count(w.kubeadm.Calls(), "KubeadmInit", false), "KubeadmInit ran despite the failed preflight")

	// Fixed on the host: the next pass bootstraps it.
	w.kubeadm.FailPreflight("h1", nil)
	for {
		ms := w.machines()
		require.Len(t, ms, 1)
		if ms[0].GetStatus().GetPhase() == clusterexec.PhaseRunning {
			c := conditions.Get(ms[0].GetStatus().GetConditions(), clusterexec.ConditionBootstrapFailed)
			require.Equal(t, conditions.False, c.GetStatus(), "BootstrapFailed after the fix")
			break
		}
		require.True(t, time.Now().Before(deadline), "not Running after the fix: %v", ms[0].GetStatus())
		time.Sleep(50 * time.Millisecond)
	}
}

// TestPreflightWaiting: a preflight refused only by a check in progress
// (the first boot's image import, which takes 5-11 minutes under TCG) is
// retried on the short fixed WaitInterval, not the refusal backoff (an
// hour here, so a retry on it would never come), and the machine says
// what it waits for without being Failed; once the check passes the node
// is bootstrapped.
func TestPreflightWaiting(t *testing.T) {
	w := newWorld(t, 0)
	w.machineCfg = machineplan.Config{
		RefusalBackoff: backoff.Policy{Base: time.Hour, Max: time.Hour},
		WaitInterval:   200 * time.Millisecond,
	}
	const importing = "kiln-import-images.service is running; its log: importing 3/7 kube-apiserver.tar"
	w.kubeadm.FailPreflight("h1", &agentv1.Check{Name: "offline-images", Severity: agentv1.Severity_SEVERITY_ERROR,
		Message: importing, Fix: "wait", InProgress: true})
	w.apply(1, 1, 0)
	stop := w.start()
	defer stop()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ms := w.machines()
		if len(ms) == 1 {
			conds := ms[0].GetStatus().GetConditions()
			if op := conditions.Get(conds, machineplan.ConditionOperation); op.GetReason() == machineplan.ReasonWaiting {
				require.Contains(t, op.GetMessage(), "preflight check offline-images in progress: "+importing)
				bf := conditions.Get(conds, clusterexec.ConditionBootstrapFailed)
				require.Equal(t, conditions.False, bf.GetStatus(), "BootstrapFailed while waiting: %v", bf)
				require.Equal(t, machineplan.ReasonPreflightWaiting, bf.GetReason())
				require.Contains(t, bf.GetMessage(), importing, "BootstrapFailed does not say what is waited for")
				require.Equal(t, clusterexec.PhaseBootstrapping, ms[0].GetStatus().GetPhase())
				break
			}
		}
		require.True(t, time.Now().Before(deadline), "no BootstrapOperation=Waiting: %v", ms)
		time.Sleep(50 * time.Millisecond)
	}
	// Still importing: retried again (not once and then an hour later).
	for count(w.kubeadm.Calls(), "Preflight", false) < 3 {
		require.True(t, time.Now().Before(deadline), "preflight not retried while waiting: %d calls", count(w.kubeadm.Calls(), "Preflight", false))
		time.Sleep(50 * time.Millisecond)
	}
	w.kubeadm.FailPreflight("h1", nil) // imported
	w.waitRunning(1)
	require.Equal(t, 1, count(w.kubeadm.Calls(), "KubeadmInit", false), "KubeadmInit runs once, after the wait")
}

// TestScaleDown lowers the deployment from two workers to one: the
// removed machine's node is reset (kubeadm reset), its host unbound,
// wiped by the host lifecycle and Available again, the Machine deleted;
// without a drainer the Drained condition says the node was not drained.
func TestScaleDown(t *testing.T) {
	w := newWorld(t, 0)
	w.apply(3, 1, 2)
	stop := w.start()
	defer stop()
	before := w.waitRunning(3)

	w.scale("md", 1)

	after := w.waitRunning(2)
	kept := map[string]bool{}
	for _, m := range after {
		kept[m.GetMetadata().GetName()] = true
	}
	var gone *typesv1.Machine
	for _, m := range before {
		if !kept[m.GetMetadata().GetName()] {
			gone = m
		}
	}
	require.NotNil(t, gone, "no machine removed")
	require.Equal(t, "worker", gone.GetSpec().GetRole())
	host := gone.GetSpec().GetHost()

	deadline := time.Now().Add(2 * time.Minute)
	for {
		h := &typesv1.Host{}
		_, err := w.st.Get(w.ctx, "hosts", host, h)
		require.NoError(t, err)
		if h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE && h.GetStatus().GetMachine() == "" {
			break
		}
		require.True(t, time.Now().Before(deadline), "host %s not Available and unbound: %s machine=%q", host, h.GetStatus().GetState(), h.GetStatus().GetMachine())
		time.Sleep(50 * time.Millisecond)
	}
	require.Empty(t, w.kubeadm.Node(host), "host %s still runs a node", host)
	var resets []string
	for _, c := range w.kubeadm.Calls() {
		if c.Method == "KubeadmReset" && !c.Attached {
			resets = append(resets, c.Host)
		}
	}
	require.Equal(t, []string{host}, resets, "KubeadmReset runs")
	require.Empty(t, w.fleet.Host(host).DiskImage(), "host %s disk not wiped", host)

	evs, err := w.rec.List(w.ctx, "machines", gone.GetMetadata().GetName(), 0)
	require.NoError(t, err)
	var reasons []string
	for _, ev := range evs {
		reasons = append(reasons, ev.GetReason())
	}
	require.Contains(t, reasons, "DrainSkipped", "events of %s", gone.GetMetadata().GetName())
}

// TestMachineDeletedThroughAPI deletes a worker Machine directly (as
// `kilnctl delete machine` does): its host is released, wiped and
// Available, and the deployment makes a replacement on the spare host
// (h4: spares are taken in name order).
func TestMachineDeletedThroughAPI(t *testing.T) {
	w := newWorld(t, 0)
	w.apply(4, 1, 2)
	stop := w.start()
	defer stop()
	before := w.waitRunning(3)
	var victim *typesv1.Machine
	for _, m := range before {
		if m.GetSpec().GetRole() == "worker" {
			victim = m
			break
		}
	}
	require.NotNil(t, victim)
	require.NoError(t, w.st.Delete(w.ctx, "machines", victim.GetMetadata().GetName(), 0))

	deadline := time.Now().Add(2 * time.Minute)
	for {
		h := &typesv1.Host{}
		_, err := w.st.Get(w.ctx, "hosts", victim.GetSpec().GetHost(), h)
		require.NoError(t, err)
		if h.GetStatus().GetMachine() == "" && h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE {
			break
		}
		require.True(t, time.Now().Before(deadline), "host %s still bound to deleted %s: %s", h.GetMetadata().GetName(), victim.GetMetadata().GetName(), h.GetStatus().GetState())
		time.Sleep(50 * time.Millisecond)
	}
	require.Empty(t, w.fleet.Host(victim.GetSpec().GetHost()).DiskImage(), "released host not wiped")
	after := w.waitRunning(3)
	for _, m := range after {
		require.NotEqual(t, victim.GetMetadata().GetName(), m.GetMetadata().GetName())
	}
}

// TestClusterDeleted: deleting a running Cluster through the API deletes
// its machines and its sealed bootstrap credentials, and every host it
// used is wiped and becomes Available again; its ControlPlane and
// MachineDeployment stay but create nothing without the Cluster. A
// Machine that was not created for a Cluster (by hand, or by simulation
// mode) is left alone.
func TestClusterDeleted(t *testing.T) {
	w := newWorld(t, 0)
	w.apply(4, 1, 2)
	stop := w.start()
	defer stop()
	running := w.waitRunning(3)
	w.create("machines", "by-hand", &typesv1.Machine{Metadata: &typesv1.ObjectMeta{Name: "by-hand", Generation: 1},
		Spec: &typesv1.MachineSpec{Cluster: "not-yet", Role: "worker"}})
	for _, m := range running {
		require.Equal(t, "uid-c1", m.GetMetadata().GetAnnotations()[clusterexec.AnnotationClusterUID], "machine %s does not name its cluster's uid", m.GetMetadata().GetName())
	}
	_, err := clusterexec.LoadBootstrap(w.ctx, w.st, "c1")
	require.NoError(t, err, "a running cluster has bootstrap credentials")

	require.NoError(t, w.st.Delete(w.ctx, "clusters", "c1", 0))

	deadline := time.Now().Add(2 * time.Minute)
	for {
		free := 0
		for _, m := range running {
			h := &typesv1.Host{}
			_, err := w.st.Get(w.ctx, "hosts", m.GetSpec().GetHost(), h)
			require.NoError(t, err)
			if h.GetStatus().GetMachine() == "" && h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE {
				free++
			}
		}
		if free == len(running) && len(w.machines()) == 1 {
			break
		}
		require.True(t, time.Now().Before(deadline), "%d of %d hosts of the deleted cluster Available, %d machines left (want only by-hand)", free, len(running), len(w.machines()))
		time.Sleep(50 * time.Millisecond)
	}
	for _, m := range running {
		require.Empty(t, w.fleet.Host(m.GetSpec().GetHost()).DiskImage(), "host %s of the deleted cluster not wiped", m.GetSpec().GetHost())
	}
	_, err = clusterexec.LoadBootstrap(w.ctx, w.st, "c1")
	require.True(t, errdefs.IsNotFound(err), "bootstrap credentials of the deleted cluster: %v, want NotFound", err)

	// Nothing comes back while the Cluster is gone, and the hand-made
	// Machine stays: after the executor has stopped, a whole pass of a new
	// one (as a new leader's first: the clean-up, then the deleted
	// cluster's name) is run here to its end, instead of a sleep that bets
	// a pass happened.
	stop()
	ex := w.executor()
	require.NoError(t, ex.Collect(w.ctx))
	require.NoError(t, ex.Reconcile(w.ctx, "c1"))
	ex.Wait()
	ms := w.machines()
	require.Len(t, ms, 1, "machines created for a deleted cluster")
	require.Equal(t, "by-hand", ms[0].GetMetadata().GetName())
}

// TestHealthCheckReplaces makes a worker's node NotReady: after the
// HealthCheck's timeout the machine is deleted (node reset, host wiped)
// and the deployment replaces it (on the spare host, or on the same host
// once it is reimaged); the Cluster gets a Remediated event.
func TestHealthCheckReplaces(t *testing.T) {
	w := newWorld(t, 0)
	w.apply(4, 1, 2)
	w.create("healthchecks", "hc", &typesv1.HealthCheck{Metadata: &typesv1.ObjectMeta{Name: "hc", Generation: 1, CreationTimestamp: timestamppb.Now()},
		Spec: &typesv1.HealthCheckSpec{Cluster: "c1", Selector: map[string]string{"cluster": "c1", "role": "worker"}, MaxUnhealthy: "1",
			UnhealthyConditions: []*typesv1.UnhealthyCondition{{Type: "NodeReady", Status: "False", Timeout: "1s"}}}})
	stop := w.start()
	defer stop()
	before := w.waitRunning(3)
	var victim *typesv1.Machine
	for _, m := range before {
		if m.GetSpec().GetRole() == "worker" {
			victim = m
			break
		}
	}
	require.NotNil(t, victim)
	w.kubeadm.NodeNotReady(victim.GetSpec().GetHost(), true)

	deadline := time.Now().Add(2 * time.Minute)
	for {
		gone := true
		for _, m := range w.machines() {
			if m.GetMetadata().GetName() == victim.GetMetadata().GetName() {
				gone = false
			}
		}
		if gone {
			break
		}
		require.True(t, time.Now().Before(deadline), "unhealthy machine %s not remediated", victim.GetMetadata().GetName())
		time.Sleep(50 * time.Millisecond)
	}
	w.kubeadm.NodeNotReady(victim.GetSpec().GetHost(), false)
	after := w.waitRunning(3)
	for _, m := range after {
		require.NotEqual(t, victim.GetMetadata().GetUid(), m.GetMetadata().GetUid(), "unhealthy machine still there")
		if m.GetSpec().GetHost() == victim.GetSpec().GetHost() {
			require.GreaterOrEqual(t, w.fleet.Host(m.GetSpec().GetHost()).Lays(), 2, "host %s reused without a reimage", m.GetSpec().GetHost())
		}
	}
	reset := false
	for _, c := range w.kubeadm.Calls() {
		reset = reset || (c.Method == "KubeadmReset" && c.Host == victim.GetSpec().GetHost())
	}
	require.True(t, reset, "unhealthy node on %s not reset", victim.GetSpec().GetHost())
	hc := &typesv1.HealthCheck{}
	_, err := w.st.Get(w.ctx, "healthchecks", "hc", hc)
	require.NoError(t, err)
	require.Equal(t, int32(2), hc.GetStatus().GetExpectedMachines(), "HealthCheck expected machines")
	// The Cluster says so too: a Rollout halts on it (controller/rolloutexec).
	evs, err := w.rec.List(w.ctx, clusterexec.ClustersKind, "c1", 0)
	require.NoError(t, err)
	remediated := false
	for _, ev := range evs {
		remediated = remediated || (ev.GetReason() == clusterexec.ReasonRemediated && strings.Contains(ev.GetMessage(), victim.GetMetadata().GetName()))
	}
	require.True(t, remediated, "no %s event on cluster c1 naming machine %s: %v", clusterexec.ReasonRemediated, victim.GetMetadata().GetName(), evs)
}
