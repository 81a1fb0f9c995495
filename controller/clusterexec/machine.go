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
	"github.com/kilnhq/kiln/controller/machineplan"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// advance plans machine name (machineplan.Plan), stores the status the
// planner gives it and runs the planner's actions: a bind at once, a
// probe under its call deadline, a bootstrap in the background (startBootstrap)
// and a teardown as the cluster's long action. It returns the planner's
// requeue.
func (e *Executor) advance(ctx context.Context, c *typesv1.Cluster, creds bool, name string) (time.Duration, error) {
	m := &typesv1.Machine{}
	if _, err := e.deps.Store.Get(ctx, MachinesKind, name, m); err != nil {
		if errdefs.IsNotFound(err) {
			return 0, nil
		}
		return 0, err
	}
	var h *typesv1.Host
	if host := m.GetSpec().GetHost(); host != "" {
		x := &typesv1.Host{}
		_, err := e.deps.Store.Get(ctx, HostsKind, host, x)
		switch {
		case err == nil:
			h = x
		case !errdefs.IsNotFound(err):
			return 0, err
		}
	}
	out := machineplan.Plan(e.cfg.Machines, machineplan.Input{Machine: m, Host: h, Cluster: c, Credentials: creds}, e.cfg.Clock())
	e.warnMachineHost(ctx, m, out.Conditions)
	if err := e.storeMachineStatus(ctx, name, out); err != nil {
		return 0, err
	}
	var errs []error
	for _, a := range out.Actions {
		if err := e.doMachine(ctx, c, a); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", a, err))
		}
	}
	return out.Requeue, errors.Join(errs...)
}

// storeMachineStatus writes the planner's phase and conditions.
func (e *Executor) storeMachineStatus(ctx context.Context, name string, out machineplan.Output) error {
	if out.Phase == "" && len(out.Conditions) == 0 {
		return nil
	}
	now := e.cfg.Clock()
	return e.updateMachine(ctx, name, func(m *typesv1.Machine) bool {
		changed := false
		if out.Phase != "" && m.Status.Phase != out.Phase {
			m.Status.Phase, changed = out.Phase, true
		}
		for _, c := range out.Conditions {
			var ch bool
			m.Status.Conditions, ch = conditions.Set(m.Status.Conditions, proto.Clone(c).(*typesv1.Condition), now)
			changed = changed || ch
		}
		return changed
	})
}

// doMachine runs one action of the Machine planner.
func (e *Executor) doMachine(ctx context.Context, c *typesv1.Cluster, a machineplan.Action) error {
	switch a := a.(type) {
	case machineplan.BindHost:
		err := e.bind(ctx, a.Host, a.Machine)
		if errdefs.IsConflict(err) || errdefs.IsNotFound(err) {
			// Taken meanwhile: the next plan tears the machine down.
			e.event(ctx, a.Machine, "Warning", "HostTaken", err.Error())
			return nil
		}
		return err
	case machineplan.Bootstrap:
		e.startBootstrap(ctx, c, a)
		return nil
	case machineplan.Probe:
		return e.probe(ctx, c, a)
	case machineplan.Teardown:
		e.startLong(ctx, c.GetMetadata().GetName(), a.String(), func(ctx context.Context) error { return e.teardown(ctx, a) })
		return nil
	}
	return errdefs.InvalidArgument("unknown machine action %T", a)
}

// warnMachineHost records a Warning event on m when its host newly holds
// it back for a reason other than progress.
func (e *Executor) warnMachineHost(ctx context.Context, m *typesv1.Machine, set []*typesv1.Condition) {
	if e.deps.Recorder == nil {
		return
	}
	for _, c := range set {
		if c.GetType() != ConditionHostProvisioned || c.GetStatus() != conditions.False || c.GetReason() == hostlife.ReasonInProgress {
			continue
		}
		if old := conditions.Get(m.GetStatus().GetConditions(), c.GetType()); old != nil && old.GetReason() == c.GetReason() && old.GetMessage() == c.GetMessage() {
			continue
		}
		e.deps.Recorder.Record(ctx, MachinesKind, m.GetMetadata().GetName(), "Warning", c.GetReason(), c.GetMessage())
	}
}

