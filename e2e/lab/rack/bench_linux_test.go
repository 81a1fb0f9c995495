package rack

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
	"github.com/kilnhq/kiln/internal/testenv"
)

// BenchmarkUpDown measures `lab up` (supervisor process, guard, bridge,
// 2 Redfish + 1 IPMI hosts) followed by `lab down`.
func BenchmarkUpDown(b *testing.B) {
	if os.Geteuid() != 0 {
		testenv.Skip(b, "needs root")
	}
	if _, err := exec.LookPath("ipmi_sim"); err != nil {
		testenv.Skip(b, "ipmi_sim not installed")
	}
	ctx := context.Background()
	chassis, err := ipmisim.BuildChassis(ctx, b.TempDir())
	if err != nil {
		testenv.Skip(b, err)
	}
	name := fmt.Sprintf("b%d", os.Getpid()%100000)
	for b.Loop() {
		dir := filepath.Join(b.TempDir(), "lab")
		if _, err := Up(ctx, Options{Name: name, Hosts: 2, IPMI: 1, StateDir: dir, DiskSize: 1 << 30,
			ServeCommand: []string{os.Args[0], "-test.run=^$"}, ServeEnv: []string{serveEnv + "=" + dir},
			ChassisCommand: []string{chassis}}); err != nil {
			b.Fatal(err)
		}
		if err := Down(ctx, dir, nil); err != nil {
			b.Fatal(err)
		}
	}
}
