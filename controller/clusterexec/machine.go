package clusterexec

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/liveness"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// advance brings machine name one step forward: bind its host, wait for
// the host to be provisioned, bootstrap, probe.
func (e *Executor) advance(ctx context.Context, name string) error {
	m := &typesv1.Machine{}
	if _, err := e.deps.Store.Get(ctx, MachinesKind, name, m); err != nil {
		if errdefs.IsNotFound(err) {
			return nil
		}
		return err
	}
	if m.GetMetadata().GetDeletionTimestamp() != nil {
		e.startLong(ctx, m.GetSpec().GetCluster(), "DeleteMachine "+name, func(ctx context.Context) error { return e.deleteMachine(ctx, name, "") })
		return nil
	}
	hostName := m.GetSpec().GetHost()
	if err := e.bindOrRelease(ctx, name, hostName); err != nil {
		return err
	}
	h := &typesv1.Host{}
	if _, err := e.deps.Store.Get(ctx, HostsKind, hostName, h); err != nil {
		return err
	}
	if h.GetStatus().GetMachine() != name {
		return nil // released: another machine has the host
	}
	bootstrapped := conditions.IsTrue(m.GetStatus().GetConditions(), ConditionBootstrapped)
	if h.GetStatus().GetState() != typesv1.HostState_HOST_STATE_PROVISIONED {
		if !bootstrapped {
			c := hostBlocker(h)
			e.warnMachineHost(ctx, m, c)
			return e.setCondition(ctx, name, c, PhaseProvisioning)
		}
		return nil
	}
	if c := conditions.Get(m.GetStatus().GetConditions(), ConditionHostProvisioned); c != nil && c.GetStatus() != conditions.True {
		if err := e.setCondition(ctx, name, conditions.New(ConditionHostProvisioned, conditions.True, "Provisioned",
			fmt.Sprintf("host %s laid with image %s and booted", hostName, h.GetStatus().GetImage())), ""); err != nil {
			return err
		}
	}
	if !bootstrapped {
		e.startBootstrap(ctx, m, h)
		return nil
	}
	if conditions.Get(m.GetStatus().GetConditions(), clusterplan.MachineDrained) != nil {
		return nil // on its way out: no more probes
	}
	return e.probe(ctx, m, h)
}

// hostBlocker is the machine's HostProvisioned condition while its host h
// is not Provisioned: False, with the reason and message of what holds
// the host back (a False condition other than progress, such as
// ImageResolved, BMCReachable or Provisioned with a failed step; or the
// Error state's reason), else InProgress with the host's state and step.
func hostBlocker(h *typesv1.Host) *typesv1.Condition {
	name := h.GetMetadata().GetName()
	st := h.GetStatus()
	state := hostlife.StateName(st.GetState())
	where := state
	if s := st.GetProvisioningStep(); s != "" {
		where += ", step " + s
	}
	if state == "" {
		where = "not yet reconciled"
	}
	for _, c := range st.GetConditions() {
		// A missed heartbeat is expected while the host reboots.
		if c.GetStatus() != conditions.False || c.GetReason() == hostlife.ReasonInProgress || c.GetReason() == hostlife.ReasonNotWanted || c.GetType() == liveness.ConditionAgentReachable {
			continue
		}
		return conditions.New(ConditionHostProvisioned, conditions.False, c.GetReason(),
			fmt.Sprintf("host %s (%s): %s=False: %s (kilnctl describe host %s)", name, where, c.GetType(), c.GetMessage(), name))
	}
	if st.GetState() == typesv1.HostState_HOST_STATE_ERROR {
		return conditions.New(ConditionHostProvisioned, conditions.False, "HostError",
			fmt.Sprintf("host %s is in Error: %s (kilnctl describe host %s)", name, st.GetErrorReason(), name))
	}
	msg := fmt.Sprintf("host %s: %s", name, where)
	if le := st.GetLastError(); le != "" {
		msg += "; last error: " + le
	}
	return conditions.New(ConditionHostProvisioned, conditions.False, hostlife.ReasonInProgress, msg)
}

