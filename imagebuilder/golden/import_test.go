package golden

import (
	"context"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/agent/kubeadm"
	"github.com/kilnhq/kiln/agent/preflight"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/testenv"
)

var update = flag.Bool("update", false, "rewrite testdata/ with the generated unit and script")

// TestImportUnitGolden keeps the first-boot import's unit and script as
// reviewed files: a change shows as a diff of testdata/ (regenerate with
// -update).
func TestImportUnitGolden(t *testing.T) {
	for file, got := range map[string]string{
		"testdata/" + ImportUnit:    ImportUnitFile(),
		"testdata/import-images.sh": ImportScript(),
	} {
		if *update {
			require.NoError(t, os.MkdirAll("testdata", 0o755))
			require.NoError(t, os.WriteFile(file, []byte(got), 0o644))
			continue
		}
		want, err := os.ReadFile(file)
		require.NoError(t, err, "run go test -run TestImportUnitGolden -update")
		if got != string(want) {
			t.Errorf("%s differs from the generated one (go test -run TestImportUnitGolden -update, then review the diff):\n%s", file, got)
		}
	}
	// The unit retries for ever and the agent's check reads what it writes.
	unit := ImportUnitFile()
	for _, w := range []string{"Restart=on-failure", "StartLimitIntervalSec=0", "Wants=containerd.service", "ConditionPathExists=!" + ImportMarker} {
		if !strings.Contains(unit, w+"\n") {
			t.Errorf("ImportUnitFile() has no %q", w)
		}
	}
	if strings.Contains(unit, "Requires=") {
		t.Errorf("ImportUnitFile() requires a unit: a failed or restarted containerd would leave the import inactive instead of retried")
	}
	require.Equal(t, "/"+preflight.OfflineImagesDir+"/"+preflight.OfflineImagesMarker, ImportMarker)
	require.Equal(t, "/"+preflight.OfflineImagesDir+"/"+preflight.OfflineImagesLog, ImportLog)
	require.Equal(t, preflight.OfflineImagesUnit, ImportUnit)
}

// TestImportUnitVerifies: systemd accepts the unit as written (Restart= of
// a oneshot is refused unless on-failure; an unknown key of a newer
// systemd is only ignored, with a warning, so none is allowed).
func TestImportUnitVerifies(t *testing.T) {
	analyze := testenv.RequireTool(t, "systemd-analyze", "systemd")
	dir := t.TempDir()
	script := filepath.Join(dir, "import-images")
	require.NoError(t, os.WriteFile(script, []byte(ImportScript()), 0o755))
	unit := filepath.Join(dir, ImportUnit)
	require.NoError(t, os.WriteFile(unit, []byte(strings.ReplaceAll(ImportUnitFile(), ImportScriptPath, script)), 0o644))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, analyze, "verify", unit).CombinedOutput()
	if err != nil || len(out) > 0 {
		t.Errorf("systemd-analyze verify %s = %v:\n%s", ImportUnit, err, out)
	}
}

