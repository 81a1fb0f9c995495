package fleet

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/progress"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Snapshot is what the controller says about the lab at one moment.
type Snapshot struct {
	Hosts              map[string]*typesv1.Host
	Machines           map[string]*typesv1.Machine
	ControlPlanes      map[string]*typesv1.ControlPlane
	MachineDeployments map[string]*typesv1.MachineDeployment
	HealthChecks       map[string]*typesv1.HealthCheck
	Cluster            *typesv1.Cluster
}

// Lines renders the snapshot as one line per host, machine and the
// cluster, for progress output, each object that is blocked followed by
// one line per False condition ("  host h1: BMCReachable=False
// Unreachable: ..."), so that what stops progress shows where the user
// looks and not only in the controller log.
func (s *Snapshot) Lines() []string {
	var out []string
	for _, n := range sortedKeys(s.Hosts) {
		h := s.Hosts[n]
		st := strings.TrimPrefix(h.GetStatus().GetState().String(), "HOST_STATE_")
		line := fmt.Sprintf("host %-10s %-14s %s", n, st, h.GetStatus().GetProvisioningStep())
		if m := h.GetStatus().GetMachine(); m != "" {
			line += " machine=" + m
		}
		if op := h.GetStatus().GetLastOperation(); op.GetState() == hostlife.OpRunning && progress.Known(op.GetProgress()) {
			// A new line per stored report: the lab's lay progress.
			p := op.GetProgress()
			line += " " + progress.Line(p, p.GetUpdated().AsTime())
		}
		if e := h.GetStatus().GetLastError(); e != "" {
			line += " last error: " + e
		}
		out = append(out, strings.TrimRight(line, " "))
		out = append(out, falseConditions("host "+n, h.GetStatus().GetConditions())...)
	}
	for _, n := range sortedKeys(s.Machines) {
		m := s.Machines[n]
		line := fmt.Sprintf("machine %-22s %-8s %-13s host=%s", n, m.GetSpec().GetRole(), m.GetStatus().GetPhase(), m.GetSpec().GetHost())
		for _, t := range []string{clusterplan.MachineNodeReady, clusterplan.MachineClusterDNSResolves} {
			if c := conditions.Get(m.GetStatus().GetConditions(), t); c != nil {
				line += fmt.Sprintf(" %s=%s", t, c.GetStatus())
			}
		}
		out = append(out, line)
		out = append(out, falseConditions("machine "+n, m.GetStatus().GetConditions())...)
	}
	for _, n := range sortedKeys(s.ControlPlanes) {
		st := s.ControlPlanes[n].GetStatus()
		out = append(out, fmt.Sprintf("control plane %s: %d/%d Ready, %d up to date, %d etcd members", n, st.GetReadyReplicas(), s.ControlPlanes[n].GetSpec().GetReplicas(), st.GetUpdatedReplicas(), st.GetEtcdMembers()))
		out = append(out, falseConditions("control plane "+n, st.GetConditions())...)
	}
	for _, n := range sortedKeys(s.MachineDeployments) {
		st := s.MachineDeployments[n].GetStatus()
		out = append(out, fmt.Sprintf("deployment %s: %d/%d Ready, %d up to date", n, st.GetReadyReplicas(), s.MachineDeployments[n].GetSpec().GetReplicas(), st.GetUpdatedReplicas()))
		out = append(out, falseConditions("deployment "+n, st.GetConditions())...)
	}
	for _, n := range sortedKeys(s.HealthChecks) {
		if c := conditions.Get(s.HealthChecks[n].GetStatus().GetConditions(), clusterplan.ConditionRemediationAllowed); c != nil {
			out = append(out, fmt.Sprintf("health check %s: RemediationAllowed=%s %s", n, c.GetStatus(), c.GetMessage()))
		}
	}
	if c := s.Cluster; c != nil {
		name := c.GetMetadata().GetName()
		line := fmt.Sprintf("cluster %s %s", name, c.GetStatus().GetPhase())
		if r := conditions.Get(c.GetStatus().GetConditions(), clusterplan.ConditionReady); r != nil {
			line += fmt.Sprintf(": Ready=%s %s", r.GetStatus(), r.GetMessage())
		}
		out = append(out, line)
		var others []*typesv1.Condition
		for _, cond := range c.GetStatus().GetConditions() {
			if cond.GetType() != clusterplan.ConditionReady {
				others = append(others, cond)
			}
		}
		out = append(out, falseConditions("cluster "+name, others)...)
	}
	return out
}

// falseConditions renders each False condition of conds as
// "  OBJECT: Type=False Reason: message".
func falseConditions(object string, conds []*typesv1.Condition) []string {
	var out []string
	for _, c := range conds {
		if c.GetStatus() != conditions.False {
			continue
		}
		line := fmt.Sprintf("  %s: %s=False %s", object, c.GetType(), c.GetReason())
		if m := c.GetMessage(); m != "" {
			line += ": " + m
		}
		out = append(out, line)
	}
	return out
}

