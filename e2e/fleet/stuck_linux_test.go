package fleet_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/e2e/fleet"
	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/testenv"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// stuckRow is one cause that stops a cluster from progressing: how to
// inject it, what `kilnctl describe cluster` must then show (a condition
// line with one of reasons whose message matches msg), how to remove it
// and how to tell that the step went on.
type stuckRow struct {
	cause string
	// cluster is the cluster described.
	cluster string
	// reasons: one of them must appear on a describe line whose message
	// matches msg.
	reasons []string
	msg     *regexp.Regexp
	// inject starts the cause (and whatever makes a host meet it).
	inject func(t *testing.T)
	// since reports the moment the stuck step began (the clock of "seconds
	// until visible"); nil: when inject returned.
	since     func(s *fleet.Snapshot) bool
	sinceWhat string
	// fix removes the cause; recovery says how ("fixed within the retry
	// budget" or the documented command).
	fix      func(t *testing.T)
	recovery string
	// recovered reports that the step went on.
	recovered func(s *fleet.Snapshot) bool
}

// stuckResult is a row of the table the test logs.
type stuckResult struct {
	cause, condition, sinceWhat, recovery string
	visible                               time.Duration
	seen, recovered                       bool
	recoveredIn                           time.Duration
}

// The target of the issue: a stuck step says why within 30 s.
const visibleWithin = 30 * time.Second