// startBootstrap runs bootstrap a in the background unless this executor
// runs the machine's bootstrap already; when it ends, the cluster is
// queued again so its outcome is planned at once.
func (e *Executor) startBootstrap(ctx context.Context, c *typesv1.Cluster, a machineplan.Bootstrap) {
	name, cluster := a.Machine, c.GetMetadata().GetName()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.booting[name] {
		return
	}
	e.booting[name] = true
	e.boots.Add(1)
	go func() {
		defer e.boots.Done()
		defer func() {
			e.mu.Lock()
			delete(e.booting, name)
			q := e.queue
			e.mu.Unlock()
			if q != nil && ctx.Err() == nil {
				q.Add(cluster)
			}
		}()
		select {
		case e.bootSem <- struct{}{}:
			defer func() { <-e.bootSem }()
		case <-ctx.Done():
			return
		}
		if err := e.bootstrap(ctx, c, a); err != nil && ctx.Err() == nil {
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

func (e *Executor) setCondition(ctx context.Context, name string, c *typesv1.Condition) error {
	now := e.cfg.Clock()
	return e.updateMachine(ctx, name, func(m *typesv1.Machine) bool {
		var changed bool
		m.Status.Conditions, changed = conditions.Set(m.Status.Conditions, c, now)
		return changed
	})
}

// recordOperation records the state of the machine's bootstrap operation
// (machineplan.ConditionOperation), with BootstrapFailed when failed is
// set (reason, message), and counts the refusals in a row
// (machineplan.AnnotationRefusals: one more with Refused, none after any
// other end).
func (e *Executor) recordOperation(ctx context.Context, name, state, msg string, failed *typesv1.Condition) error {
	now := e.cfg.Clock()
	status := conditions.False
	if state == machineplan.ReasonRunning {
		status = conditions.True
	}
	return e.updateMachine(ctx, name, func(x *typesv1.Machine) bool {
		// The refusals in a row, for the planner's refusal backoff.
		if state == machineplan.ReasonRefused {
			if x.Metadata.Annotations == nil {
				x.Metadata.Annotations = map[string]string{}
			}
			x.Metadata.Annotations[machineplan.AnnotationRefusals] = strconv.Itoa(machineplan.Refusals(x) + 1)
		} else if state != machineplan.ReasonRunning {
			delete(x.Metadata.Annotations, machineplan.AnnotationRefusals)
		}
		x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, conditions.New(machineplan.ConditionOperation, status, state, msg), now)
		if failed != nil {
			x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, failed, now)
		}
		e.replanPhase(ctx, x)
		return true
	})
}

// replanPhase sets x's phase to what the Machine planner makes of x as it
// is about to be written, so that an outcome and the phase it leads to
// are stored together (a reader never sees BootstrapFailed with the phase
// of before). It leaves the phase when the host or cluster cannot be
// read: the next plan sets it.
func (e *Executor) replanPhase(ctx context.Context, x *typesv1.Machine) {
	h, c := &typesv1.Host{}, &typesv1.Cluster{}
	if _, err := e.deps.Store.Get(ctx, HostsKind, x.GetSpec().GetHost(), h); err != nil {
		return
	}
	if _, err := e.deps.Store.Get(ctx, ClustersKind, x.GetSpec().GetCluster(), c); err != nil {
		return
	}
	_, err := LoadBootstrap(ctx, e.deps.Store, x.GetSpec().GetCluster())
	out := machineplan.Plan(e.cfg.Machines, machineplan.Input{Machine: x, Host: h, Cluster: c, Credentials: err == nil}, e.cfg.Clock())
	if out.Phase != "" {
		x.Status.Phase = out.Phase
	}
}

// startAttempt records, before anything of it runs, that the machine's
// attempt starts (write-ahead): its number, in the operation ids, and
// ConditionOperation Running, so that a controller that restarts
// re-attaches instead of starting it again.
func (e *Executor) startAttempt(ctx context.Context, a machineplan.Bootstrap) error {
	now := e.cfg.Clock()
	return e.updateMachine(ctx, a.Machine, func(x *typesv1.Machine) bool {
		if x.Metadata.Annotations == nil {
			x.Metadata.Annotations = map[string]string{}
		}
		x.Metadata.Annotations[AnnotationAttempt] = strconv.Itoa(a.Attempt)
		x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, conditions.New(machineplan.ConditionOperation, conditions.True,
			machineplan.ReasonRunning, "operation "+a.OperationID), now)
		return true
	})
}