// warnMachineHost records a Warning event on m when its host newly holds
// it back for a reason other than progress.
func (e *Executor) warnMachineHost(ctx context.Context, m *typesv1.Machine, c *typesv1.Condition) {
	if e.deps.Recorder == nil || c.GetReason() == hostlife.ReasonInProgress {
		return
	}
	if old := conditions.Get(m.GetStatus().GetConditions(), c.GetType()); old != nil && old.GetReason() == c.GetReason() && old.GetMessage() == c.GetMessage() {
		return
	}
	e.deps.Recorder.Record(ctx, MachinesKind, m.GetMetadata().GetName(), "Warning", c.GetReason(), c.GetMessage())
}

// startBootstrap runs bootstrap for m in the background unless it runs
// already.
func (e *Executor) startBootstrap(ctx context.Context, m *typesv1.Machine, h *typesv1.Host) {
	name := m.GetMetadata().GetName()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.booting[name] {
		return
	}
	e.booting[name] = true
	e.boots.Add(1)
	go func() {
		defer e.boots.Done()
		defer func() { e.mu.Lock(); delete(e.booting, name); e.mu.Unlock() }()
		select {
		case e.bootSem <- struct{}{}:
			defer func() { <-e.bootSem }()
		case <-ctx.Done():
			return
		}
		if err := e.bootstrap(ctx, m, h); err != nil && ctx.Err() == nil {
			e.log.Warn("bootstrap", "machine", name, "err", err)
		}
	}()
}

func (e *Executor) machineConditions(ctx context.Context, name string) []*typesv1.Condition {
	m := &typesv1.Machine{}
	if _, err := e.deps.Store.Get(ctx, MachinesKind, name, m); err != nil {
		return nil
	}
	return m.GetStatus().GetConditions()
}

func (e *Executor) setPhase(ctx context.Context, name, phase string) error {
	return e.updateMachine(ctx, name, func(m *typesv1.Machine) bool {
		if m.Status.Phase == phase {
			return false
		}
		m.Status.Phase = phase
		return true
	})
}

func (e *Executor) setCondition(ctx context.Context, name string, c *typesv1.Condition, phase string) error {
	now := e.cfg.Clock()
	return e.updateMachine(ctx, name, func(m *typesv1.Machine) bool {
		var changed bool
		m.Status.Conditions, changed = conditions.Set(m.Status.Conditions, c, now)
		if phase != "" && m.Status.Phase != phase {
			m.Status.Phase, changed = phase, true
		}
		return changed
	})
}

// opID is the id of the machine's operation kind: the same across
// controller restarts, new for a new Machine (uid) or a new attempt.
func opID(m *typesv1.Machine, kind string) string {
	uid := m.GetMetadata().GetUid()
	if uid == "" {
		uid = strconv.FormatInt(m.GetMetadata().GetCreationTimestamp().AsTime().Unix(), 10)
	}
	id := kind + "." + m.GetMetadata().GetName() + "." + uid
	if a := m.GetMetadata().GetAnnotations()[AnnotationAttempt]; a != "" && a != "0" {
		id += ".a" + a
	}
	return id
}

// clusterConfig is what the agent is told of the cluster for machine m on
// host h. A control-plane node advertises its API server on the address
// the controller reaches its agent at: the network the hosts share, not
// whichever interface holds the node's default route.
func clusterConfig(c *typesv1.Cluster, m *typesv1.Machine, h *typesv1.Host) *agentv1.ClusterConfig {
	s := c.GetSpec()
	v := m.GetSpec().GetVersion()
	if v == "" {
		v = s.GetKubernetesVersion()
	}
	advertise := ""
	if m.GetSpec().GetRole() == clusterplan.RoleControlPlane {
		if host, _, err := net.SplitHostPort(h.GetStatus().GetAgent().GetAddress()); err == nil && net.ParseIP(host) != nil && !net.ParseIP(host).IsUnspecified() {
			advertise = host
		}
	}
	return &agentv1.ClusterConfig{
		AdvertiseAddress:     advertise,
		Name:                 c.GetMetadata().GetName(),
		KubernetesVersion:    v,
		PodCidr:              s.GetPodCidr(),
		ServiceCidr:          s.GetServiceCidr(),
		ControlPlaneEndpoint: s.GetControlPlaneEndpoint(),
		DnsDomain:            s.GetDnsDomain(),
		CloudProvider:        s.GetCloudProvider(),
		Role:                 m.GetSpec().GetRole(),
		NodeName:             m.GetSpec().GetHost(),
	}
}

