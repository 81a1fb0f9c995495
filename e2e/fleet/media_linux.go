package fleet

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"
)

// BootMedia builds the agent boot media (kernel, initramfs, ISO) into dir
// with `kiln-imagebuilder bootmedia`, unless dir already holds media built
// from the same agent binary. The build goes to a temporary directory
// renamed into place, so an interrupted build leaves nothing under dir.
func BootMedia(ctx context.Context, imagebuilder, agent, dir string, out io.Writer) error {
	sum, err := fileSHA256(agent)
	if err != nil {
		return fmt.Errorf("boot media: agent: %w", err)
	}
	stamp := filepath.Join(dir, ".agent-sha256")
	if b, err := os.ReadFile(stamp); err == nil && strings.TrimSpace(string(b)) == sum {
		fmt.Fprintf(out, "lab: boot media in %s are up to date\n", dir)
		return nil
	}
	tmp := dir + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, imagebuilder, "bootmedia", "-o", tmp, "--agent", agent)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("boot media: kiln-imagebuilder bootmedia: %w", err)
	}
	if err := os.WriteFile(filepath.Join(tmp, ".agent-sha256"), []byte(sum+"\n"), 0o644); err != nil {
		return err
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	// A directory, published whole by rename (internal/atomicfile writes
	// single files).
	return os.Rename(tmp, dir)
}

// ImageResource reads an Image resource written by kiln-imagebuilder
// (<tag>.image.yaml) and points its spec.url at the controller's boot
// server (bootURL/images/<file>), where the lab serves it.
func ImageResource(file, bootURL string) ([]byte, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("image resource: %w", err)
	}
	var r map[string]any
	if err := yaml.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("image resource %s: %w", file, err)
	}
	spec, _ := r["spec"].(map[string]any)
	u, _ := spec["url"].(string)
	if u == "" {
		return nil, fmt.Errorf("image resource %s: no spec.url", file)
	}
	spec["url"] = strings.TrimSuffix(bootURL, "/") + "/images/" + path.Base(u)
	out, err := yaml.Marshal(r)
	if err != nil {
		return nil, err
	}
	return bytes.TrimSpace(out), nil
}

// ClusterForLab returns the cluster manifests (YAML documents) with every
// Cluster's empty spec.controlPlaneEndpoint set to endpoint (the lab's API
// load balancer), so that its control plane can be replaced.
func ClusterForLab(manifests []byte, endpoint string) ([]byte, error) {
	var out [][]byte
	for _, d := range bytes.Split(manifests, []byte("\n---")) {
		if len(bytes.TrimSpace(d)) == 0 {
			continue
		}
		var r map[string]any
		if err := yaml.Unmarshal(d, &r); err != nil {
			return nil, err
		}
		if r["kind"] == "Cluster" {
			spec, _ := r["spec"].(map[string]any)
			if spec == nil {
				spec = map[string]any{}
				r["spec"] = spec
			}
			if ep, _ := spec["controlPlaneEndpoint"].(string); ep == "" {
				spec["controlPlaneEndpoint"] = endpoint
			}
		}
		b, err := yaml.Marshal(r)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return bytes.Join(out, []byte("---\n")), nil
}
