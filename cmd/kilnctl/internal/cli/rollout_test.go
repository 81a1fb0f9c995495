package cli

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/controllertest"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

const rolloutYAML = `apiVersion: kiln.dev/v1
kind: Rollout
metadata:
  name: img2
spec:
  change:
    image: debian12-k8s1.34.4-20261206
  clusterSelector:
    env: prod
  bake: 10m
  halt:
    readyTimeout: 20m
    onRemediation: true
`

// TestRolloutCommands applies a Rollout, gives it the status the rollout
// executor writes (a controller without the lifecycle runs no executor)
// and checks what kilnctl shows: get rollouts wave by wave (done, baking
// with the time left, waiting; halted with the reason), describe's
// waves and clusters, and that rollout pause, resume and abort set the
// spec and keep the status.
func TestRolloutCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t)
	admin := env.AdminConfigPath
	file := filepath.Join(t.TempDir(), "rollout.yaml")
	require.NoError(t, os.WriteFile(file, []byte(rolloutYAML), 0o644))
	require.Equal(t, "rollout/img2 created\n", mustKilnctl(t, admin, "apply", "-f", file))

	st := env.Controller.Store()
	ctx := context.Background()
	setStatus := func(s *typesv1.RolloutStatus) {
		t.Helper()
		r := &typesv1.Rollout{}
		rev, err := st.Get(ctx, "rollouts", "img2", r)
		require.NoError(t, err)
		r.Status = s
		_, err = st.Update(ctx, "rollouts", "img2", r, rev)
		require.NoError(t, err)
	}
	ts := func(ago time.Duration) *timestamppb.Timestamp { return timestamppb.New(testNow.Add(-ago)) }
	clusters := []*typesv1.RolloutCluster{
		{Name: "core", Wave: "1", State: "Done", StartTime: ts(20 * time.Minute), DoneTime: ts(14 * time.Minute), From: "debian12-k8s1.34.4-20261201"},
		{Name: "store", Wave: "2", State: "Done", StartTime: ts(8 * time.Minute), DoneTime: ts(4 * time.Minute), From: "debian12-k8s1.34.4-20261201"},
	}
	setStatus(&typesv1.RolloutStatus{Phase: "Baking", Clusters: clusters, Waves: []*typesv1.RolloutWave{
		{Value: "1", State: "Done", Clusters: []string{"core"}, Done: []string{"core"}, DoneTime: ts(14 * time.Minute)},
		{Value: "2", State: "Baking", Clusters: []string{"store"}, Done: []string{"store"}, DoneTime: ts(4 * time.Minute)},
		{Value: "3", State: "Waiting", Clusters: []string{"edge-a", "edge-b"}},
	}, Conditions: []*typesv1.Condition{{Type: "Progressing", Status: "True", Reason: "Baking", LastTransitionTime: ts(4 * time.Minute)}}})

	out := mustKilnctl(t, admin, "get", "rollouts")
	require.Contains(t, out, "NAME   PHASE    CHANGE")
	require.Contains(t, out, "img2   Baking   image debian12-k8s1.34.4-20261206   1:Done 2:Baking(6m0s left) 3:Waiting")

	out = mustKilnctl(t, admin, "describe", "rollout", "img2")
	t.Logf("kilnctl describe rollout img2:\n%s", out)
	for _, want := range []string{
		"Waves:",
		"1     Done     core   -       -",
		"2     Baking   store  -       -              baking: 6m0s left of 10m",
		"3     Waiting  -      -       edge-a,edge-b  -",
		"Clusters:",
		"store    2     Done   debian12-k8s1.34.4-20261201  8m ago",
	} {
		require.Contains(t, squeeze(out), squeeze(want), "kilnctl describe rollout img2:\n%s", out)
	}

	// Halted: the REASON column says why, -o wide with the message.
	why := "wave 3: cluster edge-a not done 20m0s after it started (halt.readyTimeout 20m0s): control plane edge-a-cp: 0 of 1 updated"
	clusters = append(clusters, &typesv1.RolloutCluster{Name: "edge-a", Wave: "3", State: "InProgress", StartTime: ts(21 * time.Minute), Message: "control plane edge-a-cp: 0 of 1 updated"})
	setStatus(&typesv1.RolloutStatus{Phase: "Halted", HaltedWave: "3", Clusters: clusters, Waves: []*typesv1.RolloutWave{
		{Value: "1", State: "Done", Clusters: []string{"core"}, Done: []string{"core"}},
		{Value: "2", State: "Done", Clusters: []string{"store"}, Done: []string{"store"}},
		{Value: "3", State: "Halted", Clusters: []string{"edge-a", "edge-b"}, InProgress: []string{"edge-a"}, Message: why},
	}, Conditions: []*typesv1.Condition{{Type: "Progressing", Status: "False", Reason: "ReadyTimeout", Message: why, Severity: "Warning", LastTransitionTime: ts(time.Minute)}}})
	out = mustKilnctl(t, admin, "get", "rollouts")
	require.Contains(t, squeeze(out), "img2 Halted image debian12-k8s1.34.4-20261206 1:Done 2:Done 3:Halted(0/2) ReadyTimeout")
	out = mustKilnctl(t, admin, "get", "rollouts", "-o", "wide")
	t.Logf("kilnctl get rollouts -o wide:\n%s", out)
	require.Contains(t, out, "ReadyTimeout: wave 3: cluster edge-a not done")

	get := func() *typesv1.Rollout {
		r := &typesv1.Rollout{}
		_, err := st.Get(ctx, "rollouts", "img2", r)
		require.NoError(t, err)
		return r
	}
	require.Equal(t, "rollout/img2 paused\n", mustKilnctl(t, admin, "rollout", "pause", "img2"))
	require.True(t, get().GetSpec().GetPaused())
	require.Equal(t, "rollout/img2 unchanged (already paused)\n", mustKilnctl(t, admin, "rollout", "pause", "img2"))
	require.Equal(t, "rollout/img2 resumed\n", mustKilnctl(t, admin, "rollout", "resume", "img2"))
	r := get()
	require.False(t, r.GetSpec().GetPaused())
	require.EqualValues(t, 1, r.GetSpec().GetResume())
	require.Equal(t, "Halted", r.GetStatus().GetPhase(), "the status is the controller's: apply keeps it")
	require.Equal(t, "rollout/img2 aborted\n", mustKilnctl(t, admin, "rollout", "abort", "img2"))
	require.True(t, get().GetSpec().GetAborted())

	_, err := kilnctl(t, admin, "rollout", "pause", "nope")
	require.ErrorContains(t, err, "rollout pause nope")

	// The change is fixed once the Rollout exists.
	require.NoError(t, os.WriteFile(file, []byte(strings.Replace(rolloutYAML, "20261206", "20261207", 1)), 0o644))
	_, err = kilnctl(t, admin, "apply", "-f", file)
	require.ErrorContains(t, err, "a Rollout's change is fixed once it exists")
}

// squeeze collapses runs of spaces, so that checks do not depend on
// column widths.
func squeeze(s string) string { return strings.Join(strings.Fields(s), " ") }
