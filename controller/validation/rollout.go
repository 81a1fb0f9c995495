package validation

import (
	"fmt"
	"strings"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// DefaultWaveLabel is the Cluster label a Rollout orders its waves by when
// spec.waveLabel is empty (Cluster API's convention).
const DefaultWaveLabel = "upgrade-wave"

// checkRollout checks a Rollout spec on its own: exactly one change (a
// Kubernetes version, an image or image selector, or a class and its
// revision), a selector and wave label that are label keys, durations that
// parse, maxConcurrent at least 1 when set (0 means the default, 1), and
// halt conditions with a type and a status.
func checkRollout(p *problems, s *typesv1.RolloutSpec) {
	c := s.GetChange()
	var changes []string
	if c.GetKubernetesVersion() != "" {
		changes = append(changes, "kubernetesVersion")
		if _, err := ParseVersion(c.GetKubernetesVersion()); err != nil {
			p.add("spec.change.kubernetesVersion", "%v", err)
		}
	}
	if c.GetImage() != "" || len(c.GetImageSelector()) > 0 {
		changes = append(changes, "image")
		if c.GetImage() != "" && len(c.GetImageSelector()) > 0 {
			p.add("spec.change.imageSelector", "set together with spec.change.image %q: name the image or choose it by labels, not both", c.GetImage())
		}
		if img := c.GetImage(); img != "" {
			if msg := dnsSubdomain(img); msg != "" {
				p.add("spec.change.image", "%q %s: name an Image resource", img, msg)
			}
		}
		checkLabels(p, "spec.change.imageSelector", c.GetImageSelector())
	}
	if c.GetClusterClass() != "" || c.GetClassRevision() != 0 {
		changes = append(changes, "clusterClass")
		switch {
		case c.GetClusterClass() == "":
			p.add("spec.change.clusterClass", "required with spec.change.classRevision: the ClusterClass whose clusters move")
		case dnsSubdomain(c.GetClusterClass()) != "":
			p.add("spec.change.clusterClass", "%q %s", c.GetClusterClass(), dnsSubdomain(c.GetClusterClass()))
		}
		if c.GetClassRevision() < 1 {
			p.add("spec.change.classRevision", "%d: name the class revision the clusters move to (1 or more; kilnctl get clusterclass shows it)", c.GetClassRevision())
		}
	}
	switch len(changes) {
	case 0:
		p.add("spec.change", "required: one of kubernetesVersion, image (or imageSelector), or clusterClass with classRevision")
	case 1:
	default:
		p.add("spec.change", "sets %s: a Rollout carries exactly one change; make one Rollout per change", strings.Join(changes, " and "))
	}
	checkLabels(p, "spec.clusterSelector", s.GetClusterSelector())
	if l := s.GetWaveLabel(); l != "" {
		if msg := labelKey(l); msg != "" {
			p.add("spec.waveLabel", "%q %s", l, msg)
		}
	}
	if b := s.GetBake(); b != "" {
		checkDuration(p, "spec.bake", b, true)
	}
	if m := s.GetMaxConcurrent(); m < 0 {
		p.add("spec.maxConcurrent", "%d: use 1 or more (how many clusters of a wave move at once; default 1)", m)
	}
	if r := s.GetResume(); r < 0 {
		p.add("spec.resume", "%d is negative: kilnctl rollout resume counts it up from 0", r)
	}
	h := s.GetHalt()
	if d := h.GetReadyTimeout(); d != "" {
		checkDuration(p, "spec.halt.readyTimeout", d, false)
	}
	for i, c := range h.GetConditions() {
		f := fmt.Sprintf("spec.halt.conditions[%d]", i)
		if c.GetType() == "" {
			p.add(f+".type", "required: a condition of the Cluster, its ControlPlane or MachineDeployments, such as Ready or UpgradeAllowed")
		}
		switch c.GetStatus() {
		case "True", "False", "Unknown":
		case "":
			p.add(f+".status", "required: use True, False or Unknown")
		default:
			p.add(f+".status", "%q is not a condition status: use True, False or Unknown", c.GetStatus())
		}
		if d := c.GetTimeout(); d != "" {
			checkDuration(p, f+".timeout", d, true)
		}
	}
}