// bootstrap runs a: prepares, checks and joins (or inits) the node, or
// follows the kubeadm operation an earlier executor started (a.Attach).
// It records the outcome on the Machine: Bootstrapped, or
// ConditionOperation Failed (with BootstrapFailed), Refused (a failed
// preflight check) or Lost (the agent does not know the operation). An
// unreachable agent or a broken stream records nothing: the operation
// stays Running and the next plan re-attaches.
func (e *Executor) bootstrap(ctx context.Context, c *typesv1.Cluster, a machineplan.Bootstrap) error {
	name := a.Machine
	m := &typesv1.Machine{}
	if _, err := e.deps.Store.Get(ctx, MachinesKind, name, m); err != nil {
		return err
	}
	h := &typesv1.Host{}
	if _, err := e.deps.Store.Get(ctx, HostsKind, a.Host, h); err != nil {
		return err
	}
	mode := a.Mode
	var boot *Bootstrap
	if mode != clusterplan.BootstrapInit {
		b, err := LoadBootstrap(ctx, e.deps.Store, c.GetMetadata().GetName())
		if err != nil {
			return err // planned before the credentials were there: the next plan waits
		}
		boot = b
	}
	agent, err := e.deps.Agents(ctx, h)
	if err != nil {
		return errdefs.Unavailable("dial agent of host %s: %w", h.GetMetadata().GetName(), err)
	}
	cfg := clusterConfig(c, m, h)
	opCtx, cancel := context.WithTimeout(ctx, e.cfg.OperationTimeout)
	defer cancel()

	var stream eventStream
	if a.Attach {
		// A restarted controller (or a new leader) re-attaches to the
		// kubeadm init or join recorded as running: preparing and
		// checking again a node that is being (or was) joined fails its
		// preflight (its ports are in use).
		st, err := agent.Operation(opCtx, &agentv1.OperationRequest{OperationId: a.OperationID})
		if err = errgrpc.FromGRPC(err); err != nil && !errdefs.IsNotFound(err) {
			return fmt.Errorf("re-attach to %s: %w", a.OperationID, err)
		}
		if err != nil {
			return e.operationLost(ctx, a)
		}
		stream = st
		e.log.Info("re-attaching to a bootstrap", "machine", name, "operation", a.OperationID)
	} else {
		if mode == clusterplan.BootstrapJoinControlPlane {
			if err := e.prepareJoin(ctx, c, m, boot); err != nil {
				return err
			}
		}
		if err := e.startAttempt(ctx, a); err != nil {
			return err
		}
		if err := e.fence(ctx, "bootstrap of machine "+name); err != nil {
			return err
		}
		start := e.cfg.Clock()
		st, err := agent.Prepare(opCtx, &agentv1.PrepareRequest{OperationId: machineplan.OperationID(m, "prepare", a.Attempt)})
		if err != nil {
			err = errgrpc.FromGRPC(err)
			e.observe("Prepare", start, err)
			return fmt.Errorf("prepare: %w", err)
		}
		_, err = follow(st)
		e.observe("Prepare", start, err)
		if err != nil {
			return e.operationFailed(ctx, name, "PrepareFailed", fmt.Errorf("prepare: %w", err))
		}

		start = e.cfg.Clock()
		callCtx, cancelCall := context.WithTimeout(ctx, e.cfg.PreflightTimeout)
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
		if msg != "" && inProgressOnly(report) {
			// The host is still getting ready (its first boot's image
			// import): the planner looks again after a short fixed wait.
			if prev := conditions.Get(m.GetStatus().GetConditions(), ConditionBootstrapFailed); prev.GetReason() != machineplan.ReasonPreflightWaiting {
				e.event(ctx, name, "Normal", machineplan.ReasonPreflightWaiting, msg)
			}
			return e.recordOperation(ctx, name, machineplan.ReasonWaiting, msg,
				machineplan.WaitingCondition(m.GetStatus().GetConditions(), msg))
		}
		if msg != "" {
			if prev := conditions.Get(m.GetStatus().GetConditions(), ConditionBootstrapFailed); prev.GetStatus() != conditions.True || prev.GetMessage() != msg {
				e.event(ctx, name, "Warning", "PreflightFailed", msg)
			}
			return e.recordOperation(ctx, name, machineplan.ReasonRefused, msg,
				conditions.New(ConditionBootstrapFailed, conditions.True, "PreflightFailed", msg))
		}
		start = e.cfg.Clock()
		if mode == clusterplan.BootstrapInit {
			st, err = agent.KubeadmInit(opCtx, &agentv1.KubeadmInitRequest{OperationId: a.OperationID, Cluster: cfg, UploadCerts: true})
		} else {
			req := &agentv1.KubeadmJoinRequest{
				OperationId:       a.OperationID,
				Cluster:           cfg,
				ApiServerEndpoint: boot.APIServerEndpoint,
				Token:             boot.JoinToken,
				CaHash:            c.GetStatus().GetCaHash(),
				ControlPlane:      mode == clusterplan.BootstrapJoinControlPlane,
			}
			if req.ControlPlane {
				req.CertificateKey = boot.CertificateKey
			}
			st, err = agent.KubeadmJoin(opCtx, req)
		}
		if err != nil {
			err = errgrpc.FromGRPC(err)
			e.observe(kubeadmOp(mode), start, err)
			return fmt.Errorf("%s: %w", kubeadmOp(mode), err)
		}
		stream = st
		ev, err := follow(stream)
		// A kubeadm run is timed from its start here; one re-attached to
		// after a restart is not timed (its start is not known).
		e.observe(kubeadmOp(mode), start, err)
		return e.bootstrapped(ctx, c, a, h, ev, err)
	}
	ev, err := follow(stream)
	if errdefs.IsNotFound(err) {
		return e.operationLost(ctx, a)
	}
	return e.bootstrapped(ctx, c, a, h, ev, err)
}

