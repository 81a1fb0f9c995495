package main

import (
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/clusterexec"
)

// execFlags are the cluster executor's flags (controller/clusterexec).
type execFlags struct {
	clusterWorkers int
	longActions    int
	drainTimeout   time.Duration
}

func (f *execFlags) bind(cmd *cobra.Command) {
	cmd.Flags().IntVar(&f.clusterWorkers, "cluster-workers", 8, "clusters the cluster executor reconciles at once (one cluster never by two)")
	cmd.Flags().IntVar(&f.longActions, "long-actions", 16, "drains, etcd member removals and machine deletions (kubeadm reset) that run at once across clusters, at most one per cluster")
	cmd.Flags().DurationVar(&f.drainTimeout, "drain-timeout", clusterexec.DefaultDrainTimeout, "deadline of a control-plane drain, and of a MachineDeployment drain without nodeDrainTimeout; past it the removal halts with Drained=False (DrainTimeout) and the drain is retried")
}

func (f *execFlags) apply(cfg *controller.Config) {
	cfg.ClusterWorkers = f.clusterWorkers
	cfg.LongActions = f.longActions
	cfg.DrainTimeout = f.drainTimeout
}
