package machineplan

import (
	"flag"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/transcript"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

var update = flag.Bool("update", false, "rewrite testdata/*.txt with the actual output")

// t0 is the transcripts' time origin; "at 90s" means t0+90s.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// TestTranscripts replays testdata/*.txt (see internal/transcript). The
// world is what the store holds; the commands play the executor's part,
// writing what it writes:
//
//	cluster name=C uid=U [caHash=H] [credentials=true]
//	host name=H state=Available|Provisioning|Provisioned|Error [machine=M]
//	     [step=S] [cond=Type:Reason:Message]
//	machine name=M role=control-plane|worker host=H [bootstrap=MODE]
//	     [cluster=C] [clusterUID=U]   a Machine as CreateMachine makes it
//	at T                              move the clock
//	plan M                            plan M, print, store its status
//	do M                              carry out the last plan's actions:
//	                                  BindHost binds, Bootstrap (start)
//	                                  records the attempt and Operation
//	                                  Running, Probe marks the node Ready,
//	                                  Teardown deletes the machine and
//	                                  unbinds the host
//	op M succeeded|failed|refused|waiting|lost [reason=R] [msg=...]
//	                                  the operation's outcome as the
//	                                  executor records it
//	restart                           a new controller: nothing but the
//	                                  store survives (the planner keeps no
//	                                  memory; the last plan is forgotten)
//	delete machine=M | cluster=C        a user deletes it (API)
//	cleanup                           PlanCleanup, print, carry it out
//	machines                          list machines and host bindings
//
// Run with -update to rewrite the files, then review the diff.
func TestTranscripts(t *testing.T) {
	transcript.Run(t, "testdata/*.txt", *update, func(t *testing.T) transcript.Exec {
		w := &world{now: t0, clusters: map[string]*typesv1.Cluster{}, hosts: map[string]*typesv1.Host{},
			machines: map[string]*typesv1.Machine{}, creds: map[string]bool{}, last: map[string]Output{}}
		return w.exec
	})
}

// cfg is the transcripts' policy: three attempts, 1m doubling, no jitter
// (so the printed requeues are round); refusals 10s doubling to 40s; a
// wait 20s.
var cfg = Config{MaxAttempts: 3, Backoff: backoff.Policy{Base: time.Minute, Max: 10 * time.Minute, Factor: 2},
	RefusalBackoff: backoff.Policy{Base: 10 * time.Second, Max: 40 * time.Second, Factor: 2}, WaitInterval: 20 * time.Second}

type world struct {
	now      time.Time
	clusters map[string]*typesv1.Cluster
	hosts    map[string]*typesv1.Host
	machines map[string]*typesv1.Machine
	creds    map[string]bool
	last     map[string]Output
}

func args(fields []string) map[string]string {
	m := map[string]string{}
	for _, f := range fields {
		k, v, _ := strings.Cut(f, "=")
		m[k] = v
	}
	return m
}

// argsMsg is args with msg=... taking the rest of the line.
func argsMsg(fields []string) map[string]string {
	for i, f := range fields {
		if strings.HasPrefix(f, "msg=") {
			a := args(fields[:i])
			a["msg"] = strings.TrimPrefix(strings.Join(fields[i:], " "), "msg=")
			return a
		}
	}
	return args(fields)
}

var states = map[string]typesv1.HostState{
	"Available":    typesv1.HostState_HOST_STATE_AVAILABLE,
	"Provisioning": typesv1.HostState_HOST_STATE_PROVISIONING,
	"Provisioned":  typesv1.HostState_HOST_STATE_PROVISIONED,
	"Error":        typesv1.HostState_HOST_STATE_ERROR,
}

func (w *world) setCond(m *typesv1.Machine, c *typesv1.Condition) {
	m.Status.Conditions, _ = conditions.Set(m.Status.Conditions, c, w.now)
}

func (w *world) exec(t *testing.T, cmd string) string {
	fields := strings.Fields(cmd)
	require.NotEmpty(t, fields)
	a := argsMsg(fields[1:])
	switch fields[0] {
	case "cluster":
		w.clusters[a["name"]] = &typesv1.Cluster{Metadata: &typesv1.ObjectMeta{Name: a["name"], Uid: a["uid"]},
			Status: &typesv1.ClusterStatus{CaHash: a["caHash"]}}
		w.creds[a["name"]] = a["credentials"] == "true"
		return ""
	case "host":
		st, ok := states[a["state"]]
		require.True(t, ok, "host state %q", a["state"])
		h := &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: a["name"]},
			Status: &typesv1.HostStatus{State: st, Machine: a["machine"], ProvisioningStep: a["step"], Image: "img1"}}
		if old := w.hosts[a["name"]]; old != nil && a["machine"] == "" {
			h.Status.Machine = old.Status.Machine
		}
		if c := a["cond"]; c != "" {
			p := strings.SplitN(c, ":", 3)
			require.Len(t, p, 3, "cond %q: want Type:Reason:Message", c)
			h.Status.Conditions = append(h.Status.Conditions, conditions.New(p[0], conditions.False, p[1], strings.ReplaceAll(p[2], "_", " ")))
		}
		w.hosts[a["name"]] = h
		return ""
	case "machine":
		cluster := a["cluster"]
		if cluster == "" {
			cluster = "c1"
		}
		m := &typesv1.Machine{
			Metadata: &typesv1.ObjectMeta{Name: a["name"], Uid: "u-" + a["name"], CreationTimestamp: timestamppb.New(w.now),
				Annotations: map[string]string{}},
			Spec:   &typesv1.MachineSpec{Cluster: cluster, Role: a["role"], Host: a["host"], Version: "v1.34.4", Image: "img1"},
			Status: &typesv1.MachineStatus{Phase: PhasePending},
		}
		if b := a["bootstrap"]; b != "" {
			m.Metadata.Annotations[AnnotationBootstrap] = b
		}
		if u := a["clusterUID"]; u != "" {
			m.Metadata.Annotations[AnnotationClusterUID] = u
		}
		w.machines[a["name"]] = m
		return ""
	case "at":
		d, err := time.ParseDuration(fields[1])
		require.NoError(t, err)
		w.now = t0.Add(d)
		return ""
	case "plan":
		return w.plan(t, fields[1])
	case "do":
		return w.do(t, fields[1])
	case "op":
		m := w.machines[fields[1]]
		require.NotNil(t, m, "no machine %q", fields[1])
		w.outcome(t, m, fields[2], a)
		return ""
	case "restart":
		w.last = map[string]Output{}
		return ""
	case "delete":
		switch {
		case a["machine"] != "":
			w.machines[a["machine"]].Metadata.DeletionTimestamp = timestamppb.New(w.now)
		case a["cluster"] != "":
			delete(w.clusters, a["cluster"])
		default:
			t.Fatalf("delete %q", cmd)
		}
		return ""
	case "cleanup":
		return w.cleanup()
	case "machines":
		return w.list()
	}
	t.Fatalf("unknown command %q", cmd)
	return ""
}