// TestStuckCausesAreVisible injects, on one lab of five hosts (h1-h4
// behind Redfish emulators, h5 behind ipmi_sim; the rows of each cluster
// in order, the clusters side by side as -parallel allows), each cause
// that stops a cluster from progressing, and checks that `kilnctl describe
// cluster` names it (reason and message) within 30 s of the step meeting
// it, and that the step goes on once the cause is removed:
//
//   - cluster "stuck" (control plane on h1, one worker on h2): an image
//     that does not exist; a port taken on the node before kubeadm init and
//     before kubeadm join; a HealthCheck refusing remediation (maxUnhealthy);
//   - cluster "stuck-b" (one control-plane machine on h3, never
//     bootstrapped): its BMC unreachable, then an image URL answering 404;
//   - cluster "stuck-c" (h4): a wrong BMC password (the host goes to Error:
//     recovered by applying the host with the right password), then an
//     Image whose sha256 is wrong;
//   - cluster "stuck-d" (h5, PXE): firmware that boots nothing (its iPXE
//     script cannot be fetched), shown once --expected-boot-time passed.
//
// It logs the table cause → condition reason → seconds until visible →
// recovered, and writes it to $KILN_STUCK_TABLE when set.
func TestStuckCausesAreVisible(t *testing.T) {
	needLab(t)
	for _, tool := range []string{"socat", "nsenter"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "needs %s", tool)
		}
	}
	end := time.Now().Add(30 * time.Minute)
	if d, ok := t.Deadline(); ok && d.Add(-3*time.Minute).Before(end) {
		end = d.Add(-3 * time.Minute)
	}
	ctx, cancel := context.WithDeadline(context.Background(), end)
	defer cancel()
	start := time.Now()
	sl := startStuckLab(t, ctx)
	t.Logf("lab up in %s", time.Since(start).Round(time.Second))
	lab := sl.lab

	h := func(i int) string { return lab.HostResource(i) }
	machineOn := func(s *fleet.Snapshot, host string) *typesv1.Machine {
		for _, m := range s.Machines {
			if m.GetSpec().GetHost() == host && m.GetMetadata().GetDeletionTimestamp() == nil {
				return m
			}
		}
		return nil
	}
	hostStep := func(host string, steps ...hostlife.Step) func(s *fleet.Snapshot) bool {
		return func(s *fleet.Snapshot) bool {
			st := s.Hosts[host].GetStatus()
			for _, x := range steps {
				if st.GetState() == typesv1.HostState_HOST_STATE_PROVISIONING && st.GetProvisioningStep() == string(x) {
					return true
				}
			}
			return false
		}
	}
	provisioned := func(host string) func(s *fleet.Snapshot) bool {
		return func(s *fleet.Snapshot) bool {
			return s.Hosts[host].GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONED
		}
	}
	bootstrapped := func(host string) func(s *fleet.Snapshot) bool {
		return func(s *fleet.Snapshot) bool {
			return conditions.IsTrue(machineOn(s, host).GetStatus().GetConditions(), clusterexec.ConditionBootstrapped)
		}
	}
	laid := func(host string) func(s *fleet.Snapshot) bool {
		return func(s *fleet.Snapshot) bool {
			st := s.Hosts[host].GetStatus()
			return st.GetImageLays() >= 1 && st.GetState() != typesv1.HostState_HOST_STATE_ERROR
		}
	}
	var listener *exec.Cmd
	takePort := func(t *testing.T, host string, port int) {
		listener = sl.listen(t, host, port)
	}
	freePort := func(t *testing.T) {
		require.NoError(t, listener.Process.Kill())
		_ = listener.Wait()
	}
	var worker string // uid of the worker the HealthCheck must not remediate

	rows := []stuckRow{{
		cause:   "missing image (spec.image names no Image)",
		cluster: "stuck",
		reasons: []string{"ImageNotFound"},
		msg:     regexp.MustCompile(`stuck-missing.*kilnctl get images`),
		inject: func(t *testing.T) {
			sl.apply(t, sl.clusterDocs(t, "stuck", "stuck-missing", h(1)))
		},
		fix: func(t *testing.T) {
			sl.apply(t, sl.imageDoc(t, "stuck-missing", nil))
		},
		recovery: "apply the Image",
		recovered: func(s *fleet.Snapshot) bool {
			return conditions.IsTrue(s.ControlPlanes["stuck-cp"].GetStatus().GetConditions(), clusterplan.ConditionImageResolved) && machineOn(s, h(1)) != nil
		},
	}, {
		cause:     "kubeadm init: port 6443 taken on the node",
		cluster:   "stuck",
		reasons:   []string{"PreflightFailed"},
		msg:       regexp.MustCompile(`ports in use: 6443`),
		inject:    func(t *testing.T) { takePort(t, h(1), 6443) },
		since:     provisioned(h(1)),
		sinceWhat: "host Provisioned",
		fix:       freePort,
		recovery:  "fixed (a refusal is retried after 10 s, doubling to 5 min)",
		recovered: bootstrapped(h(1)),
	}, {
		cause:   "worker join: port 10250 taken on the node",
		cluster: "stuck",
		reasons: []string{"PreflightFailed"},
		msg:     regexp.MustCompile(`ports in use: 10250`),
		inject: func(t *testing.T) {
			takePort(t, h(2), 10250)
			sl.apply(t, sl.deploymentDoc(t, "stuck", sl.tag, h(2)))
		},
		since:     provisioned(h(2)),
		sinceWhat: "host Provisioned",
		fix:       freePort,
		recovery:  "fixed (a refusal is retried after 10 s, doubling to 5 min)",
		recovered: bootstrapped(h(2)),
	}, {
		cause:   "HealthCheck refuses remediation (1 of 2 unhealthy, maxUnhealthy 40%)",
		cluster: "stuck",
		reasons: []string{clusterplan.ReasonTooManyUnhealthy},
		msg:     regexp.MustCompile(`1 of 2 unhealthy exceeds maxUnhealthy 40%`),
		inject: func(t *testing.T) {
			sl.apply(t, []byte(`apiVersion: kiln.dev/v1
kind: HealthCheck
metadata:
  name: stuck-health
spec:
  cluster: stuck
  selector:
    cluster: stuck
  unhealthyConditions:
    - {type: KubeletHealthy, status: "False", timeout: 5s}
  maxUnhealthy: "40%"
`))
			// Healthy first: both machines checked, none unhealthy.
			_, err := lab.Watch(ctx, "stuck", time.Second, func(s *fleet.Snapshot) bool {
				c := conditions.Get(s.HealthChecks["stuck-health"].GetStatus().GetConditions(), clusterplan.ConditionRemediationAllowed)
				return c.GetStatus() == conditions.True && strings.HasPrefix(c.GetMessage(), "0 of 2 unhealthy")
			})
			require.NoError(t, err)
			s, err := lab.Snapshot(ctx, "stuck")
			require.NoError(t, err)
			worker = machineOn(s, h(2)).GetMetadata().GetUid()
			_, err = lab.NodeExec(ctx, h(2), "systemctl", "stop", "kubelet")
			require.NoError(t, err)
		},
		fix: func(t *testing.T) {
			_, err := lab.NodeExec(ctx, h(2), "systemctl", "start", "kubelet")
			require.NoError(t, err)
		},
		recovery: "fixed (kubelet started)",
		recovered: func(s *fleet.Snapshot) bool {
			if m := machineOn(s, h(2)); m == nil || m.GetMetadata().GetUid() != worker {
				t.Errorf("the worker on %s was remediated although maxUnhealthy refused it", h(2))
			}
			return conditions.IsTrue(s.HealthChecks["stuck-health"].GetStatus().GetConditions(), clusterplan.ConditionRemediationAllowed)
		},
	}, {
		cause:   "BMC unreachable (connection refused)",
		cluster: "stuck-b",
		reasons: []string{"CallFailed", "CircuitOpen"},
		msg:     regexp.MustCompile(`connection refused`),
		inject: func(t *testing.T) {
			sl.blockBMC(t, h(3))
			sl.apply(t, sl.clusterDocs(t, "stuck-b", "stuck-404", h(3)))
		},
		fix:      func(t *testing.T) { sl.unblockBMC(t) },
		recovery: "fixed (BMC retried with backoff, no limit)",
		recovered: func(s *fleet.Snapshot) bool {
			st := s.Hosts[h(3)].GetStatus()
			return conditions.IsTrue(st.GetConditions(), "BMCReachable") && st.GetProvisioningStep() != string(hostlife.StepPowerOff)
		},
	}, {
		cause:     "image URL answering 404",
		cluster:   "stuck-b",
		reasons:   []string{hostlife.ReasonStepFailed},
		msg:       regexp.MustCompile(`LayImage.*(404|not found|NotFound)`),
		inject:    func(t *testing.T) {},
		since:     hostStep(h(3), hostlife.StepLayImage),
		sinceWhat: "step LayImage",
		fix: func(t *testing.T) {
			require.NoError(t, os.Link(filepath.Join(sl.imgDir, sl.imageFile), filepath.Join(sl.imgDir, "stuck-404-"+sl.imageFile)))
		},
		recovery:  "fixed within the retry budget",
		recovered: laid(h(3)),
	}, {
		cause:   "BMC wrong password",
		cluster: "stuck-c",
		reasons: []string{"Refused", hostlife.ReasonStepFailed, "CallFailed", "HostError"},
		msg:     regexp.MustCompile(`(?i)401|unauthori|permission`),
		inject: func(t *testing.T) {
			sl.registerHosts(t, map[string]string{h(4): "not-the-password"})
			sl.apply(t, sl.clusterDocs(t, "stuck-c", "stuck-hash", h(4)))
		},
		// The right password applied again is a spec change, which takes
		// the host out of Error (hostlife, errorGeneration).
		fix:      func(t *testing.T) { sl.registerHosts(t, nil) },
		recovery: "kilnctl apply of the host with the right password (the spec change takes it out of Error)",
		// Recovered once the BMC steps are behind it: the host is out of
		// Error with its BMC answering and waiting for, or laying onto,
		// the booted agent (the next row's wrong sha256 then fails the lay).
		recovered: func(s *fleet.Snapshot) bool {
			st := s.Hosts[h(4)].GetStatus()
			step := hostlife.Step(st.GetProvisioningStep())
			return st.GetState() == typesv1.HostState_HOST_STATE_PROVISIONING && conditions.IsTrue(st.GetConditions(), "BMCReachable") &&
				(step == hostlife.StepWaitBootAgent || step == hostlife.StepLayImage)
		},
	}, {
		cause:     "image hash mismatch (Image sha256 wrong)",
		cluster:   "stuck-c",
		reasons:   []string{hostlife.ReasonStepFailed},
		msg:       regexp.MustCompile(`sha256 mismatch`),
		inject:    func(t *testing.T) {},
		since:     hostStep(h(4), hostlife.StepLayImage),
		sinceWhat: "step LayImage",
		fix: func(t *testing.T) {
			sl.apply(t, sl.imageDoc(t, "stuck-hash", nil))
		},
		recovery:  "fixed within the retry budget",
		recovered: laid(h(4)),
	}, {
		cause:   "boot agent never arriving (PXE script unreachable: firmware boots nothing)",
		cluster: "stuck-d",
		reasons: []string{hostlife.ReasonBootAgentMissing},
		msg:     regexp.MustCompile(`no boot agent check-in .* pxe`),
		inject: func(t *testing.T) {
			sl.blockBootServer(t, h(5))
			sl.apply(t, sl.clusterDocs(t, "stuck-d", sl.tag, h(5)))
		},
		since:     hostStep(h(5), hostlife.StepWaitBootAgent),
		sinceWhat: "step WaitBootAgent",
		fix:       func(t *testing.T) { sl.unblockBootServer(t) },
		recovery:  "fixed (firmware retries the boot script for 90 s)",
		recovered: func(s *fleet.Snapshot) bool {
			return conditions.IsTrue(s.Hosts[h(5)].GetStatus().GetConditions(), hostlife.ConditionBootAgentCheckedIn)
		},
	}}

	// The rows of one cluster run in order; the clusters (on hosts of
	// their own) side by side, as far as go test -parallel lets them.
	var groups []string
	byGroup := map[string][]int{}
	for i, r := range rows {
		if byGroup[r.cluster] == nil {
			groups = append(groups, r.cluster)
		}
		byGroup[r.cluster] = append(byGroup[r.cluster], i)
	}
	results := make([]*stuckResult, len(rows))
	t.Run("causes", func(t *testing.T) {
		for _, g := range groups {
			t.Run(g, func(t *testing.T) {
				t.Parallel()
				for _, i := range byGroup[g] {
					res := runStuckRow(t, ctx, sl, rows[i])
					results[i] = &res
					t.Logf("%s: %s after %s (from %s), recovered %t", res.cause, res.condition, res.visible.Round(time.Second), res.sinceWhat, res.recovered)
					if !res.seen || !res.recovered {
						break
					}
				}
				if g != "stuck" {
					// Its host is wiped and powered off again.
					sl.kilnctlDelete(t, "cluster", g)
					sl.kilnctlDelete(t, "controlplane", g+"-cp")
				}
			})
		}
	})
	table := stuckTable(results)
	t.Logf("stuck causes (whole test %s):\n%s", time.Since(start).Round(time.Second), table)
	if f := os.Getenv("KILN_STUCK_TABLE"); f != "" {
		require.NoError(t, os.WriteFile(f, []byte(table), 0o644))
	}
}

