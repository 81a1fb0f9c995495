package topologyplan

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/manifest"
	"github.com/kilnhq/kiln/internal/transcript"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

var update = flag.Bool("update", false, "rewrite testdata/*.txt with the actual output")

// TestTranscripts replays testdata/*.txt. Commands:
//
//	class FILE                        the ClusterClass of testdata/classes/FILE
//	                                  is applied (a new spec for the same name)
//	classplan                         PlanClass with the world's clusters;
//	                                  print and apply the status, create the
//	                                  Rollout
//	cluster name=N class=C version=V [cp=R] [pools=name:class:replicas,...]
//	        [vars=k=v;k=v]            apply a topology cluster (generation+1)
//	plan N                            plan cluster N and print; apply nothing
//	apply N                           plan, print, apply actions and status
//	edit KIND/NAME replicas=R|image=I a user edits a derived object's spec
//	delete KIND/NAME                  a user deletes a derived object
//	pin N rev=R                       a Rollout moves cluster N's pin
//	objects                           list the stored derived objects
//
// Run with -update to rewrite the files, then review the diff.
func TestTranscripts(t *testing.T) {
	transcript.Run(t, "testdata/*.txt", *update, func(t *testing.T) transcript.Exec {
		w := &world{clusters: map[string]*typesv1.Cluster{}, objs: map[string]proto.Message{}, rollouts: map[string]*typesv1.Rollout{}}
		return w.exec
	})
}

type world struct {
	class    *typesv1.ClusterClass
	clusters map[string]*typesv1.Cluster
	// objs are the derived objects by "Kind/name".
	objs     map[string]proto.Message
	rollouts map[string]*typesv1.Rollout
}

func kv(fields []string) map[string]string {
	m := map[string]string{}
	for _, f := range fields {
		k, v, _ := strings.Cut(f, "=")
		m[k] = v
	}
	return m
}