func (w *world) plan(t *testing.T, name string) string {
	m := w.machines[name]
	require.NotNil(t, m, "no machine %q", name)
	in := Input{Machine: proto.Clone(m).(*typesv1.Machine), Host: w.hosts[m.Spec.Host], Cluster: w.clusters[m.Spec.Cluster], Credentials: w.creds[m.Spec.Cluster]}
	out := Plan(cfg, in, w.now)
	require.True(t, proto.Equal(m, in.Machine), "Plan changed its input")
	w.last[name] = out
	if out.Phase != "" {
		m.Status.Phase = out.Phase
	}
	for _, c := range out.Conditions {
		w.setCond(m, proto.Clone(c).(*typesv1.Condition))
	}
	var b strings.Builder
	for _, a := range out.Actions {
		fmt.Fprintf(&b, "action %s\n", a)
	}
	fmt.Fprintf(&b, "phase %s\n", m.Status.Phase)
	for _, c := range m.Status.Conditions {
		fmt.Fprintf(&b, "condition %s=%s reason=%s since=%s", c.Type, c.Status, c.Reason, c.LastTransitionTime.AsTime().Sub(t0))
		if c.Message != "" {
			fmt.Fprintf(&b, " %q", c.Message)
		}
		b.WriteString("\n")
	}
	if out.Requeue > 0 {
		fmt.Fprintf(&b, "requeue=%s\n", out.Requeue)
	}
	return b.String()
}

