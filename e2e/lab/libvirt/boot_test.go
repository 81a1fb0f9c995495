package libvirt_test

import (
	"context"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/e2e/lab/libvirt"
	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia/bootmediatest"
	"github.com/kilnhq/kiln/internal/testenv"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// bootTimeout bounds one VM boot into the agent under TCG on a loaded
// 2-core machine.
const bootTimeout = 4 * time.Minute

var media struct {
	once sync.Once
	dir  string
}

// bootMedia builds the agent's boot media once per test process.
func bootMedia(t testing.TB) string {
	t.Helper()
	if testing.Short() {
		t.Skip("boots a VM")
	}
	libvirtSocket(t)
	media.once.Do(func() {
		dir, err := os.MkdirTemp("", "kiln-libvirt-media-")
		require.NoError(t, err)
		media.dir = dir
		bootmediatest.Build(t, dir)
	})
	if _, err := os.Stat(filepath.Join(media.dir, bootmedia.ManifestFile)); err != nil {
		testenv.Skip(t, "boot media could not be built (see the first boot test)")
	}
	return media.dir
}

// tokens issues the controller's one-time enrollment tokens, bound to the
// host.
type tokens struct{ env *controllertest.Env }

func (i tokens) BootToken(ctx context.Context, host string) (string, error) {
	tok, _, err := i.env.Controller.CreateToken(ctx, 30*time.Minute, host, "boot media of "+host)
	return tok, err
}

// waitEnrolled waits until the host's boot agent has enrolled and sent a
// heartbeat.
func waitEnrolled(t testing.TB, env *controllertest.Env, vm *libvirt.VM, host string) *typesv1.Host {
	t.Helper()
	deadline := time.Now().Add(bootTimeout)
	for time.Now().Before(deadline) {
		h := &typesv1.Host{}
		if _, err := env.Store().Get(context.Background(), enrollment.HostsKind, host, h); err == nil &&
			h.GetStatus().GetAgent().GetLastHeartbeat() != nil {
			return h
		}
		time.Sleep(500 * time.Millisecond)
	}
	b, _ := os.ReadFile(vm.SerialLog())
	t.Fatalf("host %s did not enroll and check in within %s; serial console:\n%s", host, bootTimeout, tail(string(b), 40))
	return nil
}

// bootResult is what a boot into the agent gave.
type bootResult struct {
	vm   *libvirt.VM
	host *typesv1.Host
	// agentUp is the time from power on to "kiln-init: agent up" on the
	// serial console; enrolled to the agent's first heartbeat.
	agentUp, enrolled time.Duration
}

// bootISO boots a libvirt domain named name from its per-host ISO (the
// boot server's URL, downloaded into the VM's directory) on user-mode
// networking, where the guest reaches the controller on the host's
// loopback as 10.0.2.2.
func bootISO(tb testing.TB, name string, uefi bool) *bootResult {
	dir := bootMedia(tb)
	env := controllertest.Start(tb)
	_, port, err := net.SplitHostPort(env.Addr)
	require.NoError(tb, err)
	bs, err := bootserver.New(bootserver.Options{
		MediaDir:       dir,
		ControllerAddr: "10.0.2.2:" + port,
		CAHash:         env.CAHash,
		Tokens:         tokens{env},
		ISOCacheDir:    tb.TempDir(),
	})
	require.NoError(tb, err)
	ts := httptest.NewServer(bs)
	tb.Cleanup(func() { ts.Close(); bs.Close() })

	vm := newVM(tb, libvirt.Options{Name: name, DiskSize: 64 << 20, UEFI: uefi, GracePeriod: 90 * time.Second})
	require.NoError(tb, vm.InsertMedia(bootserver.ISOURL(ts.URL, name)))
	t0 := time.Now()
	require.NoError(tb, vm.PowerOn(context.Background(), machine.BootCD))

	r := &bootResult{vm: vm}
	stop := make(chan struct{})
	up := make(chan time.Duration, 1)
	go func() {
		for {
			if b, _ := os.ReadFile(vm.SerialLog()); strings.Contains(string(b), "kiln-init: agent up") {
				up <- time.Since(t0)
				return
			}
			select {
			case <-stop:
				up <- 0
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	r.host = waitEnrolled(tb, env, vm, name)
	r.enrolled = time.Since(t0)
	close(stop)
	r.agentUp = <-up
	return r
}

// TestISOBootEnrolls boots the agent ISO in a libvirt domain: virtual
// media from the boot server, power on from CD through libvirtd, and the
// boot agent enrolls with the controller with the ISO's one-time token and
// reports boot source virtualmedia. Then a graceful power off reaches the
// guest's power button handler and the domain is shut off.
func TestISOBootEnrolls(t *testing.T) {
	_, err := os.Stat("/usr/share/OVMF/OVMF_CODE_4M.fd")
	uefi := err == nil
	if !uefi {
		t.Log("OVMF not installed (apt-get install ovmf): booting the ISO under BIOS")
	}
	r := bootISO(t, "kiln-lv-iso", uefi)
	h := r.host
	if got := h.GetStatus().GetAgent().GetBootSource(); got != "virtualmedia" {
		t.Errorf("host reports boot source %q, want virtualmedia", got)
	}
	if got := h.GetStatus().GetFacts().GetOsId(); got != "kiln-boot" {
		t.Errorf("host facts os_id %q, want kiln-boot (the boot media's os-release)", got)
	}
	if r.agentUp == 0 {
		t.Errorf("serial console lacks kiln-init: agent up")
	}
	t.Logf("libvirt ISO boot (uefi=%v): agent up after %.1fs, enrolled after %.1fs", uefi, r.agentUp.Seconds(), r.enrolled.Seconds())
	if !r.vm.State() || r.vm.BootSource() != machine.BootCD {
		t.Errorf("State() = %v BootSource() = %q, want on from cd", r.vm.State(), r.vm.BootSource())
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	require.NoError(t, r.vm.PowerOff(ctx, true))
	if r.vm.State() {
		t.Errorf("State() after a graceful PowerOff = on")
	}
	if b, _ := os.ReadFile(r.vm.SerialLog()); !strings.Contains(string(b), "kiln-init: power button") {
		t.Errorf("graceful power off did not reach the guest (no power button message); power was cut")
	}
}

// BenchmarkISOBoot measures power on to "agent up" on the serial console
// and to the agent's first heartbeat for a libvirt domain booting the
// agent ISO. Run with -benchtime=1x: one boot is 10-40 s under TCG.
func BenchmarkISOBoot(b *testing.B) {
	for _, uefi := range []bool{false, true} {
		name := "bios"
		if uefi {
			name = "uefi"
		}
		b.Run(name, func(b *testing.B) {
			var up, enrolled time.Duration
			for i := range b.N {
				r := bootISO(b, "kiln-lv-bench-"+name+"-"+string(rune('a'+i%26)), uefi)
				up += r.agentUp
				enrolled += r.enrolled
				require.NoError(b, r.vm.PowerOff(context.Background(), false)) // one VM at a time
			}
			b.ReportMetric(up.Seconds()/float64(b.N), "s-to-agent-up")
			b.ReportMetric(enrolled.Seconds()/float64(b.N), "s-to-enrolled")
		})
	}
}
