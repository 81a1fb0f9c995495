package gitsource_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-git/go-git/v5"
	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/object"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/gitplan"
	"github.com/kilnhq/kiln/controller/gitsource"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/topologyexec"
	"github.com/kilnhq/kiln/controller/topologyplan"
	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/manifest"
	"github.com/kilnhq/kiln/internal/seal"
	"github.com/kilnhq/kiln/internal/testenv"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

type env struct {
	ctx  context.Context
	st   *store.Store
	res  *resources.Service
	ex   *gitsource.Executor
	topo *topologyexec.Executor
	repo *git.Repository
	dir  string
	now  time.Time
}

func newEnv(t *testing.T) *env {
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
	ev := &env{ctx: ctx, st: st, now: time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)}
	clock := func() time.Time { return ev.now }
	ev.res = resources.New(st, rec, clock, log)
	ev.dir = t.TempDir()
	ev.ex = gitsource.New(gitsource.Deps{Store: st, Resources: ev.res, Recorder: rec}, gitsource.Config{Clock: clock, FileRoots: []string{ev.dir}}, log)
	ev.topo = topologyexec.New(st, rec, topologyexec.Config{Clock: clock}, log)
	ev.repo, err = git.PlainInitWithOptions(ev.dir, &git.PlainInitOptions{
		InitOptions: git.InitOptions{DefaultBranch: plumbing.NewBranchReferenceName("main")},
	})
	require.NoError(t, err)
	return ev
}

// commit writes files (path -> content; "" removes the file) and commits
// them with go-git, returning the commit hash.
func (e *env) commit(t *testing.T, msg string, files map[string]string) string {
	t.Helper()
	wt, err := e.repo.Worktree()
	require.NoError(t, err)
	for p, content := range files {
		full := filepath.Join(e.dir, p)
		if content == "" {
			_, err := wt.Remove(p)
			require.NoError(t, err)
			continue
		}
		require.NoError(t, os.MkdirAll(filepath.Dir(full), 0o755))
		require.NoError(t, os.WriteFile(full, []byte(content), 0o644))
		_, err := wt.Add(p)
		require.NoError(t, err)
	}
	h, err := wt.Commit(msg, &git.CommitOptions{Author: &object.Signature{Name: "fleet", Email: "fleet@example.com", When: e.now}})
	require.NoError(t, err)
	return h.String()
}

func clusterYAML(name, workers, imageOS string) string {
	return fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: %[1]s
  labels:
    env: edge
spec:
  kubernetesVersion: v1.34.4
  podCidr: 10.244.0.0/16
  serviceCidr: 10.96.0.0/12
  controlPlaneEndpoint: 127.0.0.1:6443
---
apiVersion: kiln.dev/v1
kind: ControlPlane
metadata:
  name: %[1]s-cp
spec:
  cluster: %[1]s
  replicas: 1
  version: v1.34.4
  imageSelector:
    os: debian12
  hostSelector:
    site: %[1]s
---
apiVersion: kiln.dev/v1
kind: MachineDeployment
metadata:
  name: %[1]s-workers
spec:
  cluster: %[1]s
  replicas: %[2]s
  version: v1.34.4
  imageSelector:
    os: %[3]s
  hostSelector:
    site: %[1]s
`, name, workers, imageOS)
}

// classYAML is a ClusterClass "edge-small" whose control plane and
// worker class "general" are laid with an image of imageOS; its new
// revisions roll wave by wave (upgrade-wave), one cluster at a time.
func classYAML(imageOS string) string {
	return fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: ClusterClass
metadata:
  name: edge-small
spec:
  variables:
    - name: site
      type: string
      required: true
  cluster:
    podCidr: 10.244.0.0/16
    serviceCidr: 10.96.0.0/12
  controlPlane:
    hostSelector:
      site: ${site}
    imageSelector:
      os: %[1]s
  workers:
    - name: general
      template:
        hostSelector:
          site: ${site}
        imageSelector:
          os: %[1]s
  rollout:
    waveLabel: upgrade-wave
    bake: 10m
    maxConcurrent: 1
`, imageOS)
}

