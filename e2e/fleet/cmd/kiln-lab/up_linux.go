package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kilnhq/kiln/e2e/fleet"
)

func up(ctx context.Context, f *flags) error {
	t0 := time.Now()
	cluster, err := os.ReadFile(f.cluster)
	if err != nil {
		return fmt.Errorf("cluster file: %w", err)
	}
	step := func(format string, args ...any) {
		fmt.Printf("lab: [%4ds] "+format+"\n", append([]any{int(time.Since(t0).Seconds())}, args...)...)
	}
	step("boot media (kiln-imagebuilder bootmedia) into %s", filepath.Join(f.dir, "media"))
	if err := fleet.BootMedia(ctx, filepath.Join(f.bin, "kiln-imagebuilder"), filepath.Join(f.bin, "kiln-agent"), filepath.Join(f.dir, "media"), os.Stdout); err != nil {
		return err
	}
	step("lab image (kiln-imagebuilder build -f %s): cached after the first build", f.imageSpec)
	imageDir, img, err := labImage(ctx, f)
	if err != nil {
		return err
	}
	lab, err := f.lab(imageDir)
	if err != nil {
		return err
	}
	step("rack and controller")
	if err := lab.Up(ctx); err != nil {
		return fmt.Errorf("%w\n(make lab-down removes what was created)", err)
	}
	resource, err := fleet.ImageResource(img, lab.BootURL())
	if err != nil {
		return err
	}
	if _, err := lab.Kilnctl(ctx, resource, "apply", "-f", "-"); err != nil {
		return err
	}
	step("applying %s (controlPlaneEndpoint: the lab's API load balancer %s)", f.cluster, lab.APIServerEndpoint())
	cluster, err = fleet.ClusterForLab(cluster, lab.APIServerEndpoint())
	if err != nil {
		return fmt.Errorf("cluster file %s: %w", f.cluster, err)
	}
	out, err := lab.Kilnctl(ctx, cluster, "apply", "-f", "-")
	if err != nil {
		return err
	}
	fmt.Print(out)
	step("provisioning: powering hosts through their BMCs, laying the image, kubeadm (progress below; the controller log is %s)", lab.ControllerLog())
	wctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	if _, err := lab.WatchStall(wctx, f.clusterName, 2*time.Second, f.stallTimeout, (*fleet.Snapshot).Ready); err != nil {
		// Show what the user would look at next, then fail.
		dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer dcancel()
		describe, derr := lab.Kilnctl(dctx, nil, "describe", "cluster", f.clusterName)
		if derr != nil {
			describe = derr.Error()
		}
		fmt.Printf("\n$ kilnctl describe cluster %s\n%s\n", f.clusterName, describe)
		return fmt.Errorf("%w\n(export KILNCONFIG=%s; kilnctl describe cluster %s shows every condition; the controller log is %s; make lab-down removes the lab)",
			err, lab.Kilnconfig(), f.clusterName, lab.ControllerLog())
	}
	kubeconfig := filepath.Join(f.dir, "kubeconfig")
	if _, err := lab.Kilnctl(ctx, nil, "kubeconfig", f.clusterName, "-o", kubeconfig); err != nil {
		return err
	}
	step("cluster %s is Ready and its DNS answers on every node", f.clusterName)
	fmt.Printf(`
Use it:
  export KILNCONFIG=%s
  kilnctl get hosts
  kilnctl describe cluster %s
  kilnctl get machines
  KUBECONFIG=%s kubectl get nodes -o wide     (kubectl is in the kube-tools cache)
Lab:
  kilnctl lab status --name %s --state-dir %s
  controller log: %s
Remove it:
  make lab-down
`, lab.Kilnconfig(), f.clusterName, kubeconfig, f.name, lab.StateDir(), lab.ControllerLog())
	return nil
}