// do carries out the last plan's actions as the executor would.
func (w *world) do(t *testing.T, name string) string {
	out, ok := w.last[name]
	require.True(t, ok, "do %s: no plan since the last restart", name)
	delete(w.last, name)
	m := w.machines[name]
	var b strings.Builder
	for _, act := range out.Actions {
		switch a := act.(type) {
		case BindHost:
			h := w.hosts[a.Host]
			if h.Status.Machine != "" && h.Status.Machine != a.Machine {
				fmt.Fprintf(&b, "bind %s: Conflict: bound to %s\n", a.Host, h.Status.Machine)
				continue
			}
			h.Status.Machine = a.Machine
		case Bootstrap:
			if a.Attach {
				fmt.Fprintf(&b, "attached to %s\n", a.OperationID)
				continue
			}
			m.Metadata.Annotations[AnnotationAttempt] = strconv.Itoa(a.Attempt)
			w.setCond(m, conditions.New(ConditionOperation, conditions.True, ReasonRunning, "operation "+a.OperationID))
			fmt.Fprintf(&b, "started %s\n", a.OperationID)
		case Probe:
			w.setCond(m, conditions.New(clusterplan.MachineNodeReady, conditions.True, "KubeletReady", ""))
		case Teardown:
			if a.Unbind {
				w.hosts[a.Host].Status.Machine = ""
			}
			delete(w.machines, a.Machine)
			fmt.Fprintf(&b, "deleted machine %s\n", a.Machine)
		default:
			t.Fatalf("unknown action %T", act)
		}
	}
	return b.String()
}

// outcome records how the machine's operation ended, as the executor does.
func (w *world) outcome(t *testing.T, m *typesv1.Machine, how string, a map[string]string) {
	switch how {
	case "succeeded":
		w.setCond(m, conditions.New(ConditionOperation, conditions.False, ReasonSucceeded, ""))
		w.setCond(m, conditions.New(ConditionBootstrapped, conditions.True, "Kubeadm", ""))
		if conditions.Get(m.Status.Conditions, ConditionBootstrapFailed) != nil {
			w.setCond(m, conditions.New(ConditionBootstrapFailed, conditions.False, "Bootstrapped", ""))
		}
		m.Status.NodeName = m.Spec.Host
		if m.Spec.Role == clusterplan.RoleControlPlane {
			m.Status.EtcdMember = m.Spec.Host
		}
	case "failed", "refused":
		reason := ReasonFailed
		if how == "refused" {
			reason = ReasonRefused
		}
		w.setCond(m, conditions.New(ConditionOperation, conditions.False, reason, a["msg"]))
		w.setCond(m, conditions.New(ConditionBootstrapFailed, conditions.True, a["reason"], a["msg"]))
	case "waiting":
		w.setCond(m, conditions.New(ConditionOperation, conditions.False, ReasonWaiting, a["msg"]))
		if c := WaitingCondition(m.Status.Conditions, a["msg"]); c != nil {
			w.setCond(m, c)
		}
	case "lost":
		w.setCond(m, conditions.New(ConditionOperation, conditions.False, ReasonLost, "the agent knows no such operation"))
	default:
		t.Fatalf("op %s: want succeeded, failed, refused, waiting or lost", how)
	}
	// The refusals in a row (the executor's recordOperation).
	if how == "refused" {
		m.Metadata.Annotations[AnnotationRefusals] = strconv.Itoa(Refusals(m) + 1)
	} else {
		delete(m.Metadata.Annotations, AnnotationRefusals)
	}
}

func (w *world) cleanup() string {
	in := CleanupInput{}
	for _, n := range sortedKeys(w.hosts) {
		in.Hosts = append(in.Hosts, w.hosts[n])
	}
	for _, n := range sortedKeys(w.machines) {
		in.Machines = append(in.Machines, w.machines[n])
	}
	for _, n := range sortedKeys(w.clusters) {
		in.Clusters = append(in.Clusters, w.clusters[n])
	}
	var b strings.Builder
	for _, act := range PlanCleanup(in) {
		fmt.Fprintf(&b, "action %s\n", act)
		switch a := act.(type) {
		case DeleteClusterMachine:
			delete(w.machines, a.Machine)
		case DeleteCredentials:
			delete(w.creds, a.Cluster)
		case ReleaseHost:
			if w.hosts[a.Host].Status.Machine == a.Machine {
				w.hosts[a.Host].Status.Machine = ""
			}
		}
	}
	return b.String()
}

func (w *world) list() string {
	var b strings.Builder
	for _, n := range sortedKeys(w.machines) {
		m := w.machines[n]
		fmt.Fprintf(&b, "machine %s host=%s phase=%s attempt=%d\n", n, m.Spec.Host, m.Status.Phase, Attempt(m))
	}
	for _, n := range sortedKeys(w.hosts) {
		fmt.Fprintf(&b, "host %s machine=%q\n", n, w.hosts[n].Status.Machine)
	}
	return b.String()
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