// runStuckRow injects r's cause, waits for its step to begin, then for
// describe to show it, removes it and waits for the step to go on.
func runStuckRow(t *testing.T, ctx context.Context, sl *stuckLab, r stuckRow) stuckResult {
	res := stuckResult{cause: r.cause, sinceWhat: r.sinceWhat, recovery: r.recovery}
	if res.sinceWhat == "" {
		res.sinceWhat = "injected"
	}
	r.inject(t)
	since := time.Now()
	if r.since != nil {
		_, err := sl.lab.Watch(ctx, r.cluster, time.Second, r.since)
		if err != nil {
			t.Errorf("%s: the step never began: %v", r.cause, err)
			return res
		}
		since = time.Now()
	}
	var last string
	for {
		out, err := sl.lab.Kilnctl(ctx, nil, "describe", "cluster", r.cluster)
		if err == nil {
			last = out
			if line := matchLine(out, r.reasons, r.msg); line != "" {
				res.seen, res.visible, res.condition = true, time.Since(since), conditionOf(line, r.reasons)
				t.Logf("%s: visible after %s:\n  %s", r.cause, res.visible.Round(time.Second), strings.TrimSpace(line))
				break
			}
		}
		if time.Since(since) > 4*time.Minute || ctx.Err() != nil {
			t.Errorf("%s: describe cluster %s shows none of %v with a message matching %q within %s; last output:\n%s",
				r.cause, r.cluster, r.reasons, r.msg, time.Since(since).Round(time.Second), last)
			return res
		}
		time.Sleep(time.Second)
	}
	if res.visible > visibleWithin {
		t.Errorf("%s: visible after %s, want within %s", r.cause, res.visible.Round(time.Second), visibleWithin)
	}
	r.fix(t)
	fixed := time.Now()
	wctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if _, err := sl.lab.Watch(wctx, r.cluster, time.Second, r.recovered); err != nil {
		out, _ := sl.lab.Kilnctl(ctx, nil, "describe", "cluster", r.cluster)
		t.Errorf("%s: did not recover after the fix (%s): %v\n%s", r.cause, r.recovery, err, out)
		return res
	}
	res.recovered, res.recoveredIn = true, time.Since(fixed)
	return res
}