// TestImportScript runs the import script as its unit does, under a
// temporary root, with a ctr on PATH that records what it imports and
// fails as told: the marker only after every archive, the failing
// archive's error in the log the agent's check quotes, and a retry that
// waits, imports every archive again and succeeds.
func TestImportScript(t *testing.T) {
	for _, tool := range []string{"sh", "timeout", "tail"} {
		testenv.RequireTool(t, tool, "coreutils dash")
	}
	root := t.TempDir()
	images := filepath.Join(root, ImagesDir)
	require.NoError(t, os.MkdirAll(images, 0o755))
	for _, a := range []string{"etcd.tar", "kube-apiserver.tar", "pause.tar"} {
		require.NoError(t, os.WriteFile(filepath.Join(images, a), []byte("x"), 0o644))
	}
	script := filepath.Join(t.TempDir(), "import-images")
	require.NoError(t, os.WriteFile(script, []byte(ImportScript()), 0o755))
	bin := t.TempDir()
	calls := filepath.Join(bin, "calls")
	// ctr fails for the archive named in $FAIL, sleeps for the one in $HANG.
	require.NoError(t, os.WriteFile(filepath.Join(bin, "ctr"), []byte(`#!/bin/sh
echo "$*" >>`+calls+`
case "$5" in
*"${FAIL:-none}") echo "unpacking layers"; echo 'ctr: failed to ingest "blobs/sha256/9f1c": unexpected EOF' >&2; exit 1 ;;
*"${HANG:-none}") sleep 30 ;;
esac
echo "imported $5"
`), 0o755))

	run := func(env ...string) (string, error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, script)
		cmd.Env = append([]string{"PATH=" + bin + ":" + os.Getenv("PATH"), "KILN_ROOT=" + root, "KILN_IMPORT_BACKOFF=0"}, env...)
		out, err := cmd.CombinedOutput()
		t.Logf("%s %v:\n%s", script, env, out)
		return string(out), err
	}
	logLines := func() []string {
		b, _ := os.ReadFile(filepath.Join(root, ImportLog))
		return strings.Split(strings.TrimSpace(string(b)), "\n")
	}
	marker := filepath.Join(root, ImportMarker)

	// Attempt 1: kube-apiserver.tar is corrupt.
	_, err := run("FAIL=kube-apiserver.tar")
	require.Error(t, err, "a failed import must fail the unit (Restart=on-failure)")
	require.NoFileExists(t, marker)
	lines := logLines()
	last := lines[len(lines)-1]
	require.Contains(t, last, "failed: importing kube-apiserver.tar: ctr exited 1")
	require.Contains(t, strings.Join(lines, "\n"), `ctr: failed to ingest "blobs/sha256/9f1c": unexpected EOF`)
	require.Contains(t, strings.Join(lines, "\n"), "importing 2/3 kube-apiserver.tar")

	// Attempt 2: one archive hangs past the per-archive limit.
	_, err = run("HANG=etcd.tar", "KILN_IMPORT_TIMEOUT=1s")
	require.Error(t, err)
	lines = logLines()
	require.Contains(t, strings.Join(lines, "\n"), "attempt 2: retrying in 0s")
	require.Contains(t, lines[len(lines)-1], "failed: importing etcd.tar did not finish within 1s")
	require.NoFileExists(t, marker)

	// Attempt 3 (systemd restarted it): every archive, then the marker.
	_, err = run()
	require.NoError(t, err)
	require.FileExists(t, marker)
	lines = logLines()
	require.Contains(t, lines[len(lines)-1], "imported 3 archives")
	require.Contains(t, strings.Join(lines, "\n"), "attempt 3: importing 3 archives")
	require.NoFileExists(t, filepath.Join(root, ImportAttempts), "a success resets the retries' backoff")
	b, err := os.ReadFile(calls)
	require.NoError(t, err)
	require.Contains(t, string(b), "-n k8s.io images import "+filepath.Join(images, "pause.tar"))
}

// TestImportBackoff: each retry of the same boot waits twice as long as
// the one before, up to five minutes.
func TestImportBackoff(t *testing.T) {
	testenv.RequireTool(t, "sh", "dash")
	root := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(root, ImagesDir), 0o755))
	script := filepath.Join(t.TempDir(), "import-images")
	// The script as written, with sleep made a no-op that logs.
	require.NoError(t, os.WriteFile(script, []byte(ImportScript()), 0o755))
	bin := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(bin, "sleep"), []byte("#!/bin/sh\n"), 0o755))
	for _, tt := range []struct {
		attempt int
		want    string
	}{
		{1, "no image archives"},
		{2, "attempt 2: retrying in 10s"},
		{3, "attempt 3: retrying in 20s"},
		{5, "attempt 5: retrying in 80s"},
		{7, "attempt 7: retrying in 300s"},
		{30, "attempt 30: retrying in 300s"},
	} {
		attempts := filepath.Join(root, ImportAttempts)
		require.NoError(t, os.MkdirAll(filepath.Dir(attempts), 0o755))
		require.NoError(t, os.WriteFile(attempts, []byte(strconv.Itoa(tt.attempt-1)+"\n"), 0o644))
		cmd := exec.Command(script)
		cmd.Env = []string{"PATH=" + bin + ":" + os.Getenv("PATH"), "KILN_ROOT=" + root}
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", out)
		if !strings.Contains(string(out), tt.want) {
			t.Errorf("import-images at attempt %d = %q, want %q", tt.attempt, out, tt.want)
		}
		require.NoError(t, os.Remove(filepath.Join(root, ImportMarker)))
	}
}