// topologyYAML is a Cluster made from class edge-small, in wave.
func topologyYAML(name, wave string) string {
	return fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: %[1]s
  labels:
    upgrade-wave: "%[2]s"
spec:
  controlPlaneEndpoint: 127.0.0.1:6443
  topology:
    class: edge-small
    version: v1.34.4
    workers:
      - {name: general, class: general, replicas: 2}
    variables:
      site: %[1]s
`, name, wave)
}

// reconcileTopology runs the controller's topology executor once over
// every class and topology cluster, as its watches would after a sync:
// classes first (a new class records its revision 1, a changed one its
// next revision and the Rollout "<class>-r<rev>"), then the clusters (a
// new one is pinned to its class's revision and its objects derived),
// then the classes again (their up-to-date counts).
func (e *env) reconcileTopology(t *testing.T) {
	t.Helper()
	classes := func() {
		items, _, err := e.st.List(e.ctx, topologyexec.ClusterClassesKind, func() proto.Message { return &typesv1.ClusterClass{} }, store.ListOptions{})
		require.NoError(t, err)
		for _, it := range items {
			require.NoError(t, e.topo.ReconcileClass(e.ctx, it.Name, nil))
		}
	}
	classes()
	clusters := map[string]bool{}
	items, _, err := e.st.List(e.ctx, topologyexec.ClustersKind, func() proto.Message { return &typesv1.Cluster{} }, store.ListOptions{})
	require.NoError(t, err)
	for _, it := range items {
		clusters[it.Name] = true
	}
	cps, _, err := e.st.List(e.ctx, topologyexec.ControlPlanesKind, func() proto.Message { return &typesv1.ControlPlane{} }, store.ListOptions{})
	require.NoError(t, err)
	for _, it := range cps {
		if owner := it.Msg.(*typesv1.ControlPlane).GetMetadata().GetLabels()[topologyplan.LabelOwned]; owner != "" {
			clusters[owner] = true // a deleted cluster's objects go with it
		}
	}
	for name := range clusters {
		require.NoError(t, e.topo.ReconcileCluster(e.ctx, name))
	}
	classes()
}

func (e *env) source(t *testing.T, name, path string) {
	t.Helper()
	_, err := e.res.Apply(e.ctx, []*controllerv1.Resource{{Kind: &controllerv1.Resource_GitSource{GitSource: &typesv1.GitSource{
		Metadata: &typesv1.ObjectMeta{Name: name},
		Spec:     &typesv1.GitSourceSpec{Url: "file://" + e.dir, Branch: "main", Path: path, Interval: "1m"},
	}}}}, false)
	require.NoError(t, err)
}

func (e *env) status(t *testing.T, name string) *typesv1.GitSourceStatus {
	t.Helper()
	src := &typesv1.GitSource{}
	_, err := e.st.Get(e.ctx, gitsource.Kind, name, src)
	require.NoError(t, err)
	return src.GetStatus()
}

// objects lists the store's clusters, control planes, deployments,
// cluster classes and rollouts as "kind/name", with a deployment's
// replicas and image OS, a control plane's image OS when it is derived
// from a class, a topology cluster's class and pinned revision, a class's
// revision and kept revisions, and what a rollout changes.
func (e *env) objects(t *testing.T) string {
	t.Helper()
	var out []string
	for _, kind := range []string{"cluster", "controlplane", "machinedeployment", "clusterclass", "rollout"} {
		items, _, err := e.res.List(e.ctx, kind, nil, 0, "")
		require.NoError(t, err)
		for _, it := range items {
			_, obj, _ := resources.Unwrap(it)
			s := kind + "/" + resources.Meta(obj).GetName()
			switch o := obj.(type) {
			case *typesv1.Cluster:
				if tp := o.GetSpec().GetTopology(); tp != nil {
					s += fmt.Sprintf("(%s pin %d)", tp.GetClass(), o.GetStatus().GetTopology().GetClassRevision())
				}
			case *typesv1.ControlPlane:
				if o.GetMetadata().GetLabels()[topologyplan.LabelOwned] != "" {
					s += fmt.Sprintf("(%s)", o.GetSpec().GetImageSelector()["os"])
				}
			case *typesv1.MachineDeployment:
				s += fmt.Sprintf("(x%d,%s)", o.GetSpec().GetReplicas(), o.GetSpec().GetImageSelector()["os"])
			case *typesv1.ClusterClass:
				var revs []string
				for _, r := range o.GetStatus().GetRevisions() {
					revs = append(revs, fmt.Sprint(r.GetRevision()))
				}
				s += fmt.Sprintf("(r%d of [%s])", o.GetStatus().GetRevision(), strings.Join(revs, " "))
			case *typesv1.Rollout:
				s += fmt.Sprintf("(%s r%d)", o.GetSpec().GetChange().GetClusterClass(), o.GetSpec().GetChange().GetClassRevision())
			}
			out = append(out, s)
		}
	}
	return strings.Join(out, " ")
}

// TestGitSourceCommits drives a local repository (file://, commits made
// with go-git) through the life of a fleet directory and checks, after
// each commit, what the controller applied or refused: the source's
// status and the store's objects. It prints the sequence as a table.
func TestGitSourceCommits(t *testing.T) {
	if testing.Short() {
		t.Skip("starts an embedded etcd")
	}
	e := newEnv(t)
	// A README outside the path and a file that is not YAML are ignored.
	e.commit(t, "README", map[string]string{"README.md": "# fleet\n", "clusters/notes.txt": "not yaml\n"})
	e.source(t, "fleet", "clusters")

	type step struct {
		change  string
		files   map[string]string
		applied bool   // the commit becomes status.appliedCommit
		want    string // the store's objects after the sync
		refused string // part of the refusal message
	}
	// What the store holds, as sets of "kind/name(...)" (objects sorts
	// them by kind, so a want is compared word by word, in any order).
	edge := func(name string, workers int, os string) string {
		return fmt.Sprintf("cluster/%[1]s controlplane/%[1]s-cp machinedeployment/%[1]s-workers(x%[2]d,%[3]s)", name, workers, os)
	}
	// store-1 and store-2, pinned to revision 1 of edge-small, laid with
	// debian12 (a class bump moves no cluster: its Rollout does).
	stores := "cluster/store-1(edge-small pin 1) cluster/store-2(edge-small pin 1) " +
		"controlplane/store-1-control-plane(debian12) controlplane/store-2-control-plane(debian12) " +
		"machinedeployment/store-1-general(x2,debian12) machinedeployment/store-2-general(x2,debian12)"
	storesR1 := stores + " clusterclass/edge-small(r1 of [1])"
	storesR2 := stores + " clusterclass/edge-small(r2 of [1 2]) rollout/edge-small-r2(edge-small r2)"
	join := func(parts ...string) string { return strings.Join(parts, " ") }
	steps := []step{
		{"add cluster edge-1", map[string]string{"clusters/edge/edge-1.yaml": clusterYAML("edge-1", "2", "debian12")}, true,
			edge("edge-1", 2, "debian12"), ""},
		{"add cluster edge-2", map[string]string{"clusters/edge/edge-2.yaml": clusterYAML("edge-2", "2", "debian12")}, true,
			join(edge("edge-1", 2, "debian12"), edge("edge-2", 2, "debian12")), ""},
		{"edge-2 workers 2 -> 3", map[string]string{"clusters/edge/edge-2.yaml": clusterYAML("edge-2", "3", "debian12")}, true,
			join(edge("edge-1", 2, "debian12"), edge("edge-2", 3, "debian12")), ""},
		{"edge-2 worker image os debian12 -> debian13", map[string]string{"clusters/edge/edge-2.yaml": clusterYAML("edge-2", "3", "debian13")}, true,
			join(edge("edge-1", 2, "debian12"), edge("edge-2", 3, "debian13")), ""},
		// A class and its clusters in one commit: one transaction, so
		// the clusters are checked against the class it applies (here
		// in a file read after theirs).
		{"add ClusterClass edge-small + clusters store-1 (wave 1), store-2 (wave 2) of it", map[string]string{
			"clusters/shared/edge-small.yaml": classYAML("debian12"),
			"clusters/edge/store-1.yaml":      topologyYAML("store-1", "1"),
			"clusters/edge/store-2.yaml":      topologyYAML("store-2", "2")}, true,
			join(edge("edge-1", 2, "debian12"), edge("edge-2", 3, "debian13"), storesR1), ""},
		{"bump class edge-small: image os debian12 -> debian13", map[string]string{"clusters/shared/edge-small.yaml": classYAML("debian13")}, true,
			join(edge("edge-1", 2, "debian12"), edge("edge-2", 3, "debian13"), storesR2), ""},
		{"class edge-small drops worker class general (store-1 and store-2 use it)", map[string]string{
			"clusters/shared/edge-small.yaml": strings.Replace(classYAML("debian13"), "    - name: general\n", "    - name: gpu\n", 1)}, false,
			join(edge("edge-1", 2, "debian12"), edge("edge-2", 3, "debian13"), storesR2),
			`clusters/shared/edge-small.yaml: apply ClusterClass "edge-small": ClusterClass "edge-small" is invalid: spec: the change would break 2 cluster(s) of the class: store-1 (workers[0].class: pool general names worker class "general", which the class does not have (it has gpu))`},
		{"remove cluster edge-1; class edge-small as in step 6", map[string]string{"clusters/edge/edge-1.yaml": "", "clusters/shared/edge-small.yaml": classYAML("debian13")}, true,
			join(edge("edge-2", 3, "debian13"), storesR2), ""},
		{"edge-2 podCidr change (refused by the controller) + add edge-4", map[string]string{
			"clusters/edge/edge-2.yaml": strings.Replace(clusterYAML("edge-2", "3", "debian13"), "10.244.0.0/16", "10.250.0.0/16", 1),
			"clusters/edge/edge-4.yaml": clusterYAML("edge-4", "1", "debian12")}, false,
			join(edge("edge-2", 3, "debian13"), storesR2), `clusters/edge/edge-2.yaml: apply Cluster "edge-2": Cluster "edge-2" is invalid: spec.podCidr: cannot change`},
		{"bad file edge-3 (replicas: -1) + edge-2 workers 3 -> 4", map[string]string{
			"clusters/edge/edge-3.yaml": clusterYAML("edge-3", "-1", "debian12"),
			"clusters/edge/edge-2.yaml": clusterYAML("edge-2", "4", "debian13")}, false,
			join(edge("edge-2", 3, "debian13"), storesR2), "clusters/edge/edge-3.yaml:"},
		{"a GitSource in the repository", map[string]string{
			"clusters/edge/edge-2.yaml": clusterYAML("edge-2", "4", "debian13"),
			"clusters/edge/edge-4.yaml": "",
			"clusters/edge/edge-3.yaml": clusterYAML("edge-3", "1", "debian12"),
			"clusters/evil.yaml":        "apiVersion: kiln.dev/v1\nkind: GitSource\nmetadata:\n  name: evil\nspec:\n  url: https://attacker.example/fleet.git\n"}, false,
			join(edge("edge-2", 3, "debian13"), storesR2), "a GitSource may not apply a GitSource"},
		{"fix: drop the GitSource", map[string]string{"clusters/evil.yaml": ""}, true,
			join(edge("edge-2", 4, "debian13"), edge("edge-3", 1, "debian12"), storesR2), ""},
	}
	var table strings.Builder
	fmt.Fprintf(&table, "\n| # | commit | change | outcome | Ready | store after the sync |\n|---|---|---|---|---|---|\n")
	lastApplied := ""
	for i, s := range steps {
		e.now = e.now.Add(time.Minute)
		commit := e.commit(t, s.change, s.files)
		out, err := e.ex.Sync(e.ctx, "fleet")
		require.NoError(t, err)
		e.reconcileTopology(t)
		st := e.status(t, "fleet")
		ready := conditions.Get(st.GetConditions(), gitplan.Ready)
		got := e.objects(t)
		outcome := fmt.Sprintf("applied (%d objects)", out.Objects)
		if s.applied {
			if st.GetAppliedCommit() != commit || ready.GetStatus() != "True" || out.Refused != "" {
				t.Fatalf("step %d %q: applied %s, Ready=%s %s, want commit %s applied", i+1, s.change, st.GetAppliedCommit(), ready.GetStatus(), ready.GetMessage(), commit)
			}
			lastApplied = commit
		} else {
			outcome = "refused: " + out.Refused
			if st.GetAppliedCommit() != lastApplied || st.GetRefusedCommit() != commit || ready.GetStatus() != "False" || ready.GetReason() != gitplan.ReasonRevisionRefused {
				t.Fatalf("step %d %q: applied %s refused %s Ready=%s %s, want %s refused and %s kept", i+1, s.change, st.GetAppliedCommit(), st.GetRefusedCommit(), ready.GetStatus(), ready.GetReason(), commit, lastApplied)
			}
			if !strings.Contains(ready.GetMessage(), s.refused) || !strings.Contains(ready.GetMessage(), "stays applied") {
				t.Fatalf("step %d %q: Ready message %q, want it to contain %q and say what stays applied", i+1, s.change, ready.GetMessage(), s.refused)
			}
		}
		if !sameWords(got, s.want) {
			t.Fatalf("step %d %q: store holds\n  %s\nwant\n  %s", i+1, s.change, got, s.want)
		}
		fmt.Fprintf(&table, "| %d | %s | %s | %s | %s %s | %s |\n", i+1, commit[:8], s.change, trim(outcome, 90), ready.GetStatus(), ready.GetReason(), got)
	}
	t.Log(table.String())

	// The class bump (step 6), as a user checks it: revision 2 recorded
	// with revision 1 kept (both clusters still pin it), and the Rollout
	// edge-small-r2 made from the class's spec.rollout to carry it, wave
	// by wave. The Rollout is the controller's, not the repository's: it
	// carries no GitSource label, so later revisions never prune it.
	class := &typesv1.ClusterClass{}
	_, err := e.st.Get(e.ctx, topologyexec.ClusterClassesKind, "edge-small", class)
	require.NoError(t, err)
	if got := class.GetStatus(); got.GetRevision() != 2 || got.GetClusters() != 2 || got.GetUpToDateClusters() != 0 {
		t.Fatalf("ClusterClass edge-small status: revision %d, %d clusters, %d up to date; want revision 2, 2 clusters, 0 up to date (the Rollout has moved none yet)",
			got.GetRevision(), got.GetClusters(), got.GetUpToDateClusters())
	}
	require.Equal(t, "debian13", class.GetStatus().GetRevisions()[1].GetSpec().GetControlPlane().GetImageSelector()["os"], "revision 2 holds the bumped image")
	ro := &typesv1.Rollout{}
	_, err = e.st.Get(e.ctx, topologyexec.RolloutsKind, topologyplan.RolloutName("edge-small", 2), ro)
	require.NoError(t, err, "the class bump made no Rollout edge-small-r2")
	require.Equal(t, "edge-small", ro.GetSpec().GetChange().GetClusterClass())
	require.EqualValues(t, 2, ro.GetSpec().GetChange().GetClassRevision())
	require.Equal(t, "upgrade-wave", ro.GetSpec().GetWaveLabel())
	require.Equal(t, "10m", ro.GetSpec().GetBake())
	require.Equal(t, "edge-small", ro.GetMetadata().GetLabels()[topologyplan.LabelClass])
	require.NotContains(t, ro.GetMetadata().GetLabels(), resources.GitSourceLabel)
	for _, name := range []string{"store-1", "store-2"} {
		c := &typesv1.Cluster{}
		_, err := e.st.Get(e.ctx, topologyexec.ClustersKind, name, c)
		require.NoError(t, err)
		require.True(t, topologyplan.Reconciled(c), "cluster %s: its objects match its pin", name)
		require.EqualValues(t, 1, c.GetStatus().GetTopology().GetClassRevision(), "cluster %s moved before its Rollout moved it", name)
		require.Equal(t, "fleet", c.GetMetadata().GetLabels()[resources.GitSourceLabel])
	}

	// Every object applied carries the source's label; every write of a
	// revision is audited as gitsource/fleet.
	md := &typesv1.MachineDeployment{}
	_, err = e.st.Get(e.ctx, "machinedeployments", "edge-2-workers", md)
	require.NoError(t, err)
	require.Equal(t, "fleet", md.GetMetadata().GetLabels()[resources.GitSourceLabel])
	var deletes, applies int
	require.NoError(t, e.st.ListAudit(e.ctx, time.Time{}, func() proto.Message { return &controllerv1.AuditEntry{} }, func(m proto.Message) bool {
		a := m.(*controllerv1.AuditEntry)
		if a.GetUser() != "gitsource/fleet" || a.GetRole() != "controller" {
			return true
		}
		switch a.GetVerb() {
		case "apply":
			applies++
		case "delete":
			deletes++
		}
		return true
	}))
	if deletes != 3 || applies == 0 {
		t.Fatalf("audit entries of gitsource/fleet: %d applies, %d deletes; want some applies and the 3 deletes of edge-1", applies, deletes)
	}
}

// sameWords reports whether a and b hold the same space-separated words,
// in any order.
func sameWords(a, b string) bool {
	x, y := strings.Fields(a), strings.Fields(b)
	slices.Sort(x)
	slices.Sort(y)
	return slices.Equal(x, y)
}

func trim(s string, n int) string {
	s = strings.ReplaceAll(s, "|", "/")
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// TestGitSourceLeavesOthersAlone: a source never prunes or changes an
// object it did not apply, and a revision naming another source's object
// is refused without touching either.
func TestGitSourceLeavesOthersAlone(t *testing.T) {
	if testing.Short() {
		t.Skip("starts an embedded etcd")
	}
	e := newEnv(t)
	// An operator's own cluster, applied by hand, with the same labels.
	_, err := e.res.Apply(e.ctx, docs(t, clusterYAML("hand-1", "1", "debian12")), false)
	require.NoError(t, err)
	e.commit(t, "edge", map[string]string{"a/edge-1.yaml": clusterYAML("edge-1", "1", "debian12"), "b/core-1.yaml": clusterYAML("core-1", "1", "debian12")})
	e.source(t, "edge", "a")
	e.source(t, "core", "b")
	for _, s := range []string{"edge", "core"} {
		out, err := e.ex.Sync(e.ctx, s)
		require.NoError(t, err)
		require.Empty(t, out.Refused+out.ApplyError+out.FetchError)
	}
	// edge now claims core's cluster: refused whole, nothing changes.
	e.commit(t, "steal", map[string]string{"a/core-1.yaml": clusterYAML("core-1", "5", "debian12")})
	out, err := e.ex.Sync(e.ctx, "edge")
	require.NoError(t, err)
	require.Contains(t, out.Refused, `belongs to GitSource "core"`)
	md := &typesv1.MachineDeployment{}
	_, err = e.st.Get(e.ctx, "machinedeployments", "core-1-workers", md)
	require.NoError(t, err)
	require.EqualValues(t, 1, md.GetSpec().GetReplicas())
	// edge drops everything: its own cluster goes, hand-1 and core-1 stay.
	e.commit(t, "empty", map[string]string{"a/core-1.yaml": "", "a/edge-1.yaml": "", "a/keep.yaml": "# nothing\n"})
	out, err = e.ex.Sync(e.ctx, "edge")
	require.NoError(t, err)
	require.Empty(t, out.Refused)
	require.Equal(t, "cluster/core-1 cluster/hand-1 controlplane/core-1-cp controlplane/hand-1-cp machinedeployment/core-1-workers(x1,debian12) machinedeployment/hand-1-workers(x1,debian12)", e.objects(t))
	_, err = e.st.Get(e.ctx, "clusters", "edge-1", &typesv1.Cluster{})
	require.True(t, errdefs.IsNotFound(err), "edge-1 should have been pruned, got %v", err)
}

func docs(t *testing.T, y string) []*controllerv1.Resource {
	t.Helper()
	d, err := manifestParse(y)
	require.NoError(t, err)
	return d
}

func manifestParse(y string) ([]*controllerv1.Resource, error) {
	ds, err := validation.ParseManifests([]manifest.File{{Name: "x.yaml", Data: []byte(y)}})
	var out []*controllerv1.Resource
	for _, d := range ds {
		out = append(out, d.Resource)
	}
	return out, err
}

// TestGitDaemonClone fetches over git:// from a `git daemon` on loopback
// (the network path: a one-commit-deep clone into memory) and applies
// the revision. It skips when git is not installed.
func TestGitDaemonClone(t *testing.T) {
	if testing.Short() {
		t.Skip("starts an embedded etcd and git daemon")
	}
	gitBin := testenv.RequireTool(t, "git", "git")
	e := newEnv(t)
	commit := e.commit(t, "edge-1", map[string]string{"clusters/edge-1.yaml": clusterYAML("edge-1", "2", "debian12")})

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := lis.Addr().(*net.TCPAddr).Port
	require.NoError(t, lis.Close())
	base := filepath.Dir(e.dir)
	// Run git-daemon itself, not through the git wrapper, so that killing
	// cmd.Process stops the daemon.
	execPath, err := exec.Command(gitBin, "--exec-path").Output()
	require.NoError(t, err)
	daemon := filepath.Join(strings.TrimSpace(string(execPath)), "git-daemon")
	testenv.RequireFile(t, daemon, "apt-get install git")
	cmd := exec.Command(daemon, "--reuseaddr", "--export-all", "--listen=127.0.0.1", fmt.Sprintf("--port=%d", port), "--base-path="+base, base)
	// A file, not a pipe: the daemon's children may outlive it.
	logf, err := os.Create(filepath.Join(t.TempDir(), "git-daemon.log"))
	require.NoError(t, err)
	t.Cleanup(func() { logf.Close() })
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	require.Eventually(t, func() bool {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			c.Close()
		}
		return err == nil
	}, 10*time.Second, 50*time.Millisecond, "git daemon did not listen")

	url := fmt.Sprintf("git://127.0.0.1:%d/%s", port, filepath.Base(e.dir))
	_, err = e.res.Apply(e.ctx, []*controllerv1.Resource{{Kind: &controllerv1.Resource_GitSource{GitSource: &typesv1.GitSource{
		Metadata: &typesv1.ObjectMeta{Name: "remote"},
		Spec:     &typesv1.GitSourceSpec{Url: url, Branch: "main", Path: "clusters"},
	}}}}, false)
	require.NoError(t, err)
	out, err := e.ex.Sync(e.ctx, "remote")
	require.NoError(t, err)
	if out.Commit != commit || out.FetchError != "" || out.Refused != "" {
		t.Fatalf("Sync over %s = %+v, want commit %s applied", url, out, commit)
	}
	require.Equal(t, "cluster/edge-1 controlplane/edge-1-cp machinedeployment/edge-1-workers(x2,debian12)", e.objects(t))

	// A branch that does not exist is a fetch failure; the commit stays.
	_, err = e.res.Apply(e.ctx, []*controllerv1.Resource{{Kind: &controllerv1.Resource_GitSource{GitSource: &typesv1.GitSource{
		Metadata: &typesv1.ObjectMeta{Name: "remote"},
		Spec:     &typesv1.GitSourceSpec{Url: url, Branch: "nope", Path: "clusters"},
	}}}}, false)
	require.NoError(t, err)
	out, err = e.ex.Sync(e.ctx, "remote")
	require.NoError(t, err)
	require.NotEmpty(t, out.FetchError)
	st := e.status(t, "remote")
	require.Equal(t, commit, st.GetAppliedCommit())
	require.Contains(t, conditions.Get(st.GetConditions(), gitplan.Ready).GetMessage(), "stays applied")
}

// TestFileRoots: a file:// repository is read only under the directories
// the controller allows (--gitsource-file-root); an admin's GitSource
// cannot make the controller read another repository on its machine,
// through a symbolic link or "..", and the refusal says the same whether
// the path exists or not.
func TestFileRoots(t *testing.T) {
	allowed := t.TempDir()
	outside := t.TempDir()
	for _, d := range []string{filepath.Join(allowed, "fleet"), outside} {
		_, err := git.PlainInitWithOptions(d, &git.PlainInitOptions{
			InitOptions: git.InitOptions{DefaultBranch: plumbing.NewBranchReferenceName("main")},
		})
		require.NoError(t, err)
	}
	require.NoError(t, os.Symlink(outside, filepath.Join(allowed, "link")))
	g := gitsource.GoGit{FileRoots: []string{allowed}}
	refused := map[string]string{
		"outside":           outside,
		"a symlink out":     filepath.Join(allowed, "link"),
		"dot-dot":           filepath.Join(allowed, "fleet", "..", "..", filepath.Base(outside)),
		"missing outside":   "/nonexistent/repo",
		"the root's parent": filepath.Dir(allowed),
	}
	for name, p := range refused {
		_, _, err := g.Fetch(context.Background(), gitplan.Spec{URL: "file://" + p, Branch: "main"})
		require.True(t, errdefs.IsPermissionDenied(err), "%s (%s): %v", name, p, err)
		require.ErrorContains(t, err, "--gitsource-file-root", name)
	}
	// With no roots, file:// is refused.
	_, _, err := gitsource.GoGit{}.Fetch(context.Background(), gitplan.Spec{URL: "file://" + filepath.Join(allowed, "fleet"), Branch: "main"})
	require.True(t, errdefs.IsPermissionDenied(err), "no roots: %v", err)
	require.ErrorContains(t, err, "allowed now: none")
	// Under the root it is opened (an empty repository has no branch).
	_, _, err = g.Fetch(context.Background(), gitplan.Spec{URL: "file://" + filepath.Join(allowed, "fleet"), Branch: "main"})
	require.True(t, errdefs.IsNotFound(err), "under the root: %v", err)
}
