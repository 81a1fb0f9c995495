package domainbmc_test

import (
	"context"
	"fmt"
	"net"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/e2e/lab/domainbmc"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia/bootmediatest"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// bootTimeout bounds one VM boot into the agent under TCG on a loaded
// 2-core machine.
const bootTimeout = 5 * time.Minute

// tokens issues the controller's one-time enrollment tokens, bound to the
// host.
type tokens struct{ env *controllertest.Env }

func (i tokens) BootToken(ctx context.Context, host string) (string, error) {
	tok, _, err := i.env.Controller.CreateToken(ctx, 30*time.Minute, host, "boot media of "+host)
	return tok, err
}

// TestAgentEnrollsThroughDomainBMC is a CI's own domain (defined with
// virsh) booted into Kiln's agent through the BMC served in front of it,
// as the controller's host lifecycle does it: the host's ISO from the boot
// server as virtual media, a one-time CD boot, power on. The agent
// enrolls with the controller using the ISO's one-time token and reports
// boot source virtualmedia; power off through the BMC shuts the domain off.
func TestAgentEnrollsThroughDomainBMC(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: boots a VM")
	}
	sock := libvirtSocket(t)
	media := t.TempDir()
	bootmediatest.Build(t, media)
	env := controllertest.Start(t)
	_, port, err := net.SplitHostPort(env.Addr)
	require.NoError(t, err)
	bs, err := bootserver.New(bootserver.Options{
		MediaDir: media, ControllerAddr: "10.0.2.2:" + port, CAHash: env.CAHash,
		Tokens: tokens{env}, ISOCacheDir: t.TempDir(),
	})
	require.NoError(t, err)
	ts := httptest.NewServer(bs)
	t.Cleanup(func() { ts.Close(); bs.Close() })

	dir := t.TempDir()
	dom := fmt.Sprintf("kiln-dbmc-boot-%d", os.Getpid()%100000)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "disk.raw"), nil, 0o644))
	require.NoError(t, os.Truncate(filepath.Join(dir, "disk.raw"), 64<<20))
	xml := strings.Replace(fmt.Sprintf(domainXML, dom, dir, "<boot dev='hd'/>", ""), "256", "1024", 1)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "domain.xml"), []byte(xml), 0o644))
	virsh := func(args ...string) (string, error) {
		out, err := exec.Command("virsh", append([]string{"-c", "qemu:///system?socket=" + sock}, args...)...).CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	out, err := virsh("define", filepath.Join(dir, "domain.xml"))
	require.NoError(t, err, "virsh define: %s", out)
	t.Cleanup(func() {
		_, _ = virsh("destroy", dom)
		_, _ = virsh("undefine", dom)
		_ = os.Remove(filepath.Join("/var/log/libvirt/qemu", dom+".log"))
	})

	const password = "enroll-bmc-pw"
	srv, err := domainbmc.Start(context.Background(), domainbmc.Options{Domains: []string{dom}, Password: password, Socket: sock, Dir: t.TempDir()})
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), bootTimeout)
	defer cancel()
	b, err := bmc.Dial(ctx, bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: srv.BMCs()[0].Redfish,
		Username: "admin", Password: password, InsecureSkipVerify: true}, bmc.Options{Name: dom})
	require.NoError(t, err)

	// The host is named after the domain: its ISO carries kiln.host=DOM.
	require.NoError(t, b.InsertVirtualMedia(ctx, bootserver.ISOURL(ts.URL, dom)))
	require.NoError(t, b.SetBootDevice(ctx, bmc.BootCDROM, false, false))
	t0 := time.Now()
	require.NoError(t, b.PowerOn(ctx))
	var h *typesv1.Host
	for h == nil {
		got := &typesv1.Host{}
		if _, err := env.Store().Get(ctx, enrollment.HostsKind, dom, got); err == nil && got.GetStatus().GetAgent().GetLastHeartbeat() != nil {
			h = got
			break
		}
		select {
		case <-ctx.Done():
			serial, _ := os.ReadFile(filepath.Join(dir, "serial.log"))
			t.Fatalf("the agent of %s did not enroll within %s; serial console:\n%s", dom, bootTimeout, serial)
		case <-time.After(500 * time.Millisecond):
		}
	}
	enrolled := time.Since(t0)
	serial, _ := os.ReadFile(filepath.Join(dir, "serial.log"))
	require.Contains(t, string(serial), "kiln-init: agent up")
	src := h.GetStatus().GetAgent().GetBootSource()
	require.NoError(t, bmc.VerifyBoot(bmc.BootCDROM, src), "boot source %q", src)
	t.Logf("domain %s: power on through its BMC to the agent enrolled: %.1fs", dom, enrolled.Seconds())

	require.NoError(t, b.PowerOff(ctx))
	st, err := virsh("domstate", dom)
	require.NoError(t, err, st)
	require.Equal(t, "shut off", st)
}
