package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/imagebuilder/kubetools"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// MinorUpgrade is one run of `make lab-upgrade`: a lab rack provisioned into
// a cluster at the previous Kubernetes minor, then upgraded to the pinned
// one by reimaging, as a user does it: the ControlPlane's version and image
// first, then the MachineDeployments'.
type MinorUpgrade struct {
	// Lab is the lab's configuration; ImageDir is set by Run (Dir/images,
	// links to both images). Hosts+IPMI must leave a spare host for the
	// control plane's rollout (the default 3+1 does for lab-cluster.yaml).
	Lab Config
	// ClusterFile is the cluster to provision and upgrade
	// (examples/lab-cluster.yaml); its versions and images are replaced.
	ClusterFile string
	// From and To are the releases (default kubetools.Previous and
	// kubetools.Pinned); FromSpec and ToSpec their lab image specs
	// (default PreviousLabSpec and DefaultLabSpec).
	From, To         kubetools.Release
	FromSpec, ToSpec string
	// KubeTools is the kube-tools cache (default
	// ${KILN_CACHE:-/var/cache/kiln}/kube-tools); kubectl comes from To's.
	KubeTools kubetools.Cache
	// ImageCacheDir is LabImage's cache (default its default).
	ImageCacheDir string
	// PhaseTimeout bounds each wait (default 30m).
	PhaseTimeout time.Duration
	// Out receives progress (default the lab's Out).
	Out io.Writer
}

// PhaseTime is how long one phase of a run took.
type PhaseTime struct {
	Name string
	Took time.Duration
}

// UpgradeResult is what a run measured and found.
type UpgradeResult struct {
	// Phases in order: boot media, images, rack, provision, control
	// plane, workers, check.
	Phases []PhaseTime
	// Kubelets maps each node to the kubelet version kubectl reports.
	Kubelets map[string]string
	// Kubeconfig is the cluster's kubeconfig (kilnctl kubeconfig).
	Kubeconfig string
}

func (u *MinorUpgrade) defaults() {
	if u.From.Kubernetes == "" {
		u.From = kubetools.Previous()
	}
	if u.To.Kubernetes == "" {
		u.To = kubetools.Pinned()
	}
	if u.FromSpec == "" {
		u.FromSpec = PreviousLabSpec()
	}
	if u.ToSpec == "" {
		u.ToSpec = DefaultLabSpec()
	}
	if u.KubeTools.Dir == "" {
		u.KubeTools.Dir = filepath.Join(rootfs.CacheRoot(), "kube-tools")
	}
	if u.PhaseTimeout == 0 {
		u.PhaseTimeout = 30 * time.Minute
	}
	if u.Out == nil {
		u.Out = u.Lab.Out
	}
	if u.Out == nil {
		u.Out = io.Discard
	}
}

// NeedReleases returns a FailedPrecondition error naming the command that
// builds each kube-tools release of the run that is not cached.
func (u *MinorUpgrade) NeedReleases() error {
	u.defaults()
	var missing []string
	for _, r := range []kubetools.Release{u.From, u.To} {
		if _, err := os.Stat(filepath.Join(u.KubeTools.VersionDir(r), kubetools.ManifestFile)); err != nil {
			missing = append(missing, fmt.Sprintf("%s (%s)", r.Kubernetes, kubetools.BuildCommand(r)))
		}
	}
	if len(missing) > 0 {
		return errdefs.FailedPrecondition("lab upgrade: kube-tools not cached: %s; %s", strings.Join(missing, ", "), kubetools.ColdBuildEstimate)
	}
	return nil
}

