package libvirt

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// TestLocalMedia checks how InsertMedia's argument becomes the file
// libvirt is given, without a libvirtd.
func TestLocalMedia(t *testing.T) {
	dir := t.TempDir()
	iso := filepath.Join(dir, "agent.iso")
	require.NoError(t, os.WriteFile(iso, []byte("iso"), 0o644))
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/boot/a.iso" {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write([]byte("downloaded iso"))
	}))
	defer ts.Close()
	v := &VM{o: Options{Dir: dir}}

	for _, tc := range []struct {
		in      string
		want    string // "" with wantErr nil: eject
		content string
		wantErr func(error) bool
	}{
		{in: "", want: ""},
		{in: iso, want: iso},
		{in: "file://" + iso, want: iso},
		{in: ts.URL + "/boot/a.iso", want: filepath.Join(dir, "media-1.iso"), content: "downloaded iso"},
		{in: ts.URL + "/boot/missing.iso", wantErr: errdefs.IsUnavailable},
		{in: "agent.iso", wantErr: errdefs.IsInvalidArgument},
		{in: "nfs://server/agent.iso", wantErr: errdefs.IsInvalidArgument},
		{in: filepath.Join(dir, "missing.iso"), wantErr: errdefs.IsNotFound},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := v.localMedia(tc.in)
			if tc.wantErr != nil {
				if !tc.wantErr(err) {
					t.Fatalf("localMedia(%q) = %q, %v, want a %s error", tc.in, got, err, "typed")
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("localMedia(%q) = %q, %v, want %q", tc.in, got, err, tc.want)
			}
			if tc.content != "" {
				b, err := os.ReadFile(got)
				require.NoError(t, err)
				if string(b) != tc.content {
					t.Fatalf("localMedia(%q) downloaded %q, want %q", tc.in, b, tc.content)
				}
			}
		})
	}
	if _, err := os.Stat(filepath.Join(dir, "media-2.iso.part")); !os.IsNotExist(err) {
		t.Errorf("a failed download left its partial file: %v", err)
	}
}

// TestRedact keeps passwords in media URLs out of logs and errors.
func TestRedact(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"http://10.0.2.2:8080/boot/iso/h1.iso", "http://10.0.2.2:8080/boot/iso/h1.iso"},
		{"https://admin:s3cret@media.lab/h1.iso", "https://admin:xxxxx@media.lab/h1.iso"},
	} {
		if got := redact(tc.in); got != tc.want || strings.Contains(got, "s3cret") {
			t.Errorf("redact(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestBootOrder: the requested device is first, the others keep disk,
// NIC, CD order, and every order is unique.
func TestBootOrder(t *testing.T) {
	for _, tc := range []struct {
		dev             string
		disk, pxe, cdro uint
	}{
		{"disk", 1, 2, 3},
		{"pxe", 2, 1, 3},
		{"cd", 2, 3, 1},
	} {
		got := bootOrder(tc.dev)
		if got["disk"] != tc.disk || got["pxe"] != tc.pxe || got["cd"] != tc.cdro {
			t.Errorf("bootOrder(%q) = %v, want disk %d pxe %d cd %d", tc.dev, got, tc.disk, tc.pxe, tc.cdro)
		}
	}
}

// TestDialUnreachable: no libvirtd at the socket is an Unavailable error
// that says what to install and start.
func TestDialUnreachable(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "libvirt-sock")
	_, err := Dial(sock, "")
	if !errdefs.IsUnavailable(err) {
		t.Fatalf("Dial(%q) = %v, want Unavailable", sock, err)
	}
	if !strings.Contains(err.Error(), "libvirtd not reachable at "+sock+" (install libvirt-daemon-system and start libvirtd)") {
		t.Errorf("Dial(%q) error %q does not say how to fix it", sock, err)
	}
	_, err = New(Options{Name: "x", Dir: t.TempDir(), DiskSize: 1 << 20, Socket: sock})
	if !errdefs.IsUnavailable(err) {
		t.Errorf("New() without libvirtd = %v, want Unavailable", err)
	}
}

// TestNewValidates: bad options fail before libvirtd is asked.
func TestNewValidates(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "libvirt-sock")
	for _, tc := range []struct {
		name string
		o    Options
		want func(error) bool
	}{
		{"no name", Options{Dir: t.TempDir(), Socket: sock}, errdefs.IsInvalidArgument},
		{"no dir", Options{Name: "x", Socket: sock}, errdefs.IsInvalidArgument},
		{"missing firmware", Options{Name: "x", Dir: t.TempDir(), Socket: sock, UEFI: true, UEFICode: "/nonexistent/OVMF_CODE.fd"}, errdefs.IsNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(tc.o); !tc.want(err) {
				t.Errorf("New(%s) = %v, want a typed error", tc.name, err)
			}
		})
	}
}