// Blocked lists the objects that have not reached their goal (hosts in
// neither Available nor Provisioned, machines not Running, a cluster not
// Ready) with their False conditions and last errors, for the message of
// a stalled or timed-out wait.
func (s *Snapshot) Blocked() []string {
	var out []string
	for _, n := range sortedKeys(s.Hosts) {
		st := s.Hosts[n].GetStatus()
		switch st.GetState() {
		case typesv1.HostState_HOST_STATE_AVAILABLE, typesv1.HostState_HOST_STATE_PROVISIONED:
			continue
		}
		line := fmt.Sprintf("host %s %s %s", n, hostlife.StateName(st.GetState()), st.GetProvisioningStep())
		if e := st.GetLastError(); e != "" {
			line += " last error: " + e
		}
		out = append(out, strings.TrimRight(line, " "))
		out = append(out, falseConditions("host "+n, st.GetConditions())...)
	}
	for _, n := range sortedKeys(s.Machines) {
		m := s.Machines[n]
		if m.GetStatus().GetPhase() == "Running" {
			continue
		}
		out = append(out, fmt.Sprintf("machine %s %s host=%s", n, m.GetStatus().GetPhase(), m.GetSpec().GetHost()))
		out = append(out, falseConditions("machine "+n, m.GetStatus().GetConditions())...)
	}
	if c := s.Cluster; c != nil && !s.Ready() {
		name := c.GetMetadata().GetName()
		out = append(out, fmt.Sprintf("cluster %s %s", name, c.GetStatus().GetPhase()))
		out = append(out, falseConditions("cluster "+name, c.GetStatus().GetConditions())...)
	}
	return out
}

// Ready reports whether the cluster's Ready condition is True.
func (s *Snapshot) Ready() bool {
	return s.Cluster != nil && conditions.IsTrue(s.Cluster.GetStatus().GetConditions(), clusterplan.ConditionReady)
}

// fingerprint is what must stay the same for the lab to count as stalled:
// the progress lines and each host's operation progress (a lay moves its
// percent without changing a line). Heartbeats and resource versions are
// left out: they change while nothing progresses.
func (s *Snapshot) fingerprint() string {
	var b strings.Builder
	for _, l := range s.Lines() {
		b.WriteString(l)
		b.WriteByte('\n')
	}
	for _, n := range sortedKeys(s.Hosts) {
		op := s.Hosts[n].GetStatus().GetLastOperation()
		fmt.Fprintf(&b, "%s %s %s %s %.1f %d\n", n, op.GetId(), op.GetState(), op.GetMessage(), op.GetPercent(), op.GetAttempt())
	}
	return b.String()
}

// StallDetector tells when snapshots have stopped changing. It does no
// I/O and reads no clock.
type StallDetector struct {
	// Timeout is how long snapshots may stay the same (0: never stalled).
	Timeout time.Duration

	last    string
	changed time.Time
}

// Observe records s seen at now and reports whether nothing changed for
// Timeout, and for how long nothing has changed.
func (d *StallDetector) Observe(s *Snapshot, now time.Time) (stalled bool, idle time.Duration) {
	fp := s.fingerprint()
	if d.changed.IsZero() || fp != d.last {
		d.last, d.changed = fp, now
		return false, 0
	}
	idle = now.Sub(d.changed)
	return d.Timeout > 0 && idle >= d.Timeout, idle
}

// StalledError is returned by a watch that gave up because nothing
// changed for its stall timeout.
type StalledError struct {
	// Idle is how long nothing changed.
	Idle time.Duration
	// Blocked is Snapshot.Blocked of the last snapshot.
	Blocked []string
}

func (e *StalledError) Error() string {
	msg := fmt.Sprintf("lab: nothing changed for %s; stopped early (--stall-timeout)", e.Idle.Round(time.Second))
	if len(e.Blocked) == 0 {
		return msg
	}
	return msg + "; blocked:\n  " + strings.Join(e.Blocked, "\n  ")
}

// Watcher polls snapshots and prints what changed until done, a stall
// or the context's end. Its parts are injected so that tests drive it
// with fake snapshots and a fake clock.
type Watcher struct {
	// Snapshot reads the lab's state.
	Snapshot func(ctx context.Context) (*Snapshot, error)
	// Now is the clock.
	Now func() time.Time
	// Wait blocks for one poll interval; it returns ctx.Err() when ctx
	// ends first.
	Wait func(ctx context.Context) error
	// Say prints one progress line.
	Say func(format string, args ...any)
	// Stall gives up when nothing changed for this long (0: never).
	Stall time.Duration
}

// Run polls until done(snapshot) is true (it returns that snapshot), the
// snapshots stop changing for w.Stall (a *StalledError), or ctx ends (an
// error with the blocked objects). Each line of Snapshot.Lines is printed
// once, when it first appears, with the seconds since the start.
func (w *Watcher) Run(ctx context.Context, done func(*Snapshot) bool) (*Snapshot, error) {
	start := w.Now()
	since := func() int { return int(w.Now().Sub(start).Seconds()) }
	seen := map[string]bool{}
	stall := StallDetector{Timeout: w.Stall}
	var last *Snapshot
	for {
		s, err := w.Snapshot(ctx)
		if err == nil {
			last = s
			for _, line := range s.Lines() {
				if !seen[line] {
					seen[line] = true
					w.Say("[%4ds] %s", since(), line)
				}
			}
			if done(s) {
				return s, nil
			}
			if stalled, idle := stall.Observe(s, w.Now()); stalled {
				return s, &StalledError{Idle: idle, Blocked: s.Blocked()}
			}
		} else if ctx.Err() == nil {
			w.Say("[%4ds] controller: %v", since(), err)
		}
		if err := w.Wait(ctx); err != nil {
			msg := "no answer from the controller"
			if last != nil {
				lines := last.Blocked()
				if len(lines) == 0 {
					lines = last.Lines()
				}
				msg = strings.Join(lines, "\n  ")
			}
			return last, fmt.Errorf("lab: gave up after %s: %w; last state:\n  %s", w.Now().Sub(start).Round(time.Second), err, msg)
		}
	}
}

// sortedKeys returns m's keys in order.
func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}
