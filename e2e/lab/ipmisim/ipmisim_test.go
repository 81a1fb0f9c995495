package ipmisim_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/testenv"
)

func ipmitool(t *testing.T, sim *ipmisim.Sim, password string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	full := append([]string{"-I", "lanplus", "-C", "3", "-H", "127.0.0.1", "-p", fmt.Sprint(sim.Port()), "-U", "lab", "-E"}, args...)
	cmd := exec.CommandContext(ctx, "ipmitool", full...)
	cmd.Env = []string{"IPMITOOL_PASSWORD=" + password}
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func TestSimDrivesMachine(t *testing.T) {
	for _, tool := range []string{"ipmi_sim", "ipmitool"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian packages openipmi and ipmitool)", tool)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	chassis, err := ipmisim.BuildChassis(ctx, t.TempDir())
	require.NoError(t, err)
	m := &machine.Memory{}
	sim, err := ipmisim.Start(ctx, ipmisim.Options{User: "lab", Password: "lab-pw-1", ChassisProgram: chassis, Machine: m})
	require.NoError(t, err)
	dir := sim.Dir()
	pid := sim.PID()

	steps := []struct {
		args []string
		want string
	}{
		{[]string{"chassis", "power", "status"}, "Chassis Power is off"},
		{[]string{"chassis", "bootdev", "pxe"}, "Set Boot Device to pxe"},
		{[]string{"chassis", "power", "on"}, "Chassis Power Control: Up/On"},
		{[]string{"chassis", "power", "status"}, "Chassis Power is on"},
		{[]string{"chassis", "power", "off"}, "Chassis Power Control: Down/Off"},
	}
	for _, s := range steps {
		out, err := ipmitool(t, sim, "lab-pw-1", s.args...)
		if err != nil || out != s.want {
			t.Fatalf("ipmitool %s = %q, %v; want %q", strings.Join(s.args, " "), out, err, s.want)
		}
	}
	var ev []string
	for _, e := range m.Events() {
		ev = append(ev, e.String())
	}
	if strings.Join(ev, " ") != "on:pxe off" {
		t.Fatalf("machine events = %v, want [on:pxe off]", ev)
	}
	if _, err := ipmitool(t, sim, "wrong-pw", "chassis", "power", "on"); err == nil {
		t.Fatalf("ipmitool with a wrong password succeeded")
	}
	if m.State() {
		t.Fatalf("a wrong password powered the machine on")
	}

	sim.Stop()
	if syscall.Kill(pid, 0) == nil {
		t.Fatalf("ipmi_sim pid %d still running after Stop", pid)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("Stop left %s behind", dir)
	}
}
