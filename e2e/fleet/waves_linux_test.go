package fleet_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/controller/rolloutplan"
	"github.com/kilnhq/kiln/controller/topologyplan"
	"github.com/kilnhq/kiln/e2e/fleet"
	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/manifest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// waveClusters are the clusters of examples/fleet-lab, one per wave.
var waveClusters = []string{"store-1", "store-2", "store-3"}

const (
	// waveClass is examples/fleet-lab's ClusterClass.
	waveClass = "lab-store"
	// revision2 is the line of its file that makes revision 2 once
	// uncommented: its control plane's imageSelector gains patch=2.
	revision2 = `# patch: "2"`
	// exampleGateway is the lab gateway the example's endpoints name
	// (the default lab subnet's).
	exampleGateway = "10.251.250.1:"
)

// TestLabRolloutWaves is a ClusterClass change rolled in waves on a lab
// rack of six hosts, with the real controller, agents, kubeadm and API
// servers. examples/fleet-lab is applied as a user applies a fleet
// repository (kilnctl apply -R -f DIR): ClusterClass lab-store and three
// clusters derived from it by spec.topology (store-1, store-2, store-3,
// one control plane each, upgrade-wave 1, 2 and 3; two hosts per store,
// labelled site=store-N: its node and a spare for the 1→2→1 rollout,
// behind an API load balancer of its own). Then the change: an image
// labelled patch=2 is published and the class file's revision-2 line
// uncommented and applied again; the controller records revision 2 and
// creates Rollout lab-store-r2 from the class's spec.rollout (bake 20s,
// halt when a control plane has HostsAvailable=False for 20s). Wave 1
// rolls and bakes; wave 2's store finds no spare host (its spare was
// taken out of its site before the change: the injected failure), so its
// control plane cannot roll (HostsAvailable=False, NoSpareHost) and the
// rollout halts naming the cluster and the condition, wave 3 untouched (same
// machine, image, revision, ControlPlane generation). The spare is put
// back, kilnctl rollout resume, and the rollout completes: every store on
// revision 2, its control plane on the new image on its other host.
// kilnctl get rollouts is logged at each stage; the timeline as
// "timeline:" lines.
//
// Opt-in (KILN_E2E_WAVES=1, make lab-waves): it takes longer than make
// test's budget for one test allows (docs/lab.md, "make lab-waves").
func TestLabRolloutWaves(t *testing.T) {
	needLab(t)
	if os.Getenv("KILN_E2E_WAVES") == "" {
		// Deliberate opt-in (not testenv): KILN_NO_SKIP does not turn it on.
		t.Skip("the rollout-in-waves lab runs only with KILN_E2E_WAVES=1 (12-27 min measured: three clusters provisioned, three control planes rolled one wave after another); make lab-waves runs it")
	}
	end := time.Now().Add(45 * time.Minute)
	if d, ok := t.Deadline(); ok && d.Add(-3*time.Minute).Before(end) {
		end = d.Add(-3 * time.Minute)
	}
	ctx, cancel := context.WithDeadline(context.Background(), end)
	defer cancel()
	lab, tag := startLab(t, ctx, func(c *fleet.Config) { c.Hosts, c.IPMI = 6, 0 })
	r := &waveRun{t: t, ctx: ctx, lab: lab, start: time.Now(), sites: map[string]string{}}

	// Two hosts per store, and an API load balancer per store on the lab
	// gateway (the lab's own fronts every host: three clusters cannot
	// share it).
	for i, c := range waveClusters {
		a, b := lab.HostResource(2*i+1), lab.HostResource(2*i+2)
		r.sites[a], r.sites[b] = c, c
		lb, err := rack.ListenLoadBalancer(r.endpoint(i),
			[]string{net.JoinHostPort(lab.HostAddress(2*i+1), "6443"), net.JoinHostPort(lab.HostAddress(2*i+2), "6443")},
			slog.New(slog.NewTextHandler(io.Discard, nil)))
		require.NoError(t, err)
		t.Cleanup(func() { lb.Close() })
	}
	r.registerHosts()

	// The fleet repository, as a user keeps it: a copy of
	// examples/fleet-lab with the lab's gateway in the endpoints.
	repo := r.checkout()
	r.applyRepo(repo)
	r.mark("applied %s: ClusterClass %s, clusters %s (waves 1, 2, 3) on hosts %s", "examples/fleet-lab", waveClass, strings.Join(waveClusters, ", "), r.sitesText())
	r.waitAll("every cluster Ready", func(s map[string]*fleet.Snapshot) bool {
		for _, c := range waveClusters {
			if !s[c].Ready() || !running(s[c], 1) || !topologyplan.Reconciled(s[c].Cluster) {
				return false
			}
		}
		return true
	})
	before := r.snapshots()
	for _, c := range waveClusters {
		require.EqualValues(t, 1, before[c].Cluster.GetStatus().GetTopology().GetClassRevision(), "cluster %s follows revision 1", c)
	}
	r.mark("clusters Ready at revision 1: %s", r.cpHosts(before))
	r.logGet("clusterclasses")

	// The new image: the same bits under a new tag (as TestLabLifecycle),
	// labelled patch=2.
	tag2 := tag + "-p2"
	img := map[string]any{}
	b, err := lab.Kilnctl(ctx, nil, "get", "image", tag, "-o", "yaml")
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal([]byte(b), &img))
	meta, _ := img["metadata"].(map[string]any)
	labels, _ := meta["labels"].(map[string]any)
	require.NotNil(t, labels, "image %s has labels", tag)
	labels["patch"] = "2"
	img["metadata"] = map[string]any{"name": tag2, "labels": labels}
	delete(img, "status")
	out, err := yaml.Marshal(img)
	require.NoError(t, err)
	r.apply(out)
	r.mark("published image %s (labels %v)", tag2, labels)

	// The injected failure: store-2's spare host leaves its site.
	spare := ""
	for h, site := range r.sites {
		if site == "store-2" && machineOnHost(before["store-2"], h) == nil {
			spare = h
		}
	}
	require.NotEmpty(t, spare, "store-2 has a spare host")
	r.sites[spare] = "repair"
	r.registerHosts()
	r.mark("failure injected: store-2's spare host %s taken out of its site (site=repair)", spare)

	// The class change: revision 2, as a commit to the repository.
	cf := filepath.Join(repo, "clusterclasses", waveClass+".yaml")
	cb, err := os.ReadFile(cf)
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(string(cb), revision2), "%s: the revision-2 line", cf)
	require.NoError(t, os.WriteFile(cf, []byte(strings.Replace(string(cb), revision2, strings.TrimPrefix(revision2, "# "), 1)), 0o644))
	r.applyRepo(repo)
	r.ro = topologyplan.RolloutName(waveClass, 2)
	r.mark("class change applied: %s's control-plane imageSelector gains patch=2", waveClass)

	r.waitRollout("wave 1 baking", func(ro *typesv1.Rollout) bool { return ro.GetStatus().GetPhase() == rolloutplan.PhaseBaking })
	r.logGet("clusterclasses")
	s := r.snapshots()
	require.Equal(t, tag2, cpMachine(t, s["store-1"]).GetSpec().GetImage(), "store-1 after wave 1")
	require.NotEqual(t, cpMachine(t, before["store-1"]).GetSpec().GetHost(), cpMachine(t, s["store-1"]).GetSpec().GetHost(), "store-1 moved to its spare host")
	require.EqualValues(t, 2, s["store-1"].Cluster.GetStatus().GetTopology().GetClassRevision(), "store-1 follows revision 2")
	require.Equal(t, tag, cpMachine(t, s["store-2"]).GetSpec().GetImage(), "store-2 during wave 1's bake")

	ro := r.waitRollout("halted in wave 2", func(ro *typesv1.Rollout) bool { return ro.GetStatus().GetPhase() == rolloutplan.PhaseHalted })
	prog := conditions.Get(ro.GetStatus().GetConditions(), rolloutplan.ConditionProgressing)
	require.Equal(t, rolloutplan.ReasonHaltCondition, prog.GetReason())
	require.Contains(t, prog.GetMessage(), "wave 2: control plane store-2-control-plane has HostsAvailable=False for 20s (timeout 20s): NoSpareHost: ")
	require.Contains(t, prog.GetMessage(), "site=store-2")
	r.mark("halt reason %s: %s", prog.GetReason(), prog.GetMessage())
	require.Equal(t, []string{rolloutplan.WaveDone, rolloutplan.WaveHalted, rolloutplan.WaveWaiting}, waveStates(ro))
	s = r.snapshots()
	w3, w3Before := cpMachine(t, s["store-3"]), cpMachine(t, before["store-3"])
	require.Equal(t, w3Before.GetMetadata().GetUid(), w3.GetMetadata().GetUid(), "wave 3 untouched: its machine")
	require.Equal(t, tag, w3.GetSpec().GetImage(), "wave 3 untouched: its image")
	require.EqualValues(t, 1, s["store-3"].Cluster.GetStatus().GetTopology().GetClassRevision(), "wave 3 untouched: its revision")
	cp3 := "store-3-control-plane"
	require.Equal(t, before["store-3"].ControlPlanes[cp3].GetMetadata().GetGeneration(), s["store-3"].ControlPlanes[cp3].GetMetadata().GetGeneration(), "wave 3 untouched: its ControlPlane spec")
	require.Equal(t, "1", s["store-3"].ControlPlanes[cp3].GetMetadata().GetAnnotations()[topologyplan.AnnotationRevision], "wave 3 untouched: its ControlPlane's revision")
	desc, err := lab.Kilnctl(ctx, nil, "describe", "rollout", r.ro)
	require.NoError(t, err)
	t.Logf("kilnctl describe rollout %s (halted):\n%s", r.ro, desc)

	// The fix, then resume.
	r.sites[spare] = "store-2"
	r.registerHosts()
	r.mark("fixed: %s back in store-2's site", spare)
	got, err := lab.Kilnctl(ctx, nil, "rollout", "resume", r.ro)
	require.NoError(t, err)
	r.mark("kilnctl rollout resume %s: %s", r.ro, strings.TrimSpace(got))

	ro = r.waitRollout("complete", func(ro *typesv1.Rollout) bool { return ro.GetStatus().GetPhase() == rolloutplan.PhaseComplete })
	s = r.snapshots()
	for _, c := range waveClusters {
		m := cpMachine(t, s[c])
		require.Equal(t, tag2, m.GetSpec().GetImage(), "cluster %s", c)
		require.NotEqual(t, cpMachine(t, before[c]).GetSpec().GetHost(), m.GetSpec().GetHost(), "cluster %s: control plane on its other host", c)
		require.True(t, s[c].Ready(), "cluster %s Ready", c)
		require.EqualValues(t, 2, s[c].Cluster.GetStatus().GetTopology().GetClassRevision(), "cluster %s follows revision 2", c)
		require.True(t, topologyplan.Reconciled(s[c].Cluster), "cluster %s reconciled to revision 2", c)
	}
	r.mark("complete: %s", r.cpHosts(s))
	for _, rc := range ro.GetStatus().GetClusters() {
		r.mark("cluster %s wave %s: started %s, done %s (from %s)", rc.GetName(), rc.GetWave(),
			rc.GetStartTime().AsTime().UTC().Format(time.TimeOnly), rc.GetDoneTime().AsTime().UTC().Format(time.TimeOnly), rc.GetFrom())
	}
	r.logGet("clusterclasses")
	r.timeline()
}