func bootstrapMode(m *typesv1.Machine) string {
	if b := m.GetMetadata().GetAnnotations()[AnnotationBootstrap]; b != "" {
		return b
	}
	if m.GetSpec().GetRole() == clusterplan.RoleControlPlane {
		return clusterplan.BootstrapJoinControlPlane
	}
	return clusterplan.BootstrapJoin
}

// bootstrap prepares, checks and joins (or inits) the node of m on h.
func (e *Executor) bootstrap(ctx context.Context, m *typesv1.Machine, h *typesv1.Host) error {
	name := m.GetMetadata().GetName()
	c := &typesv1.Cluster{}
	if _, err := e.deps.Store.Get(ctx, ClustersKind, m.GetSpec().GetCluster(), c); err != nil {
		return err
	}
	mode := bootstrapMode(m)
	var boot *Bootstrap
	if mode != clusterplan.BootstrapInit {
		// A join needs the init's credentials: wait for them.
		b, err := LoadBootstrap(ctx, e.deps.Store, c.GetMetadata().GetName())
		if errdefs.IsNotFound(err) || (err == nil && c.GetStatus().GetCaHash() == "") {
			return e.setPhase(ctx, name, PhaseWaiting)
		}
		if err != nil {
			return err
		}
		boot = b
	}
	if m.GetStatus().GetPhase() != PhaseFailed { // Failed stays until a success
		if err := e.setPhase(ctx, name, PhaseBootstrapping); err != nil {
			return err
		}
	}
	agent, err := e.deps.Agents(ctx, h)
	if err != nil {
		return errdefs.Unavailable("dial agent of host %s: %w", h.GetMetadata().GetName(), err)
	}
	cfg := clusterConfig(c, m, h)
	if mode == clusterplan.BootstrapJoinControlPlane {
		if err := e.prepareJoin(ctx, c, m, boot); err != nil {
			return err
		}
	}

	opCtx, cancel := context.WithTimeout(ctx, e.cfg.OperationTimeout)
	defer cancel()

	// A restarted controller (or a new leader) re-attaches to the kubeadm
	// init or join the agent already runs or ran under this machine's
	// operation id: preparing and checking again a node that is being (or
	// was) joined fails its preflight (its ports are in use).
	mainID := opID(m, "join")
	if mode == clusterplan.BootstrapInit {
		mainID = opID(m, "init")
	}
	var prior *agentv1.OperationEvent
	var priorErr error
	attached := false
	if st, err := agent.Operation(opCtx, &agentv1.OperationRequest{OperationId: mainID}); err == nil {
		prior, priorErr = follow(st)
		attached = !errdefs.IsNotFound(priorErr)
	}
	var stream eventStream
	if err := e.fence(ctx, "bootstrap of machine "+name); err != nil {
		return err
	}
	if !attached {
		start := e.cfg.Clock()
		st, err := agent.Prepare(opCtx, &agentv1.PrepareRequest{OperationId: opID(m, "prepare")})
		if err != nil {
			err = errgrpc.FromGRPC(err)
			e.observe("Prepare", start, err)
			return fmt.Errorf("prepare: %w", err)
		}
		_, err = follow(st)
		e.observe("Prepare", start, err)
		if err != nil {
			return e.operationFailed(ctx, m, "PrepareFailed", fmt.Errorf("prepare: %w", err))
		}

		start = e.cfg.Clock()
		callCtx, cancelCall := context.WithTimeout(ctx, e.cfg.CallTimeout)
		report, err := agent.Preflight(callCtx, &agentv1.PreflightRequest{Cluster: cfg})
		cancelCall()
		if err != nil {
			err = errgrpc.FromGRPC(err)
			e.observe("Preflight", start, err)
			return fmt.Errorf("preflight: %w", err)
		}
		msg := failedChecks(report)
		var refused error
		if msg != "" {
			refused = errdefs.FailedPrecondition("%s", msg)
		}
		e.observe("Preflight", start, refused)
		if msg != "" {
			if prev := conditions.Get(m.GetStatus().GetConditions(), ConditionBootstrapFailed); prev.GetStatus() != conditions.True || prev.GetMessage() != msg {
				e.event(ctx, name, "Warning", "PreflightFailed", msg)
			}
			return e.setCondition(ctx, name, conditions.New(ConditionBootstrapFailed, conditions.True, "PreflightFailed", msg), PhaseFailed)
		}
	} else {
		e.log.Info("re-attached to a running bootstrap", "machine", name, "operation", mainID)
	}
	result := func() (*agentv1.OperationEvent, error) {
		if attached {
			return prior, priorErr
		}
		return follow(stream)
	}

	// A kubeadm run is timed from its start here; one re-attached to
	// after a restart is not timed (its start is not known).
	mainStart := e.cfg.Clock()
	observeMain := func(op string, err error) {
		if !attached {
			e.observe(op, mainStart, err)
		}
	}
	var initResult *agentv1.KubeadmInitResult
	switch mode {
	case clusterplan.BootstrapInit:
		if !attached {
			st, err := agent.KubeadmInit(opCtx, &agentv1.KubeadmInitRequest{OperationId: mainID, Cluster: cfg, UploadCerts: true})
			if err != nil {
				err = errgrpc.FromGRPC(err)
				observeMain("KubeadmInit", err)
				return fmt.Errorf("kubeadm init: %w", err)
			}
			stream = st
		}
		ev, err := result()
		observeMain("KubeadmInit", err)
		if err != nil {
			return e.operationFailed(ctx, m, "KubeadmInitFailed", fmt.Errorf("kubeadm init: %w", err))
		}
		initResult = ev.GetKubeadmInit()
		if initResult.GetCaHash() == "" {
			return e.operationFailed(ctx, m, "KubeadmInitFailed", errors.New("kubeadm init returned no CA hash"))
		}
		if err := e.saveInit(ctx, c.GetMetadata().GetName(), cfg.GetControlPlaneEndpoint(), initResult); err != nil {
			return err
		}
	default:
		cp := mode == clusterplan.BootstrapJoinControlPlane
		req := &agentv1.KubeadmJoinRequest{
			OperationId:       opID(m, "join"),
			Cluster:           cfg,
			ApiServerEndpoint: boot.APIServerEndpoint,
			Token:             boot.JoinToken,
			CaHash:            c.GetStatus().GetCaHash(),
			ControlPlane:      cp,
		}
		if cp {
			req.CertificateKey = boot.CertificateKey
		}
		if !attached {
			st, err := agent.KubeadmJoin(opCtx, req)
			if err != nil {
				err = errgrpc.FromGRPC(err)
				observeMain("KubeadmJoin", err)
				return fmt.Errorf("kubeadm join: %w", err)
			}
			stream = st
		}
		_, err := result()
		observeMain("KubeadmJoin", err)
		if err != nil {
			return e.operationFailed(ctx, m, "KubeadmJoinFailed", fmt.Errorf("kubeadm join: %w", err))
		}
	}

	now := e.cfg.Clock()
	e.event(ctx, name, "Normal", "Bootstrapped", fmt.Sprintf("node %s joined the cluster (%s)", h.GetMetadata().GetName(), mode))
	e.log.Info("machine bootstrapped", "machine", name, "mode", mode)
	return e.updateMachine(ctx, name, func(x *typesv1.Machine) bool {
		x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, conditions.New(ConditionBootstrapped, conditions.True, "Kubeadm"+strings.ReplaceAll(titleMode(mode), "-", ""), ""), now)
		if conditions.Get(x.Status.Conditions, ConditionBootstrapFailed) != nil {
			x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, conditions.New(ConditionBootstrapFailed, conditions.False, "Bootstrapped", ""), now)
		}
		x.Status.Phase = PhaseRunning
		x.Status.NodeName = x.GetSpec().GetHost()
		x.Status.BootstrapTime = timestamppb.New(now)
		if x.GetSpec().GetRole() == clusterplan.RoleControlPlane {
			x.Status.EtcdMember = x.Status.NodeName
		}
		return true
	})
}