// TestLabVMProbePatches: the real kubeadm of the kube-tools cache applies
// a lab VM image's patches to the static pods it writes (kubeadm init
// phase control-plane / etcd, chrooted into a temporary root), so a slow
// control plane gets the patient probes. Needs root (kubeadm --rootfs
// chroots) and `make kube-tools`.
func TestLabVMProbePatches(t *testing.T) {
	s := mustSpec(t, "kubernetesVersion: v1.34.4\nagent: x\nlabVM: true\n")
	got := map[string]rootfs.File{}
	for _, f := range files(s, "/bin/agent", &kubeFiles{pause: "registry.k8s.io/pause:3.10.1"}, "") {
		got[f.Path] = f
	}
	for _, target := range LabProbeTargets {
		require.Contains(t, got, LabProbePatchFile(target))
	}
	require.Equal(t, "/etc/systemd/system/"+LabConsoleUnit, got["/etc/systemd/system/multi-user.target.wants/"+LabConsoleUnit].Symlink)
	require.Equal(t, os.FileMode(0o755), got[LabConsoleScript].Mode)
	cmd := exec.Command("sh", "-n")
	cmd.Stdin = strings.NewReader(LabConsoleScriptFile)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "sh -n %s: %s", LabConsoleScript, out)
	for _, f := range files(mustSpec(t, "kubernetesVersion: v1.34.4\nagent: x\n"), "/bin/agent", &kubeFiles{pause: "p"}, "") {
		if strings.HasPrefix(f.Path, kubeadm.PatchesDir) || strings.Contains(f.Path, LabConsoleUnit) {
			t.Errorf("an image without labVM has %s", f.Path)
		}
	}

	testenv.RequireRoot(t, "to chroot kubeadm into a temporary root (--rootfs)")
	r := kubetools.Pinned()
	kubeadmBin := filepath.Join(kubetools.Cache{Dir: filepath.Join(rootfs.CacheRoot(), "kube-tools")}.BinDir(r), "kubeadm")
	testenv.RequireFile(t, kubeadmBin, "run make kube-tools")
	root := t.TempDir()
	for _, target := range LabProbeTargets {
		p := filepath.Join(root, LabProbePatchFile(target))
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, got[LabProbePatchFile(target)].Data, 0o644))
	}
	require.NoError(t, os.WriteFile(filepath.Join(root, "init.yaml"), []byte(`apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
patches:
  directory: `+kubeadm.PatchesDir+`
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: `+r.Kubernetes+`
`), 0o644))
	for _, phase := range [][]string{{"control-plane", "all"}, {"etcd", "local"}} {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		out, err := exec.CommandContext(ctx, kubeadmBin, append(append([]string{"init", "phase"}, phase...), "--config", "/init.yaml", "--rootfs", root)...).CombinedOutput()
		cancel()
		require.NoError(t, err, "kubeadm init phase %v: %s", phase, out)
	}
	for _, target := range LabProbeTargets {
		b, err := os.ReadFile(filepath.Join(root, "etc/kubernetes/manifests", target+".yaml"))
		require.NoError(t, err)
		var pod struct {
			Spec struct {
				Containers []struct {
					Name          string
					StartupProbe  struct{ TimeoutSeconds, FailureThreshold, PeriodSeconds int } `json:"startupProbe"`
					LivenessProbe struct{ TimeoutSeconds, FailureThreshold, PeriodSeconds int } `json:"livenessProbe"`
				}
			}
		}
		require.NoError(t, yaml.Unmarshal(b, &pod))
		require.Len(t, pod.Spec.Containers, 1)
		c := pod.Spec.Containers[0]
		if c.StartupProbe.TimeoutSeconds != 60 || c.StartupProbe.FailureThreshold != 120 || c.LivenessProbe.FailureThreshold != 30 || c.LivenessProbe.TimeoutSeconds != 60 {
			t.Errorf("kubeadm's %s manifest with the lab VM patch: startupProbe %+v, livenessProbe %+v, want timeouts 60 s, failure thresholds 120 and 30", target, c.StartupProbe, c.LivenessProbe)
		}
		if c.StartupProbe.PeriodSeconds != 10 {
			t.Errorf("%s startupProbe period %d, want kubeadm's 10 kept", target, c.StartupProbe.PeriodSeconds)
		}
	}
}