// operationLost records that the agent does not know the operation
// recorded as running (the controller stopped between recording it and
// starting it): the planner starts the same attempt again.
func (e *Executor) operationLost(ctx context.Context, a machineplan.Bootstrap) error {
	e.log.Info("bootstrap operation lost: the agent does not know it", "machine", a.Machine, "operation", a.OperationID)
	return e.recordOperation(ctx, a.Machine, machineplan.ReasonLost, "the agent of host "+a.Host+" knows no operation "+a.OperationID, nil)
}

func kubeadmOp(mode string) string {
	if mode == clusterplan.BootstrapInit {
		return "KubeadmInit"
	}
	return "KubeadmJoin"
}

// bootstrapped records the outcome of the kubeadm operation of a.
func (e *Executor) bootstrapped(ctx context.Context, c *typesv1.Cluster, a machineplan.Bootstrap, h *typesv1.Host, ev *agentv1.OperationEvent, err error) error {
	name, mode := a.Machine, a.Mode
	reason := kubeadmOp(mode) + "Failed"
	if err != nil {
		return e.operationFailed(ctx, name, reason, fmt.Errorf("kubeadm %s: %w", strings.TrimPrefix(strings.ToLower(kubeadmOp(mode)), "kubeadm"), err))
	}
	if mode == clusterplan.BootstrapInit {
		r := ev.GetKubeadmInit()
		if r.GetCaHash() == "" {
			return e.operationFailed(ctx, name, reason, errors.New("kubeadm init returned no CA hash"))
		}
		if err := e.saveInit(ctx, c.GetMetadata().GetName(), c.GetSpec().GetControlPlaneEndpoint(), r); err != nil {
			return err
		}
	}
	now := e.cfg.Clock()
	e.event(ctx, name, "Normal", "Bootstrapped", fmt.Sprintf("node %s joined the cluster (%s)", h.GetMetadata().GetName(), mode))
	e.log.Info("machine bootstrapped", "machine", name, "mode", mode)
	return e.updateMachine(ctx, name, func(x *typesv1.Machine) bool {
		x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, conditions.New(ConditionBootstrapped, conditions.True, "Kubeadm"+strings.ReplaceAll(titleMode(mode), "-", ""), ""), now)
		// False (no operation runs) is the good end here: severity Info
		// keeps describe and the dashboard from painting it as a failure.
		done := conditions.New(machineplan.ConditionOperation, conditions.False, machineplan.ReasonSucceeded, "operation "+a.OperationID)
		done.Severity = "Info"
		x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, done, now)
		if conditions.Get(x.Status.Conditions, ConditionBootstrapFailed) != nil {
			x.Status.Conditions, _ = conditions.Set(x.Status.Conditions, conditions.New(ConditionBootstrapFailed, conditions.False, "Bootstrapped", ""), now)
		}
		x.Status.NodeName = x.GetSpec().GetHost()
		x.Status.BootstrapTime = timestamppb.New(now)
		if x.GetSpec().GetRole() == clusterplan.RoleControlPlane {
			x.Status.EtcdMember = x.Status.NodeName
		}
		e.replanPhase(ctx, x)
		return true
	})
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
		verb := "failed"
		if c.GetInProgress() {
			verb = "in progress"
		}
		s := fmt.Sprintf("preflight check %s %s: %s", c.GetName(), verb, c.GetMessage())
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

