package rolloutplan

import (
	"flag"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/transcript"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

var update = flag.Bool("update", false, "rewrite testdata/*.txt with the actual output")

// t0 is the transcripts' time origin; "at 90s" means t0+90s.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// TestTranscripts replays testdata/*.txt (blocks of one command, "----"
// and the expected output). Commands:
//
//	cluster name=N [wave=W] [labels=k=v,...] [version=V] [image=I]
//	        [imageSelector=k=v,...] [workers=N] [class=C rev=R]   a Ready cluster: a ControlPlane
//	                                      N-cp (and MachineDeployment N-md
//	                                      with workers), or with class a
//	                                      topology cluster pinned at R
//	rollout [version=V] [image=I] [imageSelector=k=v,...] [class=C rev=R]
//	        [select=k=v,...] [wave=LABEL] [bake=D] [max=N]
//	        [readyTimeout=D] [remediation] [halt=Type:Status[:Timeout]]
//	                                      (re)writes the Rollout's spec
//	pause | unpause | resume | abort      what kilnctl rollout does
//	at D                                  move the clock to t0+D
//	plan                                  plan, print, store the status,
//	                                      apply the actions to the world
//	crash                                 plan and print, then lose it:
//	                                      nothing stored, nothing applied
//	settle N                              cluster N finishes what it was
//	                                      asked: rolled and Ready
//	break N reason="..."                  cluster N's control plane and
//	                                      Ready go False with reason
//	cond N type=T status=S                set a condition of cluster N
//	pin N rev=R                           another Rollout pins N at R
//	remediate N                           a HealthCheck of N remediates
//	                                      a machine now
//	status                                print the stored status
func TestTranscripts(t *testing.T) {
	transcript.Run(t, "testdata/*.txt", *update, func(t *testing.T) transcript.Exec {
		w := &world{now: t0, clusters: map[string]*ClusterInput{},
			rollout: &typesv1.Rollout{Metadata: &typesv1.ObjectMeta{Name: "ro"}, Spec: &typesv1.RolloutSpec{}}}
		return w.exec
	})
}

type world struct {
	now      time.Time
	clusters map[string]*ClusterInput
	rollout  *typesv1.Rollout
}

func args(fields []string) map[string]string {
	m := map[string]string{}
	for _, f := range fields {
		k, v, _ := strings.Cut(f, "=")
		m[k] = strings.Trim(v, `"`)
	}
	return m
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

func cond(t, status, reason, msg string, gen int64, now time.Time) *typesv1.Condition {
	return &typesv1.Condition{Type: t, Status: status, Reason: reason, Message: msg, ObservedGeneration: gen, LastTransitionTime: timestamppb.New(now)}
}

func setCond(list []*typesv1.Condition, c *typesv1.Condition, now time.Time) []*typesv1.Condition {
	out, _ := conditions.Set(list, c, now)
	return out
}

func (w *world) exec(t *testing.T, cmd string) string {
	// Quoted values may hold spaces: split on spaces outside quotes.
	var fields []string
	var cur strings.Builder
	quoted := false
	for _, r := range cmd {
		switch {
		case r == '"':
			quoted = !quoted
			cur.WriteRune(r)
		case r == ' ' && !quoted:
			if cur.Len() > 0 {
				fields = append(fields, cur.String())
				cur.Reset()
			}
		default:
			cur.WriteRune(r)
		}
	}
	if cur.Len() > 0 {
		fields = append(fields, cur.String())
	}
	require.NotEmpty(t, fields)
	a := args(fields[1:])
	spec := w.rollout.Spec
	switch fields[0] {
	case "cluster":
		w.addCluster(t, a)
	case "rollout":
		rev, _ := strconv.ParseInt(a["rev"], 10, 64)
		max, _ := strconv.Atoi(a["max"])
		spec.Change = &typesv1.RolloutChange{KubernetesVersion: a["version"], Image: a["image"],
			ImageSelector: labelMap(a["imageSelector"]), ClusterClass: a["class"], ClassRevision: rev}
		spec.ClusterSelector = labelMap(a["select"])
		spec.WaveLabel, spec.Bake, spec.MaxConcurrent = a["wave"], a["bake"], int32(max)
		spec.Halt = &typesv1.RolloutHalt{ReadyTimeout: a["readyTimeout"]}
		if _, ok := a["remediation"]; ok {
			spec.Halt.OnRemediation = true
		}
		if h := a["halt"]; h != "" {
			parts := strings.Split(h, ":")
			u := &typesv1.UnhealthyCondition{Type: parts[0], Status: parts[1]}
			if len(parts) > 2 {
				u.Timeout = parts[2]
			}
			spec.Halt.Conditions = append(spec.Halt.Conditions, u)
		}
		w.rollout.Metadata.Generation++
	case "pause":
		spec.Paused = true
		w.rollout.Metadata.Generation++
	case "unpause":
		spec.Paused = false
		w.rollout.Metadata.Generation++
	case "resume":
		spec.Paused = false
		spec.Resume++
		w.rollout.Metadata.Generation++
	case "abort":
		spec.Aborted = true
		w.rollout.Metadata.Generation++
	case "at":
		d, err := time.ParseDuration(fields[1])
		require.NoError(t, err)
		w.now = t0.Add(d)
	case "plan", "crash":
		p := Decide(w.input(), w.now)
		out := w.print(p)
		if fields[0] == "plan" {
			w.rollout.Status = p.Status
			for _, act := range p.Actions {
				w.apply(t, act)
			}
		}
		return out
	case "status":
		return w.printStatus(w.rollout.GetStatus())
	case "settle":
		w.settle(t, fields[1])
	case "break":
		c := w.cluster(t, fields[1])
		for _, cp := range c.ControlPlanes {
			cp.Status.ReadyReplicas, cp.Status.UpdatedReplicas = 0, 0
			cp.Status.Conditions = setCond(cp.Status.Conditions, cond("Ready", "False", a["reason"], a["reason"]+": "+a["msg"], cp.Metadata.Generation, w.now), w.now)
		}
		c.Cluster.Status.Conditions = setCond(c.Cluster.Status.Conditions, cond("Ready", "False", "ControlPlaneNotReady", a["msg"], c.Cluster.Metadata.Generation, w.now), w.now)
	case "cond":
		c := w.cluster(t, fields[1])
		c.Cluster.Status.Conditions = setCond(c.Cluster.Status.Conditions, cond(a["type"], a["status"], a["reason"], a["msg"], c.Cluster.Metadata.Generation, w.now), w.now)
	case "pin":
		rev, err := strconv.ParseInt(a["rev"], 10, 64)
		require.NoError(t, err)
		w.cluster(t, fields[1]).Cluster.Status.Topology.ClassRevision = rev
	case "remediate":
		c := w.cluster(t, fields[1])
		c.Remediations = append(c.Remediations, w.now)
	default:
		t.Fatalf("unknown command %q", fields[0])
	}
	return ""
}

func (w *world) cluster(t *testing.T, name string) *ClusterInput {
	c, ok := w.clusters[name]
	require.True(t, ok, "no cluster %s", name)
	return c
}

func (w *world) input() Input {
	in := Input{Rollout: proto.Clone(w.rollout).(*typesv1.Rollout)}
	for _, name := range slices.Sorted(maps.Keys(w.clusters)) {
		c := w.clusters[name]
		in.Clusters = append(in.Clusters, ClusterInput{
			Cluster: proto.Clone(c.Cluster).(*typesv1.Cluster), ControlPlanes: c.ControlPlanes,
			Deployments: c.Deployments, Remediations: slices.Clone(c.Remediations)})
	}
	return in
}

func (w *world) addCluster(t *testing.T, a map[string]string) {
	name := a["name"]
	labels := labelMap(a["labels"])
	if labels == nil {
		labels = map[string]string{}
	}
	if v, ok := a["wave"]; ok {
		labels["upgrade-wave"] = v
	}
	version := a["version"]
	if version == "" {
		version = "v1.34.4"
	}
	c := &ClusterInput{Cluster: &typesv1.Cluster{
		Metadata: &typesv1.ObjectMeta{Name: name, Labels: labels, Generation: 1},
		Spec:     &typesv1.ClusterSpec{KubernetesVersion: version},
		Status:   &typesv1.ClusterStatus{},
	}}
	if cls := a["class"]; cls != "" {
		rev, err := strconv.ParseInt(a["rev"], 10, 64)
		require.NoError(t, err)
		c.Cluster.Spec.Topology = &typesv1.ClusterTopology{Class: cls, Version: version, ControlPlaneReplicas: 1}
		c.Cluster.Status.Topology = &typesv1.ClusterTopologyStatus{ClassRevision: rev, Version: version}
	}
	c.ControlPlanes = []*typesv1.ControlPlane{{Metadata: &typesv1.ObjectMeta{Name: name + "-cp", Generation: 1},
		Spec:   &typesv1.ControlPlaneSpec{Cluster: name, Replicas: 1, Version: version, Image: a["image"], ImageSelector: labelMap(a["imageSelector"])},
		Status: &typesv1.ControlPlaneStatus{}}}
	if n, _ := strconv.Atoi(a["workers"]); n > 0 {
		c.Deployments = []*typesv1.MachineDeployment{{Metadata: &typesv1.ObjectMeta{Name: name + "-md", Generation: 1},
			Spec:   &typesv1.MachineDeploymentSpec{Cluster: name, Replicas: int32(n), Version: version, Image: a["image"], ImageSelector: labelMap(a["imageSelector"])},
			Status: &typesv1.MachineDeploymentStatus{}}}
	}
	w.clusters[name] = c
	w.settle(t, name)
}

// settle makes every object of the cluster rolled and Ready at its
// current generation: what the cluster and topology controllers do.
func (w *world) settle(t *testing.T, name string) {
	c := w.cluster(t, name)
	cl := c.Cluster
	if topo := cl.Spec.GetTopology(); topo != nil {
		// The topology controller derives the objects from the pin.
		rev := strconv.FormatInt(cl.Status.Topology.ClassRevision, 10)
		for _, cp := range c.ControlPlanes {
			if cp.Spec.Version != topo.Version {
				cp.Spec.Version = topo.Version
				cp.Metadata.Generation++
			}
			cp.Metadata.Annotations = map[string]string{AnnotationClassRevision: rev}
		}
		cl.Status.Topology.Version = topo.Version
		cl.Status.Conditions = setCond(cl.Status.Conditions, cond(ConditionTopologyReconciled, "True", "AsExpected",
			fmt.Sprintf("revision %d at %s", cl.Status.Topology.ClassRevision, topo.Version), cl.Metadata.Generation, w.now), w.now)
	}
	for _, cp := range c.ControlPlanes {
		n := cp.Spec.Replicas
		cp.Status.Replicas, cp.Status.UpdatedReplicas, cp.Status.ReadyReplicas = n, n, n
		cp.Status.Image = cp.Spec.Image
		cp.Status.Conditions = setCond(cp.Status.Conditions, cond("Ready", "True", "AsExpected", "", cp.Metadata.Generation, w.now), w.now)
	}
	for _, md := range c.Deployments {
		n := md.Spec.Replicas
		md.Status.Replicas, md.Status.UpdatedReplicas, md.Status.ReadyReplicas = n, n, n
		md.Status.Conditions = setCond(md.Status.Conditions, cond("UpToDate", "True", "AsExpected", "", md.Metadata.Generation, w.now), w.now)
	}
	cl.Status.Conditions = setCond(cl.Status.Conditions, cond("Ready", "True", "AsExpected", "", cl.Metadata.Generation, w.now), w.now)
}

// apply performs an action as the executor does: a spec write bumps the
// generation, so the object waits for its controller again.
func (w *world) apply(t *testing.T, act Action) {
	setFields := func(f Fields, version, image *string, sel *map[string]string) {
		if f.Version != "" {
			*version = f.Version
		}
		if f.SetImage {
			*image, *sel = f.Image, f.ImageSelector
		}
	}
	switch a := act.(type) {
	case SetControlPlane:
		for _, cp := range w.cluster(t, a.Cluster).ControlPlanes {
			if cp.Metadata.Name == a.ControlPlane {
				setFields(a.Set, &cp.Spec.Version, &cp.Spec.Image, &cp.Spec.ImageSelector)
				cp.Metadata.Generation++
			}
		}
	case SetDeployment:
		for _, md := range w.cluster(t, a.Cluster).Deployments {
			if md.Metadata.Name == a.Deployment {
				setFields(a.Set, &md.Spec.Version, &md.Spec.Image, &md.Spec.ImageSelector)
				md.Metadata.Generation++
			}
		}
	case SetClusterVersion:
		c := w.cluster(t, a.Cluster).Cluster
		c.Spec.KubernetesVersion = a.Version
		c.Metadata.Generation++
	case SetTopologyVersion:
		c := w.cluster(t, a.Cluster).Cluster
		c.Spec.Topology.Version = a.Version
		c.Metadata.Generation++
	case SetClassRevision:
		w.cluster(t, a.Cluster).Cluster.Status.Topology.ClassRevision = a.Revision
	default:
		t.Fatalf("unknown action %T", act)
	}
}

func (w *world) print(p Plan) string {
	var b strings.Builder
	for _, name := range p.Started {
		fmt.Fprintf(&b, "start %s\n", name)
	}
	for _, a := range p.Actions {
		fmt.Fprintf(&b, "action %s\n", a)
	}
	if p.Replan {
		b.WriteString("replan\n")
	}
	if p.Requeue > 0 {
		fmt.Fprintf(&b, "requeue %s\n", p.Requeue)
	}
	b.WriteString(w.printStatus(p.Status))
	return b.String()
}

func (w *world) printStatus(st *typesv1.RolloutStatus) string {
	var b strings.Builder
	fmt.Fprintf(&b, "phase %s\n", st.GetPhase())
	for _, wv := range st.GetWaves() {
		fmt.Fprintf(&b, "wave %s %s clusters=%s", wv.GetValue(), wv.GetState(), strings.Join(wv.GetClusters(), ","))
		if len(wv.GetDone()) > 0 {
			fmt.Fprintf(&b, " done=%s", strings.Join(wv.GetDone(), ","))
		}
		if len(wv.GetInProgress()) > 0 {
			fmt.Fprintf(&b, " moving=%s", strings.Join(wv.GetInProgress(), ","))
		}
		if wv.GetMessage() != "" {
			fmt.Fprintf(&b, " %q", wv.GetMessage())
		}
		b.WriteString("\n")
	}
	for _, rc := range st.GetClusters() {
		fmt.Fprintf(&b, "cluster %s wave=%s %s started=%s", rc.GetName(), rc.GetWave(), rc.GetState(), rc.GetStartTime().AsTime().Sub(t0))
		if rc.GetDoneTime() != nil {
			fmt.Fprintf(&b, " done=%s", rc.GetDoneTime().AsTime().Sub(t0))
		}
		fmt.Fprintf(&b, " from=%s\n", rc.GetFrom())
	}
	for _, c := range st.GetConditions() {
		fmt.Fprintf(&b, "condition %s=%s reason=%s %q\n", c.GetType(), c.GetStatus(), c.GetReason(), c.GetMessage())
	}
	return b.String()
}