// waveRun is the state of TestLabRolloutWaves.
type waveRun struct {
	t     *testing.T
	ctx   context.Context
	lab   *fleet.Lab
	start time.Time
	lines []string
	// sites maps each lab host to its site label (the class's
	// hostSelector is site: ${site}).
	sites map[string]string
	// ro is the Rollout of the class change.
	ro      string
	lastGet string
}

func (r *waveRun) mark(format string, args ...any) {
	now := time.Now()
	line := fmt.Sprintf("[%5ds %s] %s", int(now.Sub(r.start).Seconds()), now.UTC().Format(time.TimeOnly), fmt.Sprintf(format, args...))
	r.lines = append(r.lines, line)
	r.t.Log("timeline: " + line)
}

func (r *waveRun) timeline() {
	r.t.Logf("timeline (UTC; seconds since the lab was up):\n%s", strings.Join(r.lines, "\n"))
}

// endpoint is cluster i's API load balancer: the lab gateway, port 6444+i.
func (r *waveRun) endpoint(i int) string {
	return net.JoinHostPort(r.lab.Gateway(), strconv.Itoa(6444+i))
}

func (r *waveRun) apply(b []byte) {
	r.t.Helper()
	_, err := r.lab.Kilnctl(r.ctx, b, "apply", "-f", "-")
	require.NoError(r.t, err, "kilnctl apply:\n%s", b)
}