// inProgressOnly reports whether every failed ERROR check of a refused
// report is in progress (it will pass without anyone acting).
func inProgressOnly(r *agentv1.PreflightReport) bool {
	n := 0
	for _, c := range r.GetChecks() {
		if c.GetPassed() || c.GetSeverity() != agentv1.Severity_SEVERITY_ERROR {
			continue
		}
		if !c.GetInProgress() {
			return false
		}
		n++
	}
	return n > 0
}

// operationFailed records a failed bootstrap operation: ConditionOperation
// Failed and BootstrapFailed with reason; the planner retries with a new
// attempt after its backoff, or not when none is left. An unreachable
// agent (a broken stream) is no failure: the operation stays Running and
// the next plan re-attaches under the same id.
func (e *Executor) operationFailed(ctx context.Context, name, reason string, err error) error {
	if errdefs.IsUnavailable(err) || ctx.Err() != nil {
		return err
	}
	e.event(ctx, name, "Warning", reason, err.Error())
	return e.recordOperation(ctx, name, machineplan.ReasonFailed, err.Error(),
		conditions.New(ConditionBootstrapFailed, conditions.True, reason, err.Error()))
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
func (e *Executor) probe(ctx context.Context, c *typesv1.Cluster, a machineplan.Probe) error {
	name := a.Machine
	m := &typesv1.Machine{}
	if _, err := e.deps.Store.Get(ctx, MachinesKind, name, m); err != nil {
		return err
	}
	h := &typesv1.Host{}
	if _, err := e.deps.Store.Get(ctx, HostsKind, a.Host, h); err != nil {
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
			fmt.Sprintf("draining node %s by %s (drain timeout %s)", a.Node, deadline.UTC().Format(time.RFC3339), timeout))); err != nil {
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
		return e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.True, "DrainSkipped", msg))
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
		return e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.True, "Drained", ""))
	case ctx.Err() != nil:
		return ctx.Err() // no longer leading: the next leader drains again
	case expired || errors.Is(err, errdefs.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return e.drainTimedOut(ctx, a, timeout, deadline, prev, err)
	}
	_ = e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.False, ReasonDraining, err.Error()))
	return fmt.Errorf("drain node %s: %w", a.Node, err)
}