func titleMode(mode string) string {
	switch mode {
	case clusterplan.BootstrapInit:
		return "Init"
	case clusterplan.BootstrapJoinControlPlane:
		return "JoinControlPlane"
	}
	return "Join"
}

// failedChecks describes the failed ERROR checks of a preflight report
// ("" when it passed), each with its fix.
func failedChecks(r *agentv1.PreflightReport) string {
	var parts []string
	for _, c := range r.GetChecks() {
		if c.GetPassed() || c.GetSeverity() != agentv1.Severity_SEVERITY_ERROR {
			continue
		}
		s := fmt.Sprintf("preflight check %s failed: %s", c.GetName(), c.GetMessage())
		if c.GetFix() != "" {
			s += " (fix: " + c.GetFix() + ")"
		}
		parts = append(parts, s)
	}
	if len(parts) == 0 && !r.GetPassed() {
		parts = append(parts, "preflight failed")
	}
	return strings.Join(parts, "; ")
}

// operationFailed records a failed bootstrap operation: condition
// BootstrapFailed, phase Failed, and a new attempt number so the next
// pass starts a new operation. An unreachable agent (a broken stream) is
// no failure: the next pass re-attaches under the same id.
func (e *Executor) operationFailed(ctx context.Context, m *typesv1.Machine, reason string, err error) error {
	if errdefs.IsUnavailable(err) || ctx.Err() != nil {
		return err
	}
	name := m.GetMetadata().GetName()
	e.event(ctx, name, "Warning", reason, err.Error())
	now := e.cfg.Clock()
	return e.updateMachine(ctx, name, func(x *typesv1.Machine) bool {
		x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, conditions.New(ConditionBootstrapFailed, conditions.True, reason, err.Error()), now)
		x.Status.Phase = PhaseFailed
		if x.Metadata.Annotations == nil {
			x.Metadata.Annotations = map[string]string{}
		}
		n, _ := strconv.Atoi(x.Metadata.Annotations[AnnotationAttempt])
		x.Metadata.Annotations[AnnotationAttempt] = strconv.Itoa(n + 1)
		return true
	})
}