func (w *world) exec(t *testing.T, cmd string) string {
	fields := strings.Fields(cmd)
	require.NotEmpty(t, fields)
	a := kv(fields[1:])
	switch fields[0] {
	case "class":
		raw, err := os.ReadFile(filepath.Join("testdata", "classes", fields[1]))
		require.NoError(t, err)
		docs, err := manifest.Decode(fields[1], raw)
		require.NoError(t, err)
		require.Len(t, docs, 1)
		cc := docs[0].Resource.GetClusterClass()
		require.NotNil(t, cc)
		if w.class == nil {
			w.class = cc
			w.class.Metadata.Generation = 1
		} else {
			w.class.Spec = cc.GetSpec()
			w.class.Metadata.Generation++
		}
		return ""
	case "classplan":
		res := PlanClass(w.class, w.classClusters())
		var b strings.Builder
		if res.Event != "" {
			fmt.Fprintf(&b, "event %q\n", res.Event)
		}
		if res.Rollout != nil {
			fmt.Fprintf(&b, "create Rollout %s change=%s:r%d selector=%v waveLabel=%q bake=%q\n", res.Rollout.GetMetadata().GetName(),
				res.Rollout.GetSpec().GetChange().GetClusterClass(), res.Rollout.GetSpec().GetChange().GetClassRevision(),
				res.Rollout.GetSpec().GetClusterSelector(), res.Rollout.GetSpec().GetWaveLabel(), res.Rollout.GetSpec().GetBake())
			w.rollouts[res.Rollout.GetMetadata().GetName()] = res.Rollout
		}
		if res.Status != nil {
			w.class.Status = res.Status
		}
		var revs []string
		for _, r := range w.class.GetStatus().GetRevisions() {
			revs = append(revs, strconv.FormatInt(r.GetRevision(), 10))
		}
		fmt.Fprintf(&b, "class revision=%d kept=[%s] clusters=%d upToDate=%d\n", w.class.GetStatus().GetRevision(), strings.Join(revs, " "),
			w.class.GetStatus().GetClusters(), w.class.GetStatus().GetUpToDateClusters())
		return b.String()
	case "cluster":
		c := w.clusters[a["name"]]
		if c == nil {
			c = &typesv1.Cluster{Metadata: &typesv1.ObjectMeta{Name: a["name"]}}
			w.clusters[a["name"]] = c
		}
		c.Metadata.Generation++
		top := &typesv1.ClusterTopology{Class: a["class"], Version: a["version"]}
		if r := a["cp"]; r != "" {
			n, err := strconv.Atoi(r)
			require.NoError(t, err)
			top.ControlPlaneReplicas = int32(n)
		}
		if p := a["pools"]; p != "" {
			for _, pool := range strings.Split(p, ",") {
				parts := strings.Split(pool, ":")
				require.Len(t, parts, 3, "pool %q: want name:class:replicas", pool)
				n, err := strconv.Atoi(parts[2])
				require.NoError(t, err)
				top.Workers = append(top.Workers, &typesv1.TopologyWorkerPool{Name: parts[0], Class: parts[1], Replicas: int32(n)})
			}
		}
		if v := a["vars"]; v != "" {
			top.Variables = map[string]string{}
			for _, pair := range strings.Split(v, ";") {
				k, val, _ := strings.Cut(pair, "=")
				top.Variables[k] = val
			}
		}
		c.Spec = &typesv1.ClusterSpec{Topology: top}
		return ""
	case "plan", "apply":
		c := w.clusters[fields[1]]
		require.NotNil(t, c, "no cluster %s", fields[1])
		res := Plan(w.input(c))
		var b strings.Builder
		for _, act := range res.Actions {
			fmt.Fprintf(&b, "%s\n", act)
		}
		for _, e := range res.Events {
			typ := "Normal"
			if e.Warning {
				typ = "Warning"
			}
			fmt.Fprintf(&b, "event %s %s/%s %s %q\n", typ, e.Kind, e.Name, e.Reason, e.Message)
		}
		cd := res.Condition
		fmt.Fprintf(&b, "status pin=%d reconciled=%d version=%s\n", res.Topology.GetClassRevision(), res.Topology.GetReconciledRevision(), res.Topology.GetVersion())
		fmt.Fprintf(&b, "condition %s=%s reason=%s gen=%d %q\n", cd.GetType(), cd.GetStatus(), cd.GetReason(), cd.GetObservedGeneration(), cd.GetMessage())
		if fields[0] == "apply" {
			for _, act := range res.Actions {
				switch x := act.(type) {
				case Create:
					w.objs[x.Kind+"/"+metaOf(x.Object).GetName()] = proto.Clone(x.Object)
				case Update:
					w.objs[x.Kind+"/"+x.Name] = proto.Clone(x.Object)
				case Delete:
					delete(w.objs, x.Kind+"/"+x.Name)
				}
			}
			if c.Status == nil {
				c.Status = &typesv1.ClusterStatus{}
			}
			c.Status.Topology = res.Topology
			c.Status.Conditions, _ = conditions.Set(c.Status.Conditions, res.Condition, t0)
		}
		return b.String()
	case "edit":
		o := w.objs[fields[1]]
		require.NotNil(t, o, "no object %s", fields[1])
		switch x := o.(type) {
		case *typesv1.ControlPlane:
			if r := a["replicas"]; r != "" {
				n, _ := strconv.Atoi(r)
				x.Spec.Replicas = int32(n)
			}
			if i := a["image"]; i != "" {
				x.Spec.Image = i
			}
		case *typesv1.MachineDeployment:
			if r := a["replicas"]; r != "" {
				n, _ := strconv.Atoi(r)
				x.Spec.Replicas = int32(n)
			}
			if i := a["image"]; i != "" {
				x.Spec.Image = i
			}
		default:
			t.Fatalf("edit %s: not supported", fields[1])
		}
		return ""
	case "delete":
		delete(w.objs, fields[1])
		return ""
	case "pin":
		c := w.clusters[fields[1]]
		n, err := strconv.ParseInt(a["rev"], 10, 64)
		require.NoError(t, err)
		c.Status.Topology.ClassRevision = n
		return ""
	case "objects":
		var keys []string
		for k := range w.objs {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var b strings.Builder
		for _, k := range keys {
			o := w.objs[k]
			fmt.Fprintf(&b, "%s r%s %s\n", k, metaOf(o).GetAnnotations()[AnnotationRevision], specText(o))
		}
		return b.String()
	}
	t.Fatalf("unknown command %q", fields[0])
	return ""
}

var t0 = mustTime()

func (w *world) classClusters() []*typesv1.Cluster {
	var out []*typesv1.Cluster
	var names []string
	for n := range w.clusters {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if c := w.clusters[n]; c.GetSpec().GetTopology().GetClass() == w.class.GetMetadata().GetName() {
			out = append(out, c)
		}
	}
	return out
}

func (w *world) input(c *typesv1.Cluster) Input {
	in := Input{Cluster: c}
	if w.class != nil && w.class.GetMetadata().GetName() == c.GetSpec().GetTopology().GetClass() {
		in.Class = w.class
	}
	var keys []string
	for k := range w.objs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		o := w.objs[k]
		if metaOf(o).GetLabels()[LabelOwned] != c.GetMetadata().GetName() {
			continue
		}
		switch x := o.(type) {
		case *typesv1.ControlPlane:
			in.ControlPlanes = append(in.ControlPlanes, x)
		case *typesv1.MachineDeployment:
			in.MachineDeployments = append(in.MachineDeployments, x)
		case *typesv1.HealthCheck:
			in.HealthChecks = append(in.HealthChecks, x)
		}
	}
	return in
}

func mustTime() (t time.Time) { return time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC) }
