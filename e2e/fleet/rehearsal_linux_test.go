package fleet_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/controller/rolloutplan"
	"github.com/kilnhq/kiln/e2e/fleet"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// rehearsed is the cluster of TestLabBackupRestoreRehearsal.
const rehearsed = "dr"

// TestLabBackupRestoreRehearsal is the disaster-recovery rehearsal on a
// lab rack of three hosts, with the real controller, agents, BMC
// emulators and kubeadm: a Ready cluster (1 control plane + 1 worker,
// behind the lab's API load balancer) and a spare host; kilnctl backup;
// the controller killed with SIGKILL and its data directory deleted;
// while it is gone the workload cluster's API answers with the kubeconfig
// it had; kiln-controller restore into a new data directory; a new
// controller with the same flags. Checked, as a user would: the restore
// lays no host (image lay counters, machines and their UIDs unchanged),
// the agents reconnect with the certificates they had (same serials), the
// old kilnconfig and kubeconfig work, and a Rollout started afterwards (a
// new image: the control plane rolled 1→2→1 onto the spare, which joins
// etcd with what the restore brought back, then the worker reimaged in
// place) completes: its lays are counted apart from the restore's (one
// per replaced machine). The timeline is logged as a table (and written
// to $KILN_REHEARSAL_TIMELINE when set).
func TestLabBackupRestoreRehearsal(t *testing.T) {
	needLab(t)
	end := time.Now().Add(30 * time.Minute)
	if d, ok := t.Deadline(); ok && d.Add(-3*time.Minute).Before(end) {
		end = d.Add(-3 * time.Minute)
	}
	ctx, cancel := context.WithDeadline(context.Background(), end)
	defer cancel()
	lab, tag := startLab(t, ctx, func(c *fleet.Config) {
		c.Hosts, c.IPMI = 3, 0
		c.HeartbeatInterval = 2 * time.Second
	})
	r := &rehearsal{t: t, ctx: ctx, lab: lab, tag: tag, dir: t.TempDir(), start: time.Now()}
	cp, worker, spare := lab.HostResource(1), lab.HostResource(2), lab.HostResource(3)
	hosts := []string{cp, worker, spare}
	// The spare waits out of every pool; it joins the control plane's
	// for the rollout after the restore.
	pools := map[string]string{cp: rehearsed + "-cp", worker: rehearsed + "-workers", spare: rehearsed + "-spare"}
	r.registerPools(pools)

	r.apply(r.clusterYAML())
	r.wait("cluster "+rehearsed+" Ready with 2 machines, spare host Available", func(s *fleet.Snapshot) bool {
		return s.Ready() && running(s, 2) && s.Hosts[spare].GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE
	})
	r.mark("cluster %s Ready: control plane on %s, worker on %s; %s Available", rehearsed, cp, worker, spare)
	kubeconfig := filepath.Join(r.dir, "kubeconfig")
	_, err := lab.Kilnctl(ctx, nil, "kubeconfig", rehearsed, "-o", kubeconfig)
	require.NoError(t, err)
	require.Equal(t, "2", r.nodeCount(kubeconfig), "kubectl get nodes before the backup")
	before, err := lab.Snapshot(ctx, rehearsed)
	require.NoError(t, err)
	for _, h := range []string{cp, worker} {
		st := before.Hosts[h].GetStatus()
		require.EqualValues(t, 1, st.GetImageLays(), "host %s: image lays before the backup", h)
		require.NotEmpty(t, st.GetAgent().GetCertificateSerial(), "host %s: agent certificate serial", h)
	}
	require.EqualValues(t, 0, before.Hosts[spare].GetStatus().GetImageLays(), "spare host %s: image lays before the backup", spare)

	// The operator's files, kept away from the controller.
	oldKilnconfig := filepath.Join(r.dir, "kilnconfig-admin.yaml")
	b, err := os.ReadFile(lab.Kilnconfig())
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(oldKilnconfig, b, 0o600))
	key := filepath.Join(r.dir, "backup.key")
	recipient, err := lab.Kilnctl(ctx, nil, "backup", "keygen", "-o", key)
	require.NoError(t, err)
	file := filepath.Join(r.dir, "kiln.kbak")
	t0 := time.Now()
	out, err := lab.Kilnctl(ctx, nil, "backup", "-o", file, "--recipient", strings.TrimSpace(recipient))
	require.NoError(t, err)
	backupTook := time.Since(t0)
	r.mark("kilnctl backup (%s): %s", backupTook.Round(time.Millisecond), strings.TrimSpace(out))

	// The disaster: the controller and its data directory are gone.
	old := lab.DataDir()
	require.NoError(t, lab.KillController())
	require.NoError(t, os.RemoveAll(old))
	r.mark("controller killed (SIGKILL) and %s deleted", old)
	_, err = r.kilnctl(oldKilnconfig, "get", "hosts")
	require.Error(t, err, "kilnctl get hosts with no controller")
	require.Equal(t, "2", r.nodeCount(kubeconfig), "kubectl get nodes (old kubeconfig) with the controller gone")
	r.mark("controller gone (kilnctl get hosts fails); the workload API answers with the old kubeconfig: 2 nodes")

	// The restore, into a new data directory, then the same flags.
	restored := filepath.Join(r.dir, "controller-restored")
	t0 = time.Now()
	restore := exec.CommandContext(ctx, filepath.Join(r.bin(), "kiln-controller"), "restore", "--from", file, "--identity", key, "--data-dir", restored)
	var rerr bytes.Buffer
	restore.Stderr = &rerr
	ro, err := restore.Output()
	require.NoError(t, err, "kiln-controller restore: %s%s", ro, rerr.String())
	restoreTook := time.Since(t0)
	r.mark("kiln-controller restore (%s): %s", restoreTook.Round(time.Millisecond), strings.TrimSpace(string(ro)))
	lab.UseDataDir(restored)
	logOffset := fileSize(lab.ControllerLog())
	started := time.Now()
	require.NoError(t, lab.StartController(ctx))
	apiIn := time.Since(started)
	r.mark("new controller on %s: API answers after %s", restored, apiIn.Round(time.Millisecond))
	var reconcileIn time.Duration
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(lab.ControllerLog())
		if err != nil || int64(len(b)) < logOffset {
			return false
		}
		if bytes.Contains(b[logOffset:], []byte("leading: reconcilers started")) {
			reconcileIn = time.Since(started)
			return true
		}
		return false
	}, 2*time.Minute, 100*time.Millisecond, "new controller: reconcilers started")
	r.mark("new controller leads: reconcilers started after %s", reconcileIn.Round(time.Millisecond))
	var agentsIn time.Duration
	r.wait("agents heartbeat to the new controller", func(s *fleet.Snapshot) bool {
		for _, h := range []string{cp, worker} {
			st := s.Hosts[h].GetStatus()
			if !st.GetAgent().GetLastHeartbeat().AsTime().After(started) || !conditions.IsTrue(st.GetConditions(), "AgentReachable") {
				return false
			}
		}
		agentsIn = time.Since(started)
		return true
	})
	r.mark("both agents heartbeat to the new controller after %s", agentsIn.Round(time.Millisecond))

	after, err := lab.Snapshot(ctx, rehearsed)
	require.NoError(t, err)
	for _, h := range hosts {
		require.Equal(t, before.Hosts[h].GetStatus().GetImageLays(), after.Hosts[h].GetStatus().GetImageLays(), "host %s: image lays after the restore", h)
	}
	require.Equal(t, typesv1.HostState_HOST_STATE_AVAILABLE, after.Hosts[spare].GetStatus().GetState(), "spare host %s: state after the restore", spare)
	for _, h := range []string{cp, worker} {
		b, a := before.Hosts[h].GetStatus(), after.Hosts[h].GetStatus()
		require.Equal(t, typesv1.HostState_HOST_STATE_PROVISIONED, a.GetState(), "host %s: state after the restore", h)
		require.Equal(t, b.GetMachine(), a.GetMachine(), "host %s: machine after the restore", h)
		require.Equal(t, b.GetAgent().GetCertificateSerial(), a.GetAgent().GetCertificateSerial(), "host %s: agent certificate serial after the restore", h)
	}
	require.Equal(t, machineUIDs(before), machineUIDs(after), "machines after the restore")
	require.True(t, after.Ready(), "cluster %s Ready after the restore", rehearsed)
	out, err = r.kilnctl(oldKilnconfig, "get", "hosts")
	require.NoError(t, err, "kilnctl with the kilnconfig it had before the disaster")
	require.Equal(t, "2", r.nodeCount(kubeconfig), "kubectl get nodes (old kubeconfig) after the restore")
	r.mark("after the restore: image lays %s (none by the restore); certificate serials, machines and UIDs unchanged; old kilnconfig and kubeconfig work",
		lays(after, hosts))
	t.Logf("kilnctl get hosts (old kilnconfig, new controller):\n%s", out)

	// A Rollout started on the new controller completes: a new image
	// (the same bits under a new tag), the control plane first, rolled
	// 1→2→1 onto the spare the operator puts in its pool, then the
	// worker, reimaged in place.
	t0 = time.Now()
	pools[spare] = rehearsed + "-cp"
	r.registerPools(pools)
	tag2 := tag + "-r2"
	r.apply(sameBitsImage(t, ctx, lab, tag, tag2))
	r.apply([]byte(fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: Rollout
metadata:
  name: %[1]s-image
spec:
  change:
    image: %[2]s
  clusterSelector:
    rehearsal: %[1]s
  maxConcurrent: 1
  halt:
    readyTimeout: 15m
`, rehearsed, tag2)))
	r.mark("on the new controller: %s put in pool %s-cp (the spare), Image %s and Rollout %s-image applied", spare, rehearsed, tag2, rehearsed)
	var lastGet string
	// Milestones of the rollout, marked once each as they are seen.
	seen := map[string]bool{}
	milestone := func(what string, ok bool) {
		if ok && !seen[what] {
			seen[what] = true
			r.mark("%s (%s after the rollout was applied)", what, time.Since(t0).Round(time.Second))
		}
	}
	done := waitRollout(t, ctx, lab, rehearsed+"-image", "complete", &lastGet, r.mark, func(ro *typesv1.Rollout) bool {
		if s, err := lab.Snapshot(ctx, rehearsed); err == nil {
			for _, m := range s.Machines {
				up := m.GetSpec().GetImage() == tag2 && m.GetStatus().GetPhase() == clusterexec.PhaseRunning &&
					conditions.IsTrue(m.GetStatus().GetConditions(), clusterplan.MachineNodeReady)
				milestone(fmt.Sprintf("new %s machine %s Running, node Ready", m.GetSpec().GetRole(), m.GetMetadata().GetName()), up)
			}
			milestone(fmt.Sprintf("old control-plane machine gone, %s wiped and Available", cp), s.Hosts[cp].GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE)
		}
		return ro.GetStatus().GetPhase() == rolloutplan.PhaseComplete
	})
	rolloutTook := time.Since(t0)
	r.wait("old control-plane host wiped and Available", func(s *fleet.Snapshot) bool {
		return running(s, 2) && s.Ready() && s.Hosts[cp].GetStatus().GetState() == typesv1.HostState_HOST_STATE_AVAILABLE
	})
	final, err := lab.Snapshot(ctx, rehearsed)
	require.NoError(t, err)
	require.Len(t, done.GetStatus().GetClusters(), 1, "clusters the rollout moved")
	require.Equal(t, rehearsed, done.GetStatus().GetClusters()[0].GetName())
	oldUIDs := map[string]bool{}
	for _, m := range before.Machines {
		oldUIDs[m.GetMetadata().GetUid()] = true
	}
	for n, m := range final.Machines {
		require.Equal(t, tag2, m.GetSpec().GetImage(), "machine %s after the rollout", n)
		require.False(t, oldUIDs[m.GetMetadata().GetUid()], "machine %s after the rollout: a new machine replaces each old one", n)
	}
	require.Equal(t, spare, cpMachine(t, final).GetSpec().GetHost(), "control plane after the rollout: on the spare")
	require.Equal(t, worker, machineOnHost(final, worker).GetSpec().GetHost(), "worker after the rollout: reimaged in place")
	// The rollout's lays, apart from the restore's (none): one per
	// replaced machine, on the hosts the new machines run on.
	wantLays := map[string]int64{cp: 1, worker: 2, spare: 1}
	for _, h := range hosts {
		require.Equal(t, wantLays[h], final.Hosts[h].GetStatus().GetImageLays(), "host %s: image lays after the rollout (before the backup %d, after the restore %d)",
			h, before.Hosts[h].GetStatus().GetImageLays(), after.Hosts[h].GetStatus().GetImageLays())
	}
	require.Equal(t, "2", r.nodeCount(kubeconfig), "kubectl get nodes (old kubeconfig, through the API load balancer) after the rollout")
	rolloutLays := sumLays(final, hosts) - sumLays(after, hosts)
	r.mark("Rollout %s-image complete after %s: control plane on %s, worker reimaged on %s, both at %s; %s Available; image lays %s: %d by the rollout (one per replaced machine), 0 by the restore",
		rehearsed, rolloutTook.Round(time.Millisecond), spare, worker, tag2, cp, lays(final, hosts), rolloutLays)

	var tl strings.Builder
	tw := tabwriter.NewWriter(&tl, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STEP\tTOOK")
	fmt.Fprintf(tw, "kilnctl backup\t%s\n", backupTook.Round(time.Millisecond))
	fmt.Fprintf(tw, "kiln-controller restore (new data directory)\t%s\n", restoreTook.Round(time.Millisecond))
	fmt.Fprintf(tw, "new controller start -> API answers\t%s\n", apiIn.Round(time.Millisecond))
	fmt.Fprintf(tw, "new controller start -> reconcilers started (leading)\t%s\n", reconcileIn.Round(time.Millisecond))
	fmt.Fprintf(tw, "new controller start -> both agents heartbeat (same certificates)\t%s\n", agentsIn.Round(time.Millisecond))
	fmt.Fprintf(tw, "rollout started after the restore (spare in the pool, image, Rollout) -> Complete\t%s\n", rolloutTook.Round(time.Millisecond))
	tw.Flush()
	fmt.Fprintf(&tl, "image lays before the backup / after the restore / after the rollout:")
	for _, h := range hosts {
		fmt.Fprintf(&tl, " %s %d/%d/%d", h, before.Hosts[h].GetStatus().GetImageLays(), after.Hosts[h].GetStatus().GetImageLays(), final.Hosts[h].GetStatus().GetImageLays())
	}
	fmt.Fprintf(&tl, " (the restore laid none; the rollout %d)\n", rolloutLays)
	t.Logf("rehearsal timeline:\n%s\n%s", tl.String(), strings.Join(r.lines, "\n"))
	if p := os.Getenv("KILN_REHEARSAL_TIMELINE"); p != "" {
		require.NoError(t, os.WriteFile(p, []byte(tl.String()+"\n"+strings.Join(r.lines, "\n")+"\n"), 0o644))
	}
}

// rehearsal is the state of TestLabBackupRestoreRehearsal.
type rehearsal struct {
	t     *testing.T
	ctx   context.Context
	lab   *fleet.Lab
	tag   string
	dir   string
	start time.Time
	lines []string
}

func (r *rehearsal) mark(format string, args ...any) {
	now := time.Now()
	line := fmt.Sprintf("[%5ds %s] %s", int(now.Sub(r.start).Seconds()), now.UTC().Format(time.TimeOnly), fmt.Sprintf(format, args...))
	r.lines = append(r.lines, line)
	r.t.Log("timeline: " + line)
}

// bin is the directory of the lab's binaries.
func (r *rehearsal) bin() string {
	return filepath.Dir(r.lab.KilnctlPath())
}

// kilnctl runs kilnctl with the kilnconfig given.
func (r *rehearsal) kilnctl(kilnconfig string, args ...string) (string, error) {
	out, err := exec.CommandContext(r.ctx, r.lab.KilnctlPath(), append([]string{"--kilnconfig", kilnconfig}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kilnctl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func (r *rehearsal) apply(b []byte) {
	r.t.Helper()
	_, err := r.lab.Kilnctl(r.ctx, b, "apply", "-f", "-")
	require.NoError(r.t, err, "kilnctl apply:\n%s", b)
}

// registerPools registers the rack's hosts, each labelled with its pool.
func (r *rehearsal) registerPools(pools map[string]string) {
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
		pool, ok := pools[meta["name"].(string)]
		require.True(r.t, ok, "unexpected lab host %v", meta["name"])
		labels["pool"] = pool
		meta["labels"] = labels
	}
	r.apply(joinDocs(r.t, docs))
}

// clusterYAML is the rehearsed cluster: one control plane (rolled 1→2→1
// onto a spare of its pool), reached through the lab's API load
// balancer, so that it may move; one worker, rolled in place.
func (r *rehearsal) clusterYAML() []byte {
	v := kubetools.Pinned().Kubernetes
	return []byte(fmt.Sprintf(`apiVersion: kiln.dev/v1
kind: Cluster
metadata:
  name: %[1]s
  labels:
    rehearsal: %[1]s
spec:
  kubernetesVersion: %[2]s
  podCidr: 10.244.0.0/16
  serviceCidr: 10.96.0.0/12
  dnsDomain: cluster.local
  controlPlaneEndpoint: %[3]s
---
apiVersion: kiln.dev/v1
kind: ControlPlane
metadata:
  name: %[1]s-cp
spec:
  cluster: %[1]s
  replicas: 1
  version: %[2]s
  image: %[4]s
  hostSelector:
    pool: %[1]s-cp
  rolloutMaxSurge: 1
---
apiVersion: kiln.dev/v1
kind: MachineDeployment
metadata:
  name: %[1]s-workers
spec:
  cluster: %[1]s
  replicas: 1
  version: %[2]s
  image: %[4]s
  hostSelector:
    pool: %[1]s-workers
  strategy:
    maxSurge: 0
    maxUnavailable: 1
`, rehearsed, v, r.lab.APIServerEndpoint(), r.tag))
}

// nodeCount is the number of nodes kubectl lists with kubeconfig.
func (r *rehearsal) nodeCount(kubeconfig string) string {
	r.t.Helper()
	kubectl := filepath.Join(rootfs.CacheRoot(), "kube-tools", kubetools.Pinned().Kubernetes, "bin", "kubectl")
	ctx, cancel := context.WithTimeout(r.ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig", kubeconfig, "get", "nodes", "-o", "name").CombinedOutput()
	require.NoError(r.t, err, "kubectl get nodes: %s", out)
	return fmt.Sprint(len(strings.Fields(string(out))))
}

// wait polls the cluster every 2 s until done.
func (r *rehearsal) wait(what string, done func(s *fleet.Snapshot) bool) {
	r.t.Helper()
	var last string
	for {
		s, err := r.lab.Snapshot(r.ctx, rehearsed)
		if err == nil {
			if done(s) {
				return
			}
			last = strings.Join(s.Lines(), "\n")
		} else {
			last = err.Error()
		}
		select {
		case <-r.ctx.Done():
			r.t.Fatalf("waiting for %s: %v; last state:\n%s\ncontroller log (last lines):\n%s", what, r.ctx.Err(), last, tail(r.lab.ControllerLog(), 40))
		case <-time.After(2 * time.Second):
		}
	}
}

// lays lists the image lay counters of hosts in s: "h1 1, h2 1".
func lays(s *fleet.Snapshot, hosts []string) string {
	var parts []string
	for _, h := range hosts {
		parts = append(parts, fmt.Sprintf("%s %d", h, s.Hosts[h].GetStatus().GetImageLays()))
	}
	return strings.Join(parts, ", ")
}

func sumLays(s *fleet.Snapshot, hosts []string) int64 {
	var n int64
	for _, h := range hosts {
		n += s.Hosts[h].GetStatus().GetImageLays()
	}
	return n
}

func machineUIDs(s *fleet.Snapshot) map[string]string {
	out := map[string]string{}
	for n, m := range s.Machines {
		out[n] = m.GetMetadata().GetUid() + " " + m.GetStatus().GetPhase()
	}
	return out
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}
