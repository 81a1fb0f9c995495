package fleet

import (
	"bytes"
	"fmt"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// PreviousLabSpec is examples/images/lab-previous.yaml in the source tree
// this package was built from: the lab image at the previous Kubernetes
// minor (kubetools.Previous), the "from" side of a minor upgrade.
func PreviousLabSpec() string {
	return filepath.Join(filepath.Dir(DefaultLabSpec()), "lab-previous.yaml")
}

// ClusterDocs is a cluster file (examples/lab-cluster.yaml): YAML
// documents of a Cluster, its ControlPlane and MachineDeployments.
type ClusterDocs struct {
	docs []map[string]any
}

// ParseClusterDocs parses a cluster file. It returns InvalidArgument when
// a document is not YAML or there is not exactly one Cluster and one
// ControlPlane.
func ParseClusterDocs(b []byte) (*ClusterDocs, error) {
	c := &ClusterDocs{}
	kinds := map[string]int{}
	for _, d := range bytes.Split(append([]byte("\n"), b...), []byte("\n---")) {
		if len(bytes.TrimSpace(stripComments(d))) == 0 {
			continue
		}
		var r map[string]any
		if err := yaml.Unmarshal(d, &r); err != nil {
			return nil, errdefs.InvalidArgument("cluster file: %v", err)
		}
		kind, _ := r["kind"].(string)
		kinds[kind]++
		c.docs = append(c.docs, r)
	}
	if kinds["Cluster"] != 1 || kinds["ControlPlane"] != 1 {
		return nil, errdefs.InvalidArgument("cluster file: want one Cluster and one ControlPlane, found %d and %d", kinds["Cluster"], kinds["ControlPlane"])
	}
	return c, nil
}

func stripComments(b []byte) []byte {
	var out [][]byte
	for _, l := range bytes.Split(b, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(l), []byte("#")) {
			out = append(out, l)
		}
	}
	return bytes.Join(out, []byte("\n"))
}

func (c *ClusterDocs) spec(d map[string]any) map[string]any {
	s, _ := d["spec"].(map[string]any)
	if s == nil {
		s = map[string]any{}
		d["spec"] = s
	}
	return s
}

// Name is the Cluster's name.
func (c *ClusterDocs) Name() string {
	for _, d := range c.docs {
		if d["kind"] == "Cluster" {
			m, _ := d["metadata"].(map[string]any)
			n, _ := m["name"].(string)
			return n
		}
	}
	return ""
}

// At sets every version and image: the Cluster's kubernetesVersion and the
// ControlPlane's and MachineDeployments' version and image. It also sets
// the ControlPlane's rolloutMaxSurge to 1: a single control-plane member
// can only be replaced by joining its successor on a spare host first
// (docs/clusters.md, "Control-plane rollouts").
func (c *ClusterDocs) At(version, image string) {
	for _, d := range c.docs {
		s := c.spec(d)
		switch d["kind"] {
		case "Cluster":
			s["kubernetesVersion"] = version
		case "ControlPlane":
			s["version"], s["image"] = version, image
			delete(s, "imageSelector")
			s["rolloutMaxSurge"] = 1
		case "MachineDeployment":
			s["version"], s["image"] = version, image
			delete(s, "imageSelector")
		}
	}
}

// ControlPlaneEndpoint returns the Cluster's controlPlaneEndpoint.
func (c *ClusterDocs) ControlPlaneEndpoint() string {
	for _, d := range c.docs {
		if d["kind"] == "Cluster" {
			e, _ := c.spec(d)["controlPlaneEndpoint"].(string)
			return e
		}
	}
	return ""
}

// SetControlPlaneEndpoint sets the Cluster's controlPlaneEndpoint.
func (c *ClusterDocs) SetControlPlaneEndpoint(e string) {
	for _, d := range c.docs {
		if d["kind"] == "Cluster" {
			c.spec(d)["controlPlaneEndpoint"] = e
		}
	}
}

// Replicas returns the ControlPlane's replicas and the sum of the
// MachineDeployments' (1 when unset, as the controller defaults).
func (c *ClusterDocs) Replicas() (controlPlane, workers int) {
	for _, d := range c.docs {
		n := 1
		if v, ok := c.spec(d)["replicas"].(float64); ok {
			n = int(v)
		}
		switch d["kind"] {
		case "ControlPlane":
			controlPlane += n
		case "MachineDeployment":
			workers += n
		}
	}
	return controlPlane, workers
}

// YAML renders the documents of the given kinds (all when none), in file
// order, for kilnctl apply -f -.
func (c *ClusterDocs) YAML(kinds ...string) ([]byte, error) {
	var out [][]byte
	for _, d := range c.docs {
		if len(kinds) > 0 && !contains(kinds, fmt.Sprint(d["kind"])) {
			continue
		}
		b, err := yaml.Marshal(d)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return bytes.Join(out, []byte("---\n")), nil
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if strings.EqualFold(x, s) {
			return true
		}
	}
	return false
}