// matchLine returns a describe line that carries one of reasons (as a
// column; the first of reasons that any line carries) and a message
// matching msg.
func matchLine(out string, reasons []string, msg *regexp.Regexp) string {
	tree, _, _ := strings.Cut(out, "\nEvents:")
	for _, r := range reasons {
		for _, line := range strings.Split(tree, "\n") {
			if conditionOf(line, []string{r}) != "" && msg.MatchString(line) {
				return line
			}
		}
	}
	return ""
}

// conditionOf renders a describe line as "Type=Status Reason" when it
// carries one of reasons.
func conditionOf(line string, reasons []string) string {
	f := strings.Fields(strings.TrimLeft(line, "│├└─ "))
	for i, x := range f {
		for _, r := range reasons {
			if x != r || i < 1 {
				continue
			}
			// NAME [(summary)] READY SEVERITY REASON SINCE MESSAGE
			status := "-"
			for _, y := range f[1:i] {
				if y == "True" || y == "False" || y == "Unknown" {
					status = y
				}
			}
			return fmt.Sprintf("%s=%s %s", f[0], status, r)
		}
	}
	return ""
}

func stuckTable(rs []*stuckResult) string {
	var b bytes.Buffer
	w := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "CAUSE\tCONDITION (describe cluster)\tVISIBLE AFTER\tRECOVERED\tRECOVERY")
	for _, r := range rs {
		if r == nil {
			continue // not run: an earlier row of its cluster failed
		}
		vis, rec := "never", "no"
		if r.seen {
			vis = fmt.Sprintf("%.0f s (from %s)", r.visible.Seconds(), r.sinceWhat)
		}
		if r.recovered {
			rec = fmt.Sprintf("yes, %.0f s after the fix", r.recoveredIn.Seconds())
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", r.cause, r.condition, vis, rec, r.recovery)
	}
	_ = w.Flush()
	return b.String()
}