// TestSetBootDevice: an existing domain's boot order changes the way its
// definition already expresses it, and a missing device is refused.
func TestSetBootDevice(t *testing.T) {
	osBoot := func(devs ...string) *libvirtxml.DomainOS {
		o := &libvirtxml.DomainOS{}
		for _, d := range devs {
			o.BootDevices = append(o.BootDevices, libvirtxml.DomainBootDevice{Dev: d})
		}
		return o
	}
	devices := func(cd bool, diskOrder uint) *libvirtxml.DomainDeviceList {
		l := &libvirtxml.DomainDeviceList{
			Disks:      []libvirtxml.DomainDisk{{Device: "disk"}, {Device: "disk"}},
			Interfaces: []libvirtxml.DomainInterface{{}},
		}
		if diskOrder > 0 {
			l.Disks[1].Boot = &libvirtxml.DomainDeviceBoot{Order: diskOrder}
		}
		if cd {
			l.Disks = append(l.Disks, libvirtxml.DomainDisk{Device: "cdrom"})
		}
		return l
	}
	order := func(b *libvirtxml.DomainDeviceBoot) uint {
		if b == nil {
			return 0
		}
		return b.Order
	}
	for _, tc := range []struct {
		name, dev string
		d         libvirtxml.Domain
		// wantOS is the <os><boot dev> list; else the orders of disk 0,
		// disk 1, the NIC and the CD drive.
		wantOS    []string
		wantOrder [4]uint
		wantErr   bool
	}{
		{name: "os boot cd", dev: machine.BootCD, d: libvirtxml.Domain{OS: osBoot("hd"), Devices: devices(true, 0)}, wantOS: []string{"cdrom", "hd"}},
		{name: "os boot back to disk", dev: machine.BootDisk, d: libvirtxml.Domain{OS: osBoot("cdrom", "hd", "network"), Devices: devices(true, 0)}, wantOS: []string{"hd", "cdrom", "network"}},
		{name: "device order cd", dev: machine.BootCD, d: libvirtxml.Domain{OS: osBoot(), Devices: devices(true, 1)}, wantOrder: [4]uint{0, 2, 3, 1}}, // disk 1 was the boot disk
		{name: "device order pxe", dev: machine.BootPXE, d: libvirtxml.Domain{OS: osBoot(), Devices: devices(true, 0)}, wantOrder: [4]uint{2, 0, 1, 3}},
		{name: "no cd drive", dev: machine.BootCD, d: libvirtxml.Domain{OS: osBoot(), Devices: devices(false, 0)}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := setBootDevice(&tc.d, tc.dev)
			if tc.wantErr {
				if !errdefs.IsFailedPrecondition(err) {
					t.Fatalf("setBootDevice(%q) = %v, want FailedPrecondition", tc.dev, err)
				}
				return
			}
			require.NoError(t, err)
			if tc.wantOS != nil {
				var got []string
				for _, b := range tc.d.OS.BootDevices {
					got = append(got, b.Dev)
				}
				require.Equal(t, tc.wantOS, got, "setBootDevice(%q): <os><boot dev>", tc.dev)
				return
			}
			ds := tc.d.Devices
			got := [4]uint{order(ds.Disks[0].Boot), order(ds.Disks[1].Boot), order(ds.Interfaces[0].Boot), order(ds.Disks[2].Boot)}
			if got != tc.wantOrder {
				t.Errorf("setBootDevice(%q): boot orders (disk0, disk1, nic, cd) = %v, want %v", tc.dev, got, tc.wantOrder)
			}
		})
	}
}
