package clusterexec_test

import (
	"fmt"
	"testing"
)

// BenchmarkReconcileSteady is one pass of the executor over a converged
// cluster (1 control plane + N workers, real embedded etcd, simulated
// agents): list, plan, store unchanged status (skipped), probe every
// machine.
func BenchmarkReconcileSteady(b *testing.B) {
	for _, workers := range []int{10, 50} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			w := newWorld(b, 0)
			w.apply(workers+1, 1, workers)
			stop := w.start()
			w.waitRunning(workers + 1)
			stop()
			ex := w.executor()
			b.ResetTimer()
			for b.Loop() {
				if err := ex.Reconcile(w.ctx, "c1"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