// stuckLab is the lab of TestStuckCausesAreVisible: five hosts, each
// labelled stuck-host=<its resource name> so that a spec can pin it, the
// lab image served from a directory of the test's own (hard links into the
// image cache) so that files can appear in it, and a controller that calls
// a boot agent missing after 15 s.
type stuckLab struct {
	lab        *fleet.Lab
	name       string
	tag        string
	imgDir     string
	imageFile  string // the lab image's file under imgDir (<tag>.raw.zst)
	image      map[string]any
	bmcUnblock func()
	pxeUnblock func()
}

func startStuckLab(t *testing.T, ctx context.Context) *stuckLab {
	t.Helper()
	bin := buildBinaries(t)
	out := &testWriter{t: t}
	dir := t.TempDir()
	require.NoError(t, fleet.BootMedia(ctx, filepath.Join(bin, "kiln-imagebuilder"), filepath.Join(bin, "kiln-agent"), filepath.Join(dir, "media"), out))
	cached, m, err := fleet.LabImage(ctx, fleet.ImageOptions{Agent: filepath.Join(bin, "kiln-agent"), TagDate: labTagDate, Progress: out})
	require.NoError(t, err)
	imgDir := filepath.Join(dir, "images")
	require.NoError(t, os.MkdirAll(imgDir, 0o755))
	ents, err := os.ReadDir(cached)
	require.NoError(t, err)
	for _, e := range ents {
		if e.Type().IsRegular() {
			require.NoError(t, os.Link(filepath.Join(cached, e.Name()), filepath.Join(imgDir, e.Name())))
		}
	}
	name := fmt.Sprintf("s%04d", rand.IntN(10000))
	lab, err := fleet.New(fleet.Config{Name: name, Dir: dir, Bin: bin, Subnet: freeSubnet(t),
		Hosts: 4, IPMI: 1, DiskSize: "6G", MediaDir: filepath.Join(dir, "media"), ImageDir: imgDir, Out: out,
		ControllerArgs: []string{"--expected-boot-time", "15s"}})
	require.NoError(t, err)
	sl := &stuckLab{lab: lab, name: name, tag: m.Tag, imgDir: imgDir}
	t.Cleanup(func() {
		if sl.bmcUnblock != nil {
			sl.bmcUnblock()
		}
		if sl.pxeUnblock != nil {
			sl.pxeUnblock()
		}
		if t.Failed() {
			t.Logf("controller log (last lines):\n%s", tail(lab.ControllerLog(), 80))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := lab.Down(ctx); err != nil {
			t.Errorf("lab down: %v", err)
		}
	})
	require.NoError(t, lab.UpRack(ctx))
	require.NoError(t, lab.StartController(ctx))
	res, err := fleet.ImageResource(filepath.Join(imgDir, m.Tag+".image.yaml"), lab.BootURL())
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(res, &sl.image))
	u, err := url.Parse(sl.image["spec"].(map[string]any)["url"].(string))
	require.NoError(t, err)
	sl.imageFile = filepath.Base(u.Path)
	sl.apply(t, res)
	// The 404 image names a file that is not there (yet); the hash image
	// a wrong sha256 (until fixed).
	sl.apply(t, sl.imageDoc(t, "stuck-404", func(spec map[string]any) {
		spec["url"] = strings.TrimSuffix(spec["url"].(string), sl.imageFile) + "stuck-404-" + sl.imageFile
	}))
	sl.apply(t, sl.imageDoc(t, "stuck-hash", func(spec map[string]any) {
		sum := spec["sha256"].(string)
		spec["sha256"] = strings.Repeat("0", 8) + sum[8:]
	}))
	sl.registerHosts(t, nil)
	// Every host Available before the rows start: the wrong-password row
	// re-applies its host at once, and a host still Registering then
	// checks its BMC with the wrong password and goes to Error with no
	// machine (the cluster only says "waiting for a host").
	_, err = lab.Watch(ctx, "", time.Second, func(s *fleet.Snapshot) bool {
		for i := 1; i <= 5; i++ {
			if s.Hosts[lab.HostResource(i)].GetStatus().GetState() != typesv1.HostState_HOST_STATE_AVAILABLE {
				return false
			}
		}
		return true
	})
	require.NoError(t, err, "hosts Available after registration")
	return sl
}