// Run provisions the cluster at From and upgrades it to To. It returns the
// lab (nil when it was not created), which the caller removes with Down
// when done, also after an error: a failed run leaves the lab as it was
// for inspection. The result holds the phases done so far, also with an
// error.
func (u *MinorUpgrade) Run(ctx context.Context) (*Lab, *UpgradeResult, error) {
	u.defaults()
	res := &UpgradeResult{Kubelets: map[string]string{}}
	start := time.Now()
	phase := func(name string, t0 time.Time) {
		res.Phases = append(res.Phases, PhaseTime{name, time.Since(t0)})
		fmt.Fprintf(u.Out, "upgrade: [%5ds] %s took %s\n", int(time.Since(start).Seconds()), name, time.Since(t0).Round(time.Second))
	}
	say := func(format string, args ...any) {
		fmt.Fprintf(u.Out, "upgrade: [%5ds] "+format+"\n", append([]any{int(time.Since(start).Seconds())}, args...)...)
	}
	if err := u.NeedReleases(); err != nil {
		return nil, res, err
	}
	clusterFile, err := os.ReadFile(u.ClusterFile)
	if err != nil {
		return nil, res, fmt.Errorf("lab upgrade: %w", err)
	}
	docs, err := ParseClusterDocs(clusterFile)
	if err != nil {
		return nil, res, err
	}
	name := docs.Name()
	if u.Lab.Dir == "" || u.Lab.Bin == "" {
		return nil, res, errdefs.InvalidArgument("lab upgrade: Lab.Dir and Lab.Bin are required")
	}

	t0 := time.Now()
	say("boot media")
	media := u.Lab.MediaDir
	if media == "" {
		media = filepath.Join(u.Lab.Dir, "media")
		u.Lab.MediaDir = media
	}
	if err := BootMedia(ctx, filepath.Join(u.Lab.Bin, "kiln-imagebuilder"), filepath.Join(u.Lab.Bin, "kiln-agent"), media, u.Out); err != nil {
		return nil, res, err
	}
	phase("boot media", t0)

	t0 = time.Now()
	say("lab images: %s (%s) and %s (%s), cached by their inputs", u.From.Kubernetes, u.FromSpec, u.To.Kubernetes, u.ToSpec)
	agent := filepath.Join(u.Lab.Bin, "kiln-agent")
	fromDir, fromImg, err := LabImage(ctx, ImageOptions{Spec: u.FromSpec, Agent: agent, KubeTools: u.KubeTools, CacheDir: u.ImageCacheDir, Progress: u.Out})
	if err != nil {
		return nil, res, err
	}
	toDir, toImg, err := LabImage(ctx, ImageOptions{Spec: u.ToSpec, Agent: agent, KubeTools: u.KubeTools, CacheDir: u.ImageCacheDir, Progress: u.Out})
	if err != nil {
		return nil, res, err
	}
	if fromImg.Tag == toImg.Tag {
		return nil, res, errdefs.InvalidArgument("lab upgrade: both images have tag %s: the specs must differ in kubernetesVersion", fromImg.Tag)
	}
	imageDir := filepath.Join(u.Lab.Dir, "images")
	if err := LinkImages(imageDir, fromDir, toDir); err != nil {
		return nil, res, err
	}
	u.Lab.ImageDir = imageDir
	phase("lab images", t0)

	t0 = time.Now()
	lab, err := New(u.Lab)
	if err != nil {
		return nil, res, err
	}
	if err := lab.Up(ctx); err != nil {
		return lab, res, err
	}
	for _, tag := range []string{fromImg.Tag, toImg.Tag} {
		r, err := ImageResource(filepath.Join(imageDir, tag+".image.yaml"), lab.BootURL())
		if err != nil {
			return lab, res, err
		}
		if _, err := lab.Kilnctl(ctx, r, "apply", "-f", "-"); err != nil {
			return lab, res, err
		}
	}
	phase("rack and controller", t0)

	cps, workers := docs.Replicas()
	if docs.ControlPlaneEndpoint() == "" {
		// kubeadm lets a second control-plane member join only behind a
		// stable endpoint: the rack's API load balancer.
		docs.SetControlPlaneEndpoint(lab.APIServerEndpoint())
		say("control-plane endpoint %s: the rack's API load balancer", lab.APIServerEndpoint())
	}
	t0 = time.Now()
	docs.At(u.From.Kubernetes, fromImg.Tag)
	all, err := docs.YAML()
	if err != nil {
		return lab, res, err
	}
	say("provisioning cluster %s at %s on %s (%d control plane, %d workers)", name, u.From.Kubernetes, fromImg.Tag, cps, workers)
	if _, err := lab.Kilnctl(ctx, all, "apply", "-f", "-"); err != nil {
		return lab, res, err
	}
	if err := u.wait(ctx, lab, name, allAt(u.From.Kubernetes, fromImg.Tag, cps, workers)); err != nil {
		return lab, res, err
	}
	phase("provision at "+u.From.Kubernetes, t0)

	docs.At(u.To.Kubernetes, toImg.Tag)
	t0 = time.Now()
	cp, err := docs.YAML("ControlPlane")
	if err != nil {
		return lab, res, err
	}
	say("upgrading the control plane to %s (%s): a new member joins on the spare host, then the old one leaves etcd and its host is wiped", u.To.Kubernetes, toImg.Tag)
	if _, err := lab.Kilnctl(ctx, cp, "apply", "-f", "-"); err != nil {
		return lab, res, err
	}
	if err := u.wait(ctx, lab, name, roleAt(clusterplan.RoleControlPlane, u.To.Kubernetes, toImg.Tag, cps)); err != nil {
		return lab, res, err
	}
	phase("control plane to "+u.To.Kubernetes, t0)

	t0 = time.Now()
	md, err := docs.YAML("MachineDeployment")
	if err != nil {
		return lab, res, err
	}
	say("upgrading the workers to %s: each is drained, deleted and its host reimaged", u.To.Kubernetes)
	if _, err := lab.Kilnctl(ctx, md, "apply", "-f", "-"); err != nil {
		return lab, res, err
	}
	if err := u.wait(ctx, lab, name, allAt(u.To.Kubernetes, toImg.Tag, cps, workers)); err != nil {
		return lab, res, err
	}
	cl, err := docs.YAML("Cluster")
	if err != nil {
		return lab, res, err
	}
	if _, err := lab.Kilnctl(ctx, cl, "apply", "-f", "-"); err != nil {
		return lab, res, err
	}
	phase("workers to "+u.To.Kubernetes, t0)

	t0 = time.Now()
	res.Kubeconfig = filepath.Join(u.Lab.Dir, "kubeconfig")
	if _, err := lab.Kilnctl(ctx, nil, "kubeconfig", name, "-o", res.Kubeconfig); err != nil {
		return lab, res, err
	}
	kubectl := filepath.Join(u.KubeTools.BinDir(u.To), kubetools.Kubectl)
	res.Kubelets, err = CheckNodes(ctx, kubectl, res.Kubeconfig, u.To.Kubernetes, cps+workers)
	if err != nil {
		return lab, res, err
	}
	phase("kubectl check", t0)
	return lab, res, nil
}