// checkout copies examples/fleet-lab to a directory of its own, with the
// lab's gateway in place of the default lab subnet's in every endpoint.
func (r *waveRun) checkout() string {
	r.t.Helper()
	src := filepath.Join(repoRoot(), "examples", "fleet-lab")
	dst := r.t.TempDir()
	files, err := manifest.FilesRecursive(src)
	require.NoError(r.t, err)
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(r.t, err)
		rel, err := filepath.Rel(src, f)
		require.NoError(r.t, err)
		if strings.HasPrefix(rel, "clusters"+string(filepath.Separator)) {
			require.Equal(r.t, 1, strings.Count(string(b), exampleGateway), "%s: one endpoint on %s", f, exampleGateway)
			require.Contains(r.t, string(b), "version: "+kubetools.Pinned().Kubernetes, "%s: the lab's Kubernetes version", f)
			b = []byte(strings.ReplaceAll(string(b), exampleGateway, r.lab.Gateway()+":"))
		}
		require.NoError(r.t, os.MkdirAll(filepath.Join(dst, filepath.Dir(rel)), 0o755))
		require.NoError(r.t, os.WriteFile(filepath.Join(dst, rel), b, 0o644))
	}
	return dst
}

// applyRepo runs kilnctl apply -R -f dir and logs what it said.
func (r *waveRun) applyRepo(dir string) {
	r.t.Helper()
	out, err := r.lab.Kilnctl(r.ctx, nil, "apply", "-R", "-f", dir)
	require.NoError(r.t, err, "kilnctl apply -R -f %s: %s", dir, out)
	r.t.Logf("kilnctl apply -R -f %s:\n%s", dir, out)
}