// saveInit seals the init's credentials in the store, then publishes the
// CA hash in the cluster's status (joins wait for both).
func (e *Executor) saveInit(ctx context.Context, cluster, endpoint string, r *agentv1.KubeadmInitResult) error {
	if ep := r.GetApiServerEndpoint(); ep != "" {
		endpoint = ep
	}
	b, err := json.Marshal(Bootstrap{JoinToken: r.GetJoinToken(), CertificateKey: r.GetCertificateKey(), Kubeconfig: r.GetKubeconfig(), APIServerEndpoint: endpoint})
	if err != nil {
		return err
	}
	if err := e.deps.Store.PutSecret(ctx, BootstrapSecretPath(cluster), b); err != nil {
		return fmt.Errorf("cluster %s: store bootstrap credentials: %w", cluster, err)
	}
	for {
		c := &typesv1.Cluster{}
		rev, err := e.deps.Store.Get(ctx, ClustersKind, cluster, c)
		if err != nil {
			return err
		}
		if c.Status == nil {
			c.Status = &typesv1.ClusterStatus{}
		}
		if c.Status.CaHash == r.GetCaHash() {
			return nil
		}
		c.Status.CaHash = r.GetCaHash()
		_, err = e.deps.Store.Update(ctx, ClustersKind, cluster, c, rev)
		if errdefs.IsConflict(err) && ctx.Err() == nil {
			continue
		}
		if err == nil && e.deps.Recorder != nil {
			e.deps.Recorder.Record(ctx, ClustersKind, cluster, "Normal", "Initialized", "kubeadm init done; CA hash "+r.GetCaHash())
		}
		return err
	}
}

// probe asks the agent how the node is and stores the conditions.
func (e *Executor) probe(ctx context.Context, m *typesv1.Machine, h *typesv1.Host) error {
	name := m.GetMetadata().GetName()
	c := &typesv1.Cluster{}
	if _, err := e.deps.Store.Get(ctx, ClustersKind, m.GetSpec().GetCluster(), c); err != nil {
		return err
	}
	var conds []*typesv1.Condition
	agent, err := e.deps.Agents(ctx, h)
	if err == nil {
		callCtx, cancel := context.WithTimeout(ctx, e.cfg.CallTimeout)
		var resp *agentv1.ProbeResponse
		resp, err = agent.Probe(callCtx, &agentv1.ProbeRequest{Cluster: clusterConfig(c, m, h)})
		cancel()
		err = errgrpc.FromGRPC(err)
		conds = resp.GetConditions()
	}
	if err != nil {
		conds = []*typesv1.Condition{conditions.New(clusterplan.MachineNodeReady, conditions.Unknown, "ProbeFailed", err.Error())}
	}
	now := e.cfg.Clock()
	return e.updateMachine(ctx, name, func(x *typesv1.Machine) bool {
		changed := false
		for _, cond := range conds {
			var ch bool
			x.Status.Conditions, ch = conditions.Set(x.Status.Conditions, cond, now)
			changed = changed || ch
		}
		if x.Status.NodeReadyTime == nil && conditions.IsTrue(x.Status.Conditions, clusterplan.MachineNodeReady) {
			x.Status.NodeReadyTime = timestamppb.New(now)
			changed = true
		}
		return changed
	})
}

