package clusterplan

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/transcript"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

var update = flag.Bool("update", false, "rewrite testdata/*.txt with the actual output")

// t0 is the transcripts' time origin; "at=90s" means t0+90s.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// TestTranscripts replays testdata/*.txt: blocks of one command, a "----"
// line and the expected output, separated by blank lines. Durations are
// Go durations from t0, or days ("40d"). Commands:
//
//	cluster version=V [renewal=DAYS]
//	controlplane replicas=N version=V image=I [surge=0|1] [selector=k=v]
//	           [imageSelector=k=v,...]
//	deployment name=N replicas=N version=V image=I [strategy=S] [maxSurge=X]
//	           [maxUnavailable=X] [drain=D] [selector=k=v]
//	           [imageSelector=k=v,...]
//	image name=N [labels=k=v,...] [patch=YYYYMMDD] [version=V]
//	                                      an Image; once one is declared,
//	                                      only declared images exist
//	healthcheck name=N [cond=Type:Status:Timeout,...] [startup=D]
//	           [maxUnhealthy=X] [selector=k=v]
//	host name=N [labels=k=v,...]          an Available host
//	machine name=N owner=O host=H version=V image=I [ready=false] [node=false]
//	           [etcd=false] [etcdHealthy=false] [certs=D] [labels=k=v]
//	cond machine=M type=T status=S        set a condition of a machine at now
//	delete machine=M                      a user deletes a machine
//	at T                                  move the clock
//	plan cp|md=NAME|hc=NAME               plan and print; apply nothing
//	apply cp|md=NAME|hc=NAME              plan, print, apply the actions
//	settle                                every new machine becomes Ready
//	run cp|md=NAME [max=N]                settle, plan and apply until no
//	                                      action is left
//	machines                              list the machines
//
// Run with -update to rewrite the files, then review the diff.
func TestTranscripts(t *testing.T) {
	transcript.Run(t, "testdata/*.txt", *update, func(t *testing.T) transcript.Exec {
		return (&runner{w: newWorld(t0)}).exec
	})
}

type runner struct {
	w *world
}

func args(t *testing.T, fields []string) map[string]string {
	m := map[string]string{}
	for _, f := range fields {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			m[f] = ""
			continue
		}
		m[k] = v
	}
	return m
}

func dur(t *testing.T, s string) time.Duration {
	if d, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(d)
		require.NoError(t, err)
		return time.Duration(n) * 24 * time.Hour
	}
	d, err := time.ParseDuration(s)
	require.NoError(t, err)
	return d
}

func labelMap(s string) map[string]string {
	if s == "" {
		return nil
	}
	m := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}

