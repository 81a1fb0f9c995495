package fleet

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// stuckLab is the lab of issue 11: the cluster waits for a Machine whose
// image does not exist, its host Available.
func stuckLab() *Snapshot {
	cond := func(t, status, reason, msg string) *typesv1.Condition {
		return conditions.New(t, status, reason, msg)
	}
	return &Snapshot{
		Hosts: map[string]*typesv1.Host{
			"kiln-h1": {Metadata: &typesv1.ObjectMeta{Name: "kiln-h1"}, Status: &typesv1.HostStatus{
				State: typesv1.HostState_HOST_STATE_AVAILABLE, Machine: "lab-cp-kiln-h1",
				Conditions: []*typesv1.Condition{cond("BMCReachable", conditions.True, "Answered", "bmc answers")},
			}},
			"kiln-h2": {Metadata: &typesv1.ObjectMeta{Name: "kiln-h2"}, Status: &typesv1.HostStatus{
				State: typesv1.HostState_HOST_STATE_REGISTERING, ProvisioningStep: "CheckBMC", LastError: "power state: 401 Unauthorized",
				Conditions: []*typesv1.Condition{cond("BMCReachable", conditions.False, "AuthenticationFailed", "the BMC refused the stored credentials")},
			}},
		},
		Machines: map[string]*typesv1.Machine{
			"lab-cp-kiln-h1": {Metadata: &typesv1.ObjectMeta{Name: "lab-cp-kiln-h1"},
				Spec: &typesv1.MachineSpec{Role: "control-plane", Host: "kiln-h1"},
				Status: &typesv1.MachineStatus{Phase: "Pending", Conditions: []*typesv1.Condition{
					cond("ImageResolved", conditions.False, "ImageNotFound", "image debian12-k8s1.34.4-20261202 not found; kilnctl get images lists 1: debian12-k8s1.34.4-20261203"),
				}}},
		},
		Cluster: &typesv1.Cluster{Metadata: &typesv1.ObjectMeta{Name: "lab"}, Status: &typesv1.ClusterStatus{
			Phase: "Provisioning",
			Conditions: []*typesv1.Condition{
				cond("Ready", conditions.False, "WaitingForControlPlane", "waiting for lab-cp-kiln-h1 on host kiln-h1 to become Ready"),
			},
		}},
	}
}

func TestSnapshotLinesShowWhyObjectsAreBlocked(t *testing.T) {
	got := strings.Join(stuckLab().Lines(), "\n")
	for _, want := range []string{
		"  machine lab-cp-kiln-h1: ImageResolved=False ImageNotFound: image debian12-k8s1.34.4-20261202 not found; kilnctl get images lists 1: debian12-k8s1.34.4-20261203",
		"  host kiln-h2: BMCReachable=False AuthenticationFailed: the BMC refused the stored credentials",
		"last error: power state: 401 Unauthorized",
		"cluster lab Provisioning: Ready=False waiting for lab-cp-kiln-h1",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("Lines() = \n%s\nwant a line with %q", got, want)
		}
	}
	if strings.Contains(got, "BMCReachable=True") || strings.Contains(got, "cluster lab: Ready=False") {
		t.Errorf("Lines() = \n%s\nwant only False conditions, and the cluster's Ready once", got)
	}
}

// A host laying its image gets a line per stored progress report, so
// make lab prints the lay's progress per host.
func TestSnapshotLinesShowLayProgress(t *testing.T) {
	at := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	laying := func(done uint64, eta float64) *Snapshot {
		return &Snapshot{Hosts: map[string]*typesv1.Host{"kiln-h1": {Metadata: &typesv1.ObjectMeta{Name: "kiln-h1"}, Status: &typesv1.HostStatus{
			State: typesv1.HostState_HOST_STATE_PROVISIONING, ProvisioningStep: "LayImage",
			LastOperation: &typesv1.OperationStatus{Id: "kiln-h1-LayImage-0", Kind: "LayImage", State: "Running",
				Progress: &typesv1.OperationProgress{Step: "fetch", DoneBytes: done, TotalBytes: 4 << 30, Percent: 100 * float64(done) / float64(4<<30),
					BytesPerSecond: 100 << 20, EtaSeconds: eta, Updated: timestamppb.New(at)}},
		}}}}
	}
	first, later := laying(1<<30, 30.72), laying(3<<30, 10.24)
	want := "host kiln-h1    PROVISIONING   LayImage fetch: 1.0 GiB of 4.0 GiB (25%), 100.0 MiB/s, ETA 31s"
	if got := first.Lines(); len(got) != 1 || got[0] != want {
		t.Errorf("Lines() = %q, want [%q]", got, want)
	}
	if a, b := first.Lines()[0], later.Lines()[0]; a == b || !strings.Contains(b, "3.0 GiB of 4.0 GiB (75%)") {
		t.Errorf("Lines() after more bytes = %q (before %q), want a new line at 75%%", b, a)
	}
	done := laying(4<<30, 0)
	done.Hosts["kiln-h1"].Status.LastOperation.State = "Succeeded"
	if got := done.Lines()[0]; strings.Contains(got, "fetch") {
		t.Errorf("Lines() of a finished lay = %q, want no progress", got)
	}
}

func TestSnapshotBlocked(t *testing.T) {
	got := strings.Join(stuckLab().Blocked(), "\n")
	for _, want := range []string{
		"host kiln-h2 Registering CheckBMC last error: power state: 401 Unauthorized",
		"machine lab-cp-kiln-h1 Pending host=kiln-h1",
		"ImageResolved=False ImageNotFound",
		"cluster lab: Ready=False WaitingForControlPlane: waiting for lab-cp-kiln-h1",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("Blocked() = \n%s\nwant a line with %q", got, want)
		}
	}
	if strings.Contains(got, "host kiln-h1 Available") || strings.Contains(got, "host kiln-h1: ") {
		t.Errorf("Blocked() = \n%s\nwant the Available host kiln-h1 left out", got)
	}
}