// Drain condition reasons the executor sets.
const (
	// ReasonDraining: the drain runs (Drained=False).
	ReasonDraining = "Draining"
	// ReasonDrainTimeout: the drain did not finish by its deadline. With
	// Drained=False the removal halts and the drain is tried again; with
	// Drained=True (the MachineDeployment's nodeDrainTimeout) the removal
	// went on without it.
	ReasonDrainTimeout = "DrainTimeout"
)

// drain cordons and drains the machine's node with the cluster's admin
// kubeconfig, by a deadline: the action's Timeout, else
// Config.DrainTimeout; never unbounded. When the deadline passes it
// sets Drained to what a.Proceed says (True: the removal goes on; False:
// it halts and the next pass drains again), reason DrainTimeout, with a
// message naming the node, the deadline and what to check. Without an
// admin kubeconfig (or a drainer) it records that the node was not
// drained and lets the removal go on. It blocks until the drain ends.
func (e *Executor) drain(ctx context.Context, c *typesv1.Cluster, a clusterplan.Drain) error {
	prev := conditions.Get(e.machineConditions(ctx, a.Machine), clusterplan.MachineDrained)
	if prev.GetStatus() == conditions.True {
		return nil
	}
	timeout := a.Timeout
	if timeout <= 0 {
		timeout = e.cfg.DrainTimeout
	}
	deadline := e.cfg.Clock().Add(timeout)
	if prev.GetReason() != ReasonDrainTimeout { // a retry keeps saying why it halted
		if err := e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.False, ReasonDraining,
			fmt.Sprintf("draining node %s by %s (drain timeout %s)", a.Node, deadline.UTC().Format(time.RFC3339), timeout)), ""); err != nil {
			return err
		}
	}
	var kubeconfig []byte
	boot, err := LoadBootstrap(ctx, e.deps.Store, c.GetMetadata().GetName())
	switch {
	case err == nil:
		kubeconfig = []byte(boot.Kubeconfig)
	case !errdefs.IsNotFound(err):
		return err
	}
	if e.deps.Drain == nil || len(kubeconfig) == 0 || a.Node == "" {
		msg := "node not drained: no admin kubeconfig for cluster " + c.GetMetadata().GetName()
		if e.deps.Drain == nil {
			msg = "node not drained: draining is not configured"
		}
		e.event(ctx, a.Machine, "Warning", "DrainSkipped", msg)
		return e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.True, "DrainSkipped", msg), "")
	}
	if err := e.fence(ctx, "drain of node "+a.Node); err != nil {
		return err
	}
	if prev.GetReason() != ReasonDrainTimeout {
		e.event(ctx, a.Machine, "Normal", "Draining", "draining node "+a.Node)
	}
	dctx, cancel := context.WithTimeout(ctx, timeout)
	start := e.cfg.Clock()
	err = e.deps.Drain(dctx, kubeconfig, a.Node, timeout)
	expired := dctx.Err() != nil
	cancel()
	if ctx.Err() == nil {
		if expired && err != nil {
			err = fmt.Errorf("%w: %w", err, context.DeadlineExceeded)
		}
		e.observe("Drain", start, err)
	}
	switch {
	case err == nil:
		e.event(ctx, a.Machine, "Normal", "Drained", "node "+a.Node+" drained")
		return e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.True, "Drained", ""), "")
	case ctx.Err() != nil:
		return ctx.Err() // no longer leading: the next leader drains again
	case expired || errors.Is(err, errdefs.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return e.drainTimedOut(ctx, a, timeout, deadline, prev, err)
	}
	_ = e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.False, ReasonDraining, err.Error()), "")
	return fmt.Errorf("drain node %s: %w", a.Node, err)
}