func (sl *stuckLab) apply(t *testing.T, docs []byte) {
	t.Helper()
	_, err := sl.lab.Kilnctl(context.Background(), docs, "apply", "-f", "-")
	require.NoError(t, err, "kilnctl apply:\n%s", docs)
}

// kilnctlDelete deletes kind/name; one already gone is fine.
func (sl *stuckLab) kilnctlDelete(t *testing.T, kind, name string) {
	t.Helper()
	_, err := sl.lab.Kilnctl(context.Background(), nil, "delete", kind, name)
	if err != nil && !strings.Contains(strings.ToLower(err.Error()), "not found") {
		t.Errorf("kilnctl delete %s %s: %v", kind, name, err)
	}
}

// registerHosts applies the rack's hosts, each labelled stuck-host=<name>,
// with the passwords of wrong instead of theirs.
func (sl *stuckLab) registerHosts(t *testing.T, wrong map[string]string) {
	t.Helper()
	hosts, err := sl.lab.Kilnctl(context.Background(), nil, "lab", "--name", sl.name, "--state-dir", sl.lab.StateDir(), "hosts")
	require.NoError(t, err)
	var docs []map[string]any
	for _, d := range splitDocs(t, []byte(hosts)) {
		meta := d["metadata"].(map[string]any)
		name := meta["name"].(string)
		labels, _ := meta["labels"].(map[string]any)
		if labels == nil {
			labels = map[string]any{}
		}
		labels["stuck-host"] = name
		meta["labels"] = labels
		if pw, ok := wrong[name]; ok {
			d["spec"].(map[string]any)["bmc"].(map[string]any)["password"] = pw
		}
		docs = append(docs, d)
	}
	sl.apply(t, joinDocs(t, docs))
}

// imageDoc is the lab image under another name (no labels, so no
// imageSelector picks it), its spec changed by change.
func (sl *stuckLab) imageDoc(t *testing.T, name string, change func(spec map[string]any)) []byte {
	t.Helper()
	d := clone(t, sl.image)
	d["metadata"] = map[string]any{"name": name}
	delete(d, "status")
	if change != nil {
		change(d["spec"].(map[string]any))
	}
	return joinDocs(t, []map[string]any{d})
}

// clusterDocs is examples/lab-cluster.yaml's Cluster and ControlPlane
// (one replica) as cluster name, naming image, pinned to host.
func (sl *stuckLab) clusterDocs(t *testing.T, name, image, host string) []byte {
	t.Helper()
	var docs []map[string]any
	for _, d := range splitDocs(t, labCluster(t, sl.lab, image)) {
		switch d["kind"] {
		case "Cluster":
			d["metadata"].(map[string]any)["name"] = name
		case "ControlPlane":
			d["metadata"].(map[string]any)["name"] = name + "-cp"
			spec := d["spec"].(map[string]any)
			spec["cluster"] = name
			spec["replicas"] = 1
			spec["hostSelector"] = map[string]any{"stuck-host": host}
		default:
			continue
		}
		docs = append(docs, d)
	}
	return joinDocs(t, docs)
}