func (r *runner) exec(t *testing.T, cmd string) string {
	w := r.w
	fields := strings.Fields(cmd)
	require.NotEmpty(t, fields)
	a := args(t, fields[1:])
	switch fields[0] {
	case "cluster":
		w.cluster.Spec.KubernetesVersion = a["version"]
		if d := a["renewal"]; d != "" {
			n, err := strconv.Atoi(d)
			require.NoError(t, err)
			w.cluster.Spec.CertificateRenewalDays = int32(n)
		}
		return ""
	case "controlplane":
		n, err := strconv.Atoi(a["replicas"])
		require.NoError(t, err)
		surge, _ := strconv.Atoi(a["surge"])
		if w.cp == nil {
			w.cp = &typesv1.ControlPlane{Metadata: &typesv1.ObjectMeta{Name: "cp"}}
		}
		w.cp.Metadata.Generation++
		w.cp.Spec = &typesv1.ControlPlaneSpec{Cluster: "c1", Replicas: int32(n), Version: a["version"], Image: a["image"],
			HostSelector: labelMap(a["selector"]), RolloutMaxSurge: int32(surge), ImageSelector: labelMap(a["imageSelector"])}
		return ""
	case "deployment":
		n, err := strconv.Atoi(a["replicas"])
		require.NoError(t, err)
		md := w.mds[a["name"]]
		if md == nil {
			md = &typesv1.MachineDeployment{Metadata: &typesv1.ObjectMeta{Name: a["name"]}}
			w.mds[a["name"]] = md
		}
		md.Metadata.Generation++
		md.Spec = &typesv1.MachineDeploymentSpec{Cluster: "c1", Replicas: int32(n), Version: a["version"], Image: a["image"],
			HostSelector: labelMap(a["selector"]), ImageSelector: labelMap(a["imageSelector"]),
			Strategy: &typesv1.RolloutStrategy{Type: a["strategy"], MaxSurge: a["maxSurge"], MaxUnavailable: a["maxUnavailable"], NodeDrainTimeout: a["drain"]}}
		return ""
	case "image":
		w.addImage(a["name"], labelMap(a["labels"]), a["patch"], a["version"])
		return ""
	case "healthcheck":
		hc := w.hcs[a["name"]]
		if hc == nil {
			hc = &typesv1.HealthCheck{Metadata: &typesv1.ObjectMeta{Name: a["name"]}}
			w.hcs[a["name"]] = hc
		}
		hc.Metadata.Generation++
		hc.Spec = &typesv1.HealthCheckSpec{Cluster: "c1", Selector: labelMap(a["selector"]), NodeStartupTimeout: a["startup"], MaxUnhealthy: a["maxUnhealthy"]}
		if c := a["cond"]; c != "" {
			for _, rule := range strings.Split(c, ",") {
				parts := strings.Split(rule, ":")
				require.Len(t, parts, 3, "cond %q: want Type:Status:Timeout", rule)
				hc.Spec.UnhealthyConditions = append(hc.Spec.UnhealthyConditions, &typesv1.UnhealthyCondition{Type: parts[0], Status: parts[1], Timeout: parts[2]})
			}
		}
		return ""
	case "host":
		w.addHost(a["name"], labelMap(a["labels"]))
		return ""
	case "machine":
		role := RoleWorker
		if strings.HasPrefix(a["owner"], "ControlPlane/") {
			role = RoleControlPlane
		}
		m := w.addMachine(a["name"], a["owner"], role, a["host"], a["version"], a["image"])
		m.Metadata.Labels = labelMap(a["labels"])
		if a["node"] != "false" {
			w.makeReady(m)
		}
		if a["ready"] == "false" {
			w.setCond(m, MachineNodeReady, "False")
		}
		if a["etcd"] == "false" {
			m.Status.EtcdMember = ""
		}
		if a["etcdHealthy"] == "false" {
			w.setCond(m, MachineEtcdHealthy, "False")
		}
		if c := a["certs"]; c != "" {
			m.Status.CertificatesNotAfter = timestamppb.New(t0.Add(dur(t, c)))
		}
		return ""
	case "cond":
		m := w.machines[a["machine"]]
		require.NotNil(t, m, "no machine %q", a["machine"])
		w.setCond(m, a["type"], a["status"])
		return ""
	case "delete":
		m := w.machines[a["machine"]]
		require.NotNil(t, m, "no machine %q", a["machine"])
		m.Metadata.DeletionTimestamp = timestamppb.New(w.now)
		return ""
	case "at":
		w.now = t0.Add(dur(t, fields[1]))
		return ""
	case "settle":
		w.settle()
		return ""
	case "machines":
		var b strings.Builder
		for _, m := range w.machineList() {
			x := machine{m}
			fmt.Fprintf(&b, "%s host=%s %s image=%s ready=%v", x.name(), x.host(), m.Spec.Version, m.Spec.Image, x.ready())
			if x.member() != "" {
				fmt.Fprintf(&b, " etcd=%s", x.member())
				if !x.etcdOK() {
					b.WriteString(" etcdHealthy=false")
				}
			}
			if x.removing() {
				fmt.Fprintf(&b, " drained=%v", x.drained())
			}
			b.WriteString("\n")
		}
		return b.String()
	case "plan", "apply":
		out, actions := r.plan(t, fields[1])
		if fields[0] == "apply" {
			w.apply(actions)
		}
		return out
	case "run":
		max := 50
		if s := a["max"]; s != "" {
			max, _ = strconv.Atoi(s)
		}
		var b strings.Builder
		for step := 1; ; step++ {
			w.settle()
			out, actions := r.plan(t, fields[1])
			if len(actions) == 0 || step > max {
				fmt.Fprintf(&b, "stopped after %d steps\n%s", step-1, out)
				return b.String()
			}
			names := make([]string, len(actions))
			for i, a := range actions {
				names[i] = a.String()
			}
			fmt.Fprintf(&b, "%d: %s\n", step, strings.Join(names, "; "))
			w.apply(actions)
		}
	}
	t.Fatalf("unknown command %q", cmd)
	return ""
}

// plan runs the planner named by what and formats its result.
func (r *runner) plan(t *testing.T, what string) (string, []Action) {
	w := r.w
	var b strings.Builder
	switch {
	case what == "cp":
		p := w.planCP()
		b.WriteString(formatActions(p.Actions))
		s := p.Status
		fmt.Fprintf(&b, "status replicas=%d ready=%d updated=%d etcd=%d\n", s.Replicas, s.ReadyReplicas, s.UpdatedReplicas, s.EtcdMembers)
		b.WriteString(formatConds(s.Conditions, t0))
		if p.Requeue > 0 {
			fmt.Fprintf(&b, "requeue=%s\n", p.Requeue)
		}
		return b.String(), p.Actions
	case strings.HasPrefix(what, "md="):
		p := w.planMD(strings.TrimPrefix(what, "md="))
		b.WriteString(formatActions(p.Actions))
		s := p.Status
		fmt.Fprintf(&b, "status replicas=%d ready=%d updated=%d unavailable=%d\n", s.Replicas, s.ReadyReplicas, s.UpdatedReplicas, s.UnavailableReplicas)
		b.WriteString(formatConds(s.Conditions, t0))
		if p.Requeue > 0 {
			fmt.Fprintf(&b, "requeue=%s\n", p.Requeue)
		}
		return b.String(), p.Actions
	case strings.HasPrefix(what, "hc="):
		p := w.planHC(strings.TrimPrefix(what, "hc="))
		b.WriteString(formatActions(p.Actions))
		for _, m := range w.machineList() {
			if why := p.Unhealthy[m.Metadata.Name]; why != "" {
				fmt.Fprintf(&b, "unhealthy %s: %s\n", m.Metadata.Name, why)
			}
		}
		s := p.Status
		fmt.Fprintf(&b, "status expected=%d healthy=%d remediationsAllowed=%d\n", s.ExpectedMachines, s.CurrentHealthy, s.RemediationsAllowed)
		b.WriteString(formatConds(s.Conditions, t0))
		if p.Requeue > 0 {
			fmt.Fprintf(&b, "requeue=%s\n", p.Requeue)
		}
		return b.String(), p.Actions
	}
	t.Fatalf("plan %q: want cp, md=NAME or hc=NAME", what)
	return "", nil
}