// logGet logs kilnctl get kind.
func (r *waveRun) logGet(kind string) {
	r.t.Helper()
	out, err := r.lab.Kilnctl(r.ctx, nil, "get", kind)
	require.NoError(r.t, err)
	r.mark("kilnctl get %s:\n%s", kind, strings.TrimRight(out, "\n"))
}

// registerHosts applies the rack's hosts labelled with their sites.
func (r *waveRun) registerHosts() {
	out, err := r.lab.HostsYAML(r.ctx)
	require.NoError(r.t, err)
	docs := splitDocs(r.t, []byte(out))
	for _, d := range docs {
		if d["kind"] != "Host" {
			continue
		}
		meta := d["metadata"].(map[string]any)
		labels, _ := meta["labels"].(map[string]any)
		if labels == nil {
			labels = map[string]any{}
		}
		labels["site"] = r.sites[meta["name"].(string)]
		meta["labels"] = labels
	}
	r.apply(joinDocs(r.t, docs))
}

func (r *waveRun) sitesText() string {
	var parts []string
	for _, h := range sortedNames(r.sites) {
		parts = append(parts, h+"="+r.sites[h])
	}
	return strings.Join(parts, " ")
}

func (r *waveRun) snapshots() map[string]*fleet.Snapshot {
	r.t.Helper()
	out := map[string]*fleet.Snapshot{}
	for _, c := range waveClusters {
		s, err := r.lab.Snapshot(r.ctx, c)
		require.NoError(r.t, err)
		out[c] = s
	}
	return out
}

// cpHosts says which host runs each cluster's control plane.
func (r *waveRun) cpHosts(s map[string]*fleet.Snapshot) string {
	var parts []string
	for _, c := range waveClusters {
		m := cpMachine(r.t, s[c])
		parts = append(parts, fmt.Sprintf("%s on %s (%s)", c, m.GetSpec().GetHost(), m.GetSpec().GetImage()))
	}
	return strings.Join(parts, ", ")
}