// deploymentDoc is the example's MachineDeployment for cluster with one
// replica on host.
func (sl *stuckLab) deploymentDoc(t *testing.T, cluster, image, host string) []byte {
	t.Helper()
	for _, d := range splitDocs(t, labCluster(t, sl.lab, image)) {
		if d["kind"] != "MachineDeployment" {
			continue
		}
		d["metadata"].(map[string]any)["name"] = cluster + "-workers"
		spec := d["spec"].(map[string]any)
		spec["cluster"] = cluster
		spec["replicas"] = 1
		spec["hostSelector"] = map[string]any{"stuck-host": host}
		return joinDocs(t, []map[string]any{d})
	}
	t.Fatal("no MachineDeployment in examples/lab-cluster.yaml")
	return nil
}

func (sl *stuckLab) rackHost(t *testing.T, host string) rack.Host {
	t.Helper()
	st, err := rack.ReadState(sl.lab.StateDir())
	require.NoError(t, err)
	for _, h := range st.Hosts {
		if h.Resource == host {
			return h
		}
	}
	t.Fatalf("no lab host %s", host)
	return rack.Host{}
}

// listen takes port on host's network (its namespace, which the system
// booted from disk shares), as a stray process on the node would.
func (sl *stuckLab) listen(t *testing.T, host string, port int) *exec.Cmd {
	t.Helper()
	ns := sl.rackHost(t, host).Namespace
	cmd := exec.Command("ip", "netns", "exec", ns, "socat", fmt.Sprintf("TCP-LISTEN:%d,reuseaddr,fork", port), "OPEN:/dev/null")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	// Listening before the test goes on.
	for i := 0; i < 50; i++ {
		out, _ := exec.Command("ip", "netns", "exec", ns, "ss", "-Hltn", fmt.Sprintf("sport = :%d", port)).Output()
		if len(bytes.TrimSpace(out)) > 0 {
			return cmd
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("socat did not listen on %s:%d", host, port)
	return nil
}

// nft runs an nftables script, in namespace ns when not empty.
func nft(t *testing.T, ns, script string) {
	t.Helper()
	args := []string{"nft", "-f", "-"}
	if ns != "" {
		args = append([]string{"ip", "netns", "exec", ns}, args...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdin = strings.NewReader(script)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "nft: %s\n%s", out, script)
}

// blockBMC makes host's Redfish emulator refuse connections from this
// machine (a table of the test's own, on the emulator's loopback port
// only).
func (sl *stuckLab) blockBMC(t *testing.T, host string) {
	t.Helper()
	u, err := url.Parse(sl.rackHost(t, host).BMC.Address)
	require.NoError(t, err)
	table := "kiln_stuck_" + sl.name
	nft(t, "", fmt.Sprintf(`table ip %s {
	chain out {
		type filter hook output priority 0; policy accept;
		ip daddr %s tcp dport %s reject with tcp reset
	}
}
`, table, u.Hostname(), u.Port()))
	sl.bmcUnblock = func() { _ = exec.Command("nft", "delete", "table", "ip", table).Run() }
}

func (sl *stuckLab) unblockBMC(t *testing.T) {
	t.Helper()
	sl.bmcUnblock()
	sl.bmcUnblock = nil
}

// blockBootServer makes host's network refuse the boot server (its
// firmware cannot fetch its iPXE script: it boots nothing while that
// lasts).
func (sl *stuckLab) blockBootServer(t *testing.T, host string) {
	t.Helper()
	ns := sl.rackHost(t, host).Namespace
	u, err := url.Parse(sl.lab.BootURL())
	require.NoError(t, err)
	nft(t, ns, fmt.Sprintf(`table ip kiln_stuck {
	chain out {
		type filter hook output priority 0; policy accept;
		ip daddr %s tcp dport %s reject with tcp reset
	}
}
`, u.Hostname(), u.Port()))
	sl.pxeUnblock = func() {
		_ = exec.Command("ip", "netns", "exec", ns, "nft", "delete", "table", "ip", "kiln_stuck").Run()
	}
}

func (sl *stuckLab) unblockBootServer(t *testing.T) {
	t.Helper()
	sl.pxeUnblock()
	sl.pxeUnblock = nil
}