// drainTimedOut records a drain that missed its deadline.
func (e *Executor) drainTimedOut(ctx context.Context, a clusterplan.Drain, timeout time.Duration, deadline time.Time, prev *typesv1.Condition, err error) error {
	why := fmt.Sprintf("node %s not drained by its deadline %s (drain timeout %s): %v", a.Node, deadline.UTC().Format(time.RFC3339), timeout, err)
	fix := "check the PodDisruptionBudgets of the pods left on the node (kubectl get pdb -A: one with ALLOWED DISRUPTIONS 0, such as minAvailable equal to its replicas, blocks every eviction) and relax or delete it, or move those pods by hand"
	if a.Proceed {
		msg := why + "; the MachineDeployment's nodeDrainTimeout says to go on: the removal proceeds and pods still on the node go with it; " + fix
		e.event(ctx, a.Machine, "Warning", ReasonDrainTimeout, msg)
		return e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.True, ReasonDrainTimeout, msg), "")
	}
	msg := why + "; the removal is halted and the drain tried again: " + fix
	if prev.GetReason() != ReasonDrainTimeout {
		e.event(ctx, a.Machine, "Warning", ReasonDrainTimeout, msg)
	}
	if serr := e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.False, ReasonDrainTimeout, msg), ""); serr != nil {
		return serr
	}
	return errdefs.FailedPrecondition("%s", msg)
}

// fence returns an error, and step must not start, once this leader's
// term is over.
func (e *Executor) fence(ctx context.Context, step string) error {
	if err := e.deps.Store.CheckFence(ctx); err != nil {
		e.log.Warn("step not started: not the leader any more", "step", step, "err", err)
		return fmt.Errorf("%s not started: %w", step, err)
	}
	return nil
}

// reset runs kubeadm reset on the machine's host (the etcd member leaves
// first when removeMember).
func (e *Executor) reset(ctx context.Context, m *typesv1.Machine, removeMember bool) error {
	h := &typesv1.Host{}
	if _, err := e.deps.Store.Get(ctx, HostsKind, m.GetSpec().GetHost(), h); err != nil {
		return err
	}
	agent, err := e.deps.Agents(ctx, h)
	if err != nil {
		return errdefs.Unavailable("dial agent of host %s: %w", h.GetMetadata().GetName(), err)
	}
	if err := e.fence(ctx, "kubeadm reset of machine "+m.GetMetadata().GetName()); err != nil {
		return err
	}
	opCtx, cancel := context.WithTimeout(ctx, e.cfg.OperationTimeout)
	defer cancel()
	start := e.cfg.Clock()
	stream, err := agent.KubeadmReset(opCtx, &agentv1.KubeadmResetRequest{OperationId: opID(m, "reset"), RemoveEtcdMember: removeMember})
	if err != nil {
		err = errgrpc.FromGRPC(err)
		e.observe("KubeadmReset", start, err)
		return fmt.Errorf("kubeadm reset: %w", err)
	}
	_, err = follow(stream)
	e.observe("KubeadmReset", start, err)
	if err != nil {
		return fmt.Errorf("kubeadm reset: %w", err)
	}
	return nil
}

// removeEtcdMember makes the machine's node leave etcd (kubeadm reset
// with member removal).
func (e *Executor) removeEtcdMember(ctx context.Context, a clusterplan.RemoveEtcdMember) error {
	m := &typesv1.Machine{}
	if _, err := e.deps.Store.Get(ctx, MachinesKind, a.Machine, m); err != nil {
		return err
	}
	if err := e.reset(ctx, m, true); err != nil {
		return err
	}
	e.event(ctx, a.Machine, "Normal", "EtcdMemberRemoved", "etcd member "+a.Member+" removed")
	now := e.cfg.Clock()
	return e.updateMachine(ctx, a.Machine, func(x *typesv1.Machine) bool {
		x.Status.EtcdMember = ""
		x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, conditions.New(clusterplan.MachineEtcdHealthy, conditions.False, "MemberRemoved", ""), now)
		return true
	})
}