// wait watches the lab until done, for at most PhaseTimeout. A machine in
// phase Failed ends the wait at once: the controller does not retry it.
func (u *MinorUpgrade) wait(ctx context.Context, lab *Lab, cluster string, done func(*Snapshot) bool) error {
	wctx, cancel := context.WithTimeout(ctx, u.PhaseTimeout)
	defer cancel()
	s, err := lab.Watch(wctx, cluster, 2*time.Second, func(s *Snapshot) bool { return done(s) || FailedMachine(s) != "" })
	if err != nil {
		return fmt.Errorf("%w\n(kilnctl describe cluster %s shows every condition; the controller log is %s)", err, cluster, lab.ControllerLog())
	}
	if f := FailedMachine(s); f != "" {
		return fmt.Errorf("lab upgrade: %s\n(kilnctl describe machine shows its events; the controller log is %s)", f, lab.ControllerLog())
	}
	return nil
}

// FailedMachine describes the first machine in phase Failed (name, host,
// version and the message of its BootstrapFailed condition), or "".
func FailedMachine(s *Snapshot) string {
	for _, n := range sortedKeys(s.Machines) {
		m := s.Machines[n]
		if m.GetStatus().GetPhase() != clusterexec.PhaseFailed {
			continue
		}
		msg := "no BootstrapFailed condition"
		if c := conditions.Get(m.GetStatus().GetConditions(), clusterexec.ConditionBootstrapFailed); c != nil {
			msg = c.GetReason() + ": " + c.GetMessage()
		}
		return fmt.Sprintf("machine %s (%s %s on host %s, image %s) failed: %s", n, m.GetSpec().GetRole(), m.GetSpec().GetVersion(), m.GetSpec().GetHost(), m.GetSpec().GetImage(), msg)
	}
	return ""
}

// roleAt is done when the cluster is Ready and exactly n machines of role
// exist, all at version on image with their node Ready and cluster DNS
// answering: the old ones are gone.
func roleAt(role, version, image string, n int) func(*Snapshot) bool {
	return func(s *Snapshot) bool {
		if !s.Ready() {
			return false
		}
		got := 0
		for _, m := range s.Machines {
			if m.GetSpec().GetRole() != role {
				continue
			}
			got++
			c := m.GetStatus().GetConditions()
			if m.GetSpec().GetVersion() != version || m.GetSpec().GetImage() != image ||
				!conditions.IsTrue(c, clusterplan.MachineNodeReady) || !conditions.IsTrue(c, clusterplan.MachineClusterDNSResolves) {
				return false
			}
		}
		return got == n
	}
}