// drainTimedOut records a drain that missed its deadline.
func (e *Executor) drainTimedOut(ctx context.Context, a clusterplan.Drain, timeout time.Duration, deadline time.Time, prev *typesv1.Condition, err error) error {
	why := fmt.Sprintf("node %s not drained by its deadline %s (drain timeout %s): %v", a.Node, deadline.UTC().Format(time.RFC3339), timeout, err)
	fix := "check the PodDisruptionBudgets of the pods left on the node (kubectl get pdb -A: one with ALLOWED DISRUPTIONS 0, such as minAvailable equal to its replicas, blocks every eviction) and relax or delete it, or move those pods by hand"
	if a.Proceed {
		msg := why + "; the MachineDeployment's nodeDrainTimeout says to go on: the removal proceeds and pods still on the node go with it; " + fix
		e.event(ctx, a.Machine, "Warning", ReasonDrainTimeout, msg)
		return e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.True, ReasonDrainTimeout, msg))
	}
	msg := why + "; the removal is halted and the drain tried again: " + fix
	if prev.GetReason() != ReasonDrainTimeout {
		e.event(ctx, a.Machine, "Warning", ReasonDrainTimeout, msg)
	}
	if serr := e.setCondition(ctx, a.Machine, conditions.New(clusterplan.MachineDrained, conditions.False, ReasonDrainTimeout, msg)); serr != nil {
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
	stream, err := agent.KubeadmReset(opCtx, &agentv1.KubeadmResetRequest{OperationId: machineplan.OperationID(m, "reset", machineplan.Attempt(m)), RemoveEtcdMember: removeMember})
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

// markDeleting sets the machine's deletion timestamp (the machine planner
// then tears it down), with an event saying why. A machine already
// deleting or gone is left.
func (e *Executor) markDeleting(ctx context.Context, name, reason string) error {
	marked := false
	now := timestamppb.New(e.cfg.Clock())
	err := e.updateMachine(ctx, name, func(x *typesv1.Machine) bool {
		if x.Metadata.DeletionTimestamp != nil {
			return false
		}
		x.Metadata.DeletionTimestamp = now
		marked = true
		return true
	})
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil || !marked {
		return err
	}
	msg := "deleting machine"
	if reason != "" {
		msg += ": " + reason
	}
	e.event(ctx, name, "Normal", "Deleting", msg)
	return nil
}

// deleteMachine runs the cluster planners' DeleteMachine: it marks the
// machine deleting, plans it (machineplan: a Teardown) and runs the
// teardown at once, in the action's goroutine.
func (e *Executor) deleteMachine(ctx context.Context, c *typesv1.Cluster, name, reason string) error {
	if err := e.markDeleting(ctx, name, reason); err != nil {
		return err
	}
	m := &typesv1.Machine{}
	if _, err := e.deps.Store.Get(ctx, MachinesKind, name, m); err != nil {
		if errdefs.IsNotFound(err) {
			return nil
		}
		return err
	}
	var h *typesv1.Host
	x := &typesv1.Host{}
	if _, err := e.deps.Store.Get(ctx, HostsKind, m.GetSpec().GetHost(), x); err == nil {
		h = x
	} else if !errdefs.IsNotFound(err) {
		return err
	}
	out := machineplan.Plan(e.cfg.Machines, machineplan.Input{Machine: m, Host: h, Cluster: c}, e.cfg.Clock())
	if err := e.storeMachineStatus(ctx, name, out); err != nil {
		return err
	}
	for _, a := range out.Actions {
		if t, ok := a.(machineplan.Teardown); ok {
			return e.teardown(ctx, t)
		}
	}
	return nil
}

// teardown runs a: it marks the machine deleting, then each step the
// planner set: kubeadm reset (with etcd member removal), deletion of the
// Node object, unbinding of the host (which the host lifecycle then
// wipes), and deletes the Machine. Each step is idempotent; a failed one
// is planned again.
func (e *Executor) teardown(ctx context.Context, a machineplan.Teardown) error {
	if err := e.markDeleting(ctx, a.Machine, a.Reason); err != nil {
		return err
	}
	m := &typesv1.Machine{}
	if _, err := e.deps.Store.Get(ctx, MachinesKind, a.Machine, m); err != nil {
		if errdefs.IsNotFound(err) {
			return nil
		}
		return err
	}
	if a.Reset {
		if err := e.reset(ctx, m, a.RemoveEtcdMember); err != nil {
			return err
		}
	}
	if a.Node != "" && e.deps.DeleteNode != nil {
		// The host may come back under the same name; kubeadm refuses
		// to join a node whose Node object still exists.
		if boot, err := LoadBootstrap(ctx, e.deps.Store, m.GetSpec().GetCluster()); err == nil && boot.Kubeconfig != "" {
			if err := e.fence(ctx, "delete node "+a.Node); err != nil {
				return err
			}
			if err := e.deps.DeleteNode(ctx, []byte(boot.Kubeconfig), a.Node); err != nil {
				// Best effort: a cluster whose API is down must not keep
				// the machine (and its replacement) from going.
				e.event(ctx, a.Machine, "Warning", "NodeNotDeleted", fmt.Sprintf("node %s left in the cluster: %v; delete it with kubectl delete node %s", a.Node, err, a.Node))
			}
		}
	}
	if a.Unbind {
		if err := e.unbind(ctx, a.Host, a.Machine); err != nil {
			return fmt.Errorf("unbind host %s: %w", a.Host, err)
		}
	}
	if err := e.deps.Store.Delete(ctx, MachinesKind, a.Machine, 0); err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	e.log.Info("machine deleted", "machine", a.Machine, "host", a.Host)
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