// deleteMachine marks the machine deleting, resets its node, unbinds its
// host (which the host lifecycle then wipes) and deletes the Machine.
// Each step is idempotent; a failed one is taken up again next pass.
func (e *Executor) deleteMachine(ctx context.Context, name, reason string) error {
	m := &typesv1.Machine{}
	if _, err := e.deps.Store.Get(ctx, MachinesKind, name, m); err != nil {
		if errdefs.IsNotFound(err) {
			return nil
		}
		return err
	}
	if m.GetMetadata().GetDeletionTimestamp() == nil {
		now := timestamppb.New(e.cfg.Clock())
		if err := e.updateMachine(ctx, name, func(x *typesv1.Machine) bool {
			x.Metadata.DeletionTimestamp = now
			x.Status.Phase = PhaseDeleting
			return true
		}); err != nil {
			return err
		}
		msg := "deleting machine"
		if reason != "" {
			msg += ": " + reason
		}
		e.event(ctx, name, "Normal", "Deleting", msg)
	}
	h := &typesv1.Host{}
	_, err := e.deps.Store.Get(ctx, HostsKind, m.GetSpec().GetHost(), h)
	if err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	bound := err == nil && h.GetStatus().GetMachine() == name
	if bound && conditions.IsTrue(m.GetStatus().GetConditions(), ConditionBootstrapped) &&
		h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONED {
		member := m.GetSpec().GetRole() == clusterplan.RoleControlPlane && m.GetStatus().GetEtcdMember() != ""
		if err := e.reset(ctx, m, member); err != nil {
			return err
		}
	}
	if node := m.GetStatus().GetNodeName(); node != "" && e.deps.DeleteNode != nil {
		// The host may come back under the same name; kubeadm refuses
		// to join a node whose Node object still exists.
		if boot, err := LoadBootstrap(ctx, e.deps.Store, m.GetSpec().GetCluster()); err == nil && boot.Kubeconfig != "" {
			if err := e.fence(ctx, "delete node "+node); err != nil {
				return err
			}
			if err := e.deps.DeleteNode(ctx, []byte(boot.Kubeconfig), node); err != nil {
				// Best effort: a cluster whose API is down must not keep
				// the machine (and its replacement) from going.
				e.event(ctx, name, "Warning", "NodeNotDeleted", fmt.Sprintf("node %s left in the cluster: %v; delete it with kubectl delete node %s", node, err, node))
			}
		}
	}
	if bound {
		if err := e.unbind(ctx, m.GetSpec().GetHost(), name); err != nil {
			return fmt.Errorf("unbind host %s: %w", m.GetSpec().GetHost(), err)
		}
	}
	if err := e.deps.Store.Delete(ctx, MachinesKind, name, 0); err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	e.log.Info("machine deleted", "machine", name, "host", m.GetSpec().GetHost())
	return nil
}

// eventStream is a server stream of operation events.
type eventStream interface {
	Recv() (*agentv1.OperationEvent, error)
}

// follow reads an operation's events until its terminal one and returns
// it, carrying the operation's result (the agent may send the result in
// an earlier event than the terminal one). A stream that breaks is
// Unavailable (re-attach under the same id); an operation that failed is
// FailedPrecondition with the agent's error.
func follow(s eventStream) (*agentv1.OperationEvent, error) {
	var withResult *agentv1.OperationEvent
	for {
		ev, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return nil, errdefs.Unavailable("operation stream ended without a result")
		}
		if err != nil {
			return nil, errgrpc.FromGRPC(err)
		}
		if ev.GetResult() != nil {
			withResult = ev
		}
		switch ev.GetState() {
		case agentv1.OperationState_OPERATION_STATE_SUCCEEDED:
			if ev.GetResult() == nil && withResult != nil {
				ev = proto.Clone(ev).(*agentv1.OperationEvent)
				ev.Result = withResult.Result
			}
			return ev, nil
		case agentv1.OperationState_OPERATION_STATE_FAILED:
			return nil, errdefs.FailedPrecondition("operation %s failed: %s", ev.GetOperationId(), ev.GetError())
		case agentv1.OperationState_OPERATION_STATE_INTERRUPTED:
			return nil, errdefs.FailedPrecondition("operation %s interrupted (the agent restarted)", ev.GetOperationId())
		}
	}
}