// allAt is roleAt for the control plane and the workers.
func allAt(version, image string, controlPlanes, workers int) func(*Snapshot) bool {
	cp, w := roleAt(clusterplan.RoleControlPlane, version, image, controlPlanes), roleAt(clusterplan.RoleWorker, version, image, workers)
	return func(s *Snapshot) bool { return cp(s) && w(s) }
}

// CheckNodes asks the cluster with kubectl what a user checks after an
// upgrade: n nodes, each Ready with kubelet version; CoreDNS and kube-proxy
// fully available. It returns each node's kubelet version.
func CheckNodes(ctx context.Context, kubectl, kubeconfig, version string, n int) (map[string]string, error) {
	run := func(args ...string) ([]byte, error) {
		out, err := exec.CommandContext(ctx, kubectl, append([]string{"--kubeconfig", kubeconfig}, args...)...).CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
		}
		return out, nil
	}
	out, err := run("get", "nodes", "-o", "json")
	if err != nil {
		return nil, err
	}
	var nodes struct {
		Items []struct {
			Metadata struct{ Name string }
			Status   struct {
				NodeInfo   struct{ KubeletVersion string }
				Conditions []struct{ Type, Status string }
			}
		}
	}
	if err := json.Unmarshal(out, &nodes); err != nil {
		return nil, fmt.Errorf("kubectl get nodes: %w", err)
	}
	kubelets := map[string]string{}
	var problems []string
	for _, it := range nodes.Items {
		kubelets[it.Metadata.Name] = it.Status.NodeInfo.KubeletVersion
		if it.Status.NodeInfo.KubeletVersion != version {
			problems = append(problems, fmt.Sprintf("node %s runs kubelet %s", it.Metadata.Name, it.Status.NodeInfo.KubeletVersion))
		}
		ready := false
		for _, c := range it.Status.Conditions {
			ready = ready || c.Type == "Ready" && c.Status == "True"
		}
		if !ready {
			problems = append(problems, fmt.Sprintf("node %s is not Ready", it.Metadata.Name))
		}
	}
	if len(nodes.Items) != n {
		problems = append(problems, fmt.Sprintf("%d nodes, want %d", len(nodes.Items), n))
	}
	for _, w := range []struct{ kind, name, jsonpath string }{
		{"deployment", "coredns", "{.status.replicas} {.status.availableReplicas} {.status.updatedReplicas}"},
		{"daemonset", "kube-proxy", "{.status.desiredNumberScheduled} {.status.numberAvailable} {.status.updatedNumberScheduled}"},
	} {
		out, err := run("-n", "kube-system", "get", w.kind, w.name, "-o", "jsonpath="+w.jsonpath)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		f := strings.Fields(string(out))
		if len(f) < 2 || f[0] == "0" || f[0] != f[1] {
			img, _ := run("-n", "kube-system", "get", w.kind, w.name, "-o", "jsonpath={.spec.template.spec.containers[*].image}")
			problems = append(problems, fmt.Sprintf("%s %s: %s of %s available (image %s)", w.kind, w.name, at(f, 1), at(f, 0), strings.TrimSpace(string(img))))
		}
	}
	if len(problems) > 0 {
		return kubelets, fmt.Errorf("after the upgrade to %s: %s", version, strings.Join(problems, "; "))
	}
	return kubelets, nil
}

func at(f []string, i int) string {
	if i < len(f) {
		return f[i]
	}
	return "?"
}

// LinkImages makes dst hold symbolic links to the image files of each
// LabImage directory, so one boot server serves them all.
func LinkImages(dst string, dirs ...string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return fmt.Errorf("images: %w", err)
	}
	for _, d := range dirs {
		ents, err := os.ReadDir(d)
		if err != nil {
			return fmt.Errorf("images: %w", err)
		}
		for _, e := range ents {
			if e.IsDir() || strings.HasPrefix(e.Name(), ".") {
				continue
			}
			link := filepath.Join(dst, e.Name())
			_ = os.Remove(link)
			if err := os.Symlink(filepath.Join(d, e.Name()), link); err != nil {
				return fmt.Errorf("images: %w", err)
			}
		}
	}
	return nil
}