// waitAll polls every cluster every 2 s until done.
func (r *waveRun) waitAll(what string, done func(map[string]*fleet.Snapshot) bool) {
	r.t.Helper()
	var last string
	for {
		s := map[string]*fleet.Snapshot{}
		ok := true
		for _, c := range waveClusters {
			x, err := r.lab.Snapshot(r.ctx, c)
			if err != nil {
				ok = false
				break
			}
			s[c] = x
		}
		if ok {
			if done(s) {
				return
			}
			var lines []string
			for _, c := range waveClusters {
				lines = append(lines, s[c].Lines()...)
			}
			last = strings.Join(lines, "\n")
		}
		select {
		case <-r.ctx.Done():
			r.t.Fatalf("waiting for %s: %v; last state:\n%s\ncontroller log (last lines):\n%s", what, r.ctx.Err(), last, tail(r.lab.ControllerLog(), 40))
		case <-time.After(2 * time.Second):
		}
	}
}

// waitRollout polls Rollout r.ro every 2 s until done, logging each new
// kilnctl get rollouts line of it as a timeline line.
func (r *waveRun) waitRollout(what string, done func(*typesv1.Rollout) bool) *typesv1.Rollout {
	r.t.Helper()
	return waitRollout(r.t, r.ctx, r.lab, r.ro, what, &r.lastGet, r.mark, done)
}

// waitRollout polls Rollout name every 2 s until done, marking each new
// kilnctl get rollouts line (the lab's only rollout) with mark; lastGet
// keeps the last line marked.
func waitRollout(t *testing.T, ctx context.Context, lab *fleet.Lab, name, what string, lastGet *string, mark func(string, ...any), done func(*typesv1.Rollout) bool) *typesv1.Rollout {
	t.Helper()
	for {
		if out, err := lab.Kilnctl(ctx, nil, "get", "rollouts"); err == nil {
			// The rollout's row. The bake's time left changes every poll:
			// log a new state only.
			var fields []string
			for _, row := range strings.Split(out, "\n") {
				if f := strings.Fields(row); len(f) > 1 && f[0] == name {
					fields = f[:len(f)-1] // AGE
				}
			}
			line := strings.Join(fields, " ")
			key := bakeLeftPattern(line)
			if line != "" && key != *lastGet {
				*lastGet = key
				mark("kilnctl get rollouts: %s", line)
			}
		}
		c, err := lab.Client(ctx)
		if err == nil {
			var res *controllerv1.Resource
			res, err = c.Get(ctx, &controllerv1.GetRequest{Kind: "Rollout", Name: name})
			if err == nil && done(res.GetRollout()) {
				return res.GetRollout()
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for the rollout %s %s: %v\ncontroller log (last lines):\n%s", name, what, ctx.Err(), tail(lab.ControllerLog(), 40))
		case <-time.After(2 * time.Second):
		}
	}
}

// sameBitsImage is the Image tag under the name tag2 with its labels: a
// new image as far as the fleet is concerned, without a second build.
func sameBitsImage(t *testing.T, ctx context.Context, lab *fleet.Lab, tag, tag2 string) []byte {
	t.Helper()
	img := map[string]any{}
	b, err := lab.Kilnctl(ctx, nil, "get", "image", tag, "-o", "yaml")
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal([]byte(b), &img))
	meta, _ := img["metadata"].(map[string]any)
	img["metadata"] = map[string]any{"name": tag2, "labels": meta["labels"]}
	delete(img, "status")
	out, err := yaml.Marshal(img)
	require.NoError(t, err)
	return out
}

// bakeLeftPattern drops the time left of a bake from a get line.
func bakeLeftPattern(line string) string {
	i := strings.Index(line, "Baking(")
	if i < 0 {
		return line
	}
	j := strings.Index(line[i:], ")")
	if j < 0 {
		return line
	}
	return line[:i] + "Baking" + line[i+j+1:]
}

func waveStates(ro *typesv1.Rollout) []string {
	var out []string
	for _, w := range ro.GetStatus().GetWaves() {
		out = append(out, w.GetState())
	}
	return out
}

// cpMachine is the one live control-plane machine of s.
func cpMachine(t *testing.T, s *fleet.Snapshot) *typesv1.Machine {
	t.Helper()
	var out []*typesv1.Machine
	for _, n := range sortedNames(s.Machines) {
		m := s.Machines[n]
		if m.GetSpec().GetRole() == "control-plane" && m.GetMetadata().GetDeletionTimestamp() == nil {
			out = append(out, m)
		}
	}
	require.Len(t, out, 1, "live control-plane machines of cluster %s", s.Cluster.GetMetadata().GetName())
	return out[0]
}