func TestStallDetector(t *testing.T) {
	t0 := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	stuck := stuckLab()
	moved := stuckLab()
	moved.Hosts["kiln-h1"].Status.LastOperation = &typesv1.OperationStatus{Id: "lay-1", State: "Running", Percent: 42}
	steps := []struct {
		at       time.Duration
		s        *Snapshot
		want     bool
		wantIdle time.Duration
	}{
		{0, stuck, false, 0},
		{4 * time.Minute, stuck, false, 4 * time.Minute},
		{4*time.Minute + 30*time.Second, moved, false, 0}, // a lay's progress counts as a change
		{9 * time.Minute, moved, false, 4*time.Minute + 30*time.Second},
		{9*time.Minute + 30*time.Second, moved, true, 5 * time.Minute},
	}
	d := StallDetector{Timeout: 5 * time.Minute}
	for _, s := range steps {
		got, idle := d.Observe(s.s, t0.Add(s.at))
		if got != s.want || idle != s.wantIdle {
			t.Errorf("Observe(t0+%v) = %v, %v; want %v, %v", s.at, got, idle, s.want, s.wantIdle)
		}
	}
	never := StallDetector{}
	never.Observe(stuck, t0)
	if got, _ := never.Observe(stuck, t0.Add(time.Hour)); got {
		t.Errorf("Observe with Timeout 0 = stalled, want never")
	}
}

// fakeWatcher drives a Watcher with snapshots from next and a clock that
// each Wait moves by step; it records what the watcher printed.
func fakeWatcher(next func(i int) *Snapshot, step, stall time.Duration, out *strings.Builder) *Watcher {
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	i := 0
	return &Watcher{
		Snapshot: func(context.Context) (*Snapshot, error) { s := next(i); i++; return s, nil },
		Now:      func() time.Time { return now },
		Wait:     func(ctx context.Context) error { now = now.Add(step); return ctx.Err() },
		Say:      func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) },
		Stall:    stall,
	}
}

func TestWatcherStopsWhenNothingChanges(t *testing.T) {
	var out strings.Builder
	w := fakeWatcher(func(int) *Snapshot { return stuckLab() }, 30*time.Second, 5*time.Minute, &out)
	_, err := w.Run(context.Background(), (*Snapshot).Ready)
	var stalled *StalledError
	if !errors.As(err, &stalled) {
		t.Fatalf("Run() = %v, want a *StalledError", err)
	}
	if stalled.Idle != 5*time.Minute {
		t.Errorf("StalledError.Idle = %v, want 5m0s", stalled.Idle)
	}
	if msg := err.Error(); !strings.Contains(msg, "nothing changed for 5m0s") || !strings.Contains(msg, "ImageResolved=False ImageNotFound: image debian12-k8s1.34.4-20261202 not found") {
		t.Errorf("Run() error = %q, want the idle time and the blocked machine's condition", msg)
	}
	printed := out.String()
	if n := strings.Count(printed, "ImageResolved=False"); n != 1 {
		t.Errorf("progress printed the condition %d times, want once:\n%s", n, printed)
	}
	if !strings.Contains(printed, "[   0s]   machine lab-cp-kiln-h1: ImageResolved=False ImageNotFound") {
		t.Errorf("progress = \n%s\nwant the blocked machine's condition at 0s", printed)
	}
}

func TestWatcherPrintsChangesAndFinishes(t *testing.T) {
	var out strings.Builder
	snaps := func(i int) *Snapshot {
		s := stuckLab()
		m := s.Machines["lab-cp-kiln-h1"]
		switch {
		case i >= 20: // after 10 minutes of steady progress
			m.Status.Conditions = nil
			s.Cluster.Status.Conditions = []*typesv1.Condition{conditions.New("Ready", conditions.True, "AsExpected", "1 of 1 control-plane machines Ready")}
		case i >= 2:
			m.Status.Conditions = nil
			m.Status.Phase = "Provisioning"
			s.Hosts["kiln-h1"].Status.LastOperation = &typesv1.OperationStatus{Id: "lay", State: "Running", Percent: float64(i)}
		}
		return s
	}
	w := fakeWatcher(snaps, 30*time.Second, 5*time.Minute, &out)
	s, err := w.Run(context.Background(), (*Snapshot).Ready)
	if err != nil || !s.Ready() {
		t.Fatalf("Run() = %v, ready %v; want the Ready snapshot (progress counts as change)\n%s", err, s.Ready(), out.String())
	}
	if !strings.Contains(out.String(), "[  60s] machine lab-cp-kiln-h1") {
		t.Errorf("progress = \n%s\nwant the machine's new phase at 60s", out.String())
	}
}

func TestWatcherGivesUpWithBlockedObjects(t *testing.T) {
	var out strings.Builder
	ctx, cancel := context.WithCancel(context.Background())
	w := fakeWatcher(func(i int) *Snapshot {
		if i == 3 {
			cancel()
		}
		return stuckLab()
	}, time.Second, 0, &out)
	_, err := w.Run(ctx, (*Snapshot).Ready)
	if err == nil || !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "BMCReachable=False AuthenticationFailed") {
		t.Errorf("Run() after the context ends = %v, want context.Canceled with the blocked host's condition", err)
	}
}
