package diskhint

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// facts are the disks of a typical two-tier server: a boot SSD, two
// identical spinning data disks (no by-id of their own but a WWN each),
// an NVMe drive, and a USB stick.
func facts() []*typesv1.Disk {
	return []*typesv1.Disk{
		{Name: "sda", Path: "/dev/sda", SizeBytes: 480103981056, Model: "SAMSUNG MZ7LH480", Serial: "S45PNA0M512345", Wwn: "0x5002538e40a1b2c3",
			ByPath: []string{"/dev/disk/by-path/pci-0000:00:17.0-ata-1"}, ById: []string{"/dev/disk/by-id/ata-SAMSUNG_MZ7LH480_S45PNA0M512345", "/dev/disk/by-id/wwn-0x5002538e40a1b2c3"}},
		{Name: "sdb", Path: "/dev/sdb", SizeBytes: 4000787030016, Rotational: true, Model: "ST4000NM0035", Serial: "ZC11AAAA", Wwn: "0x5000c500a1111111",
			ByPath: []string{"/dev/disk/by-path/pci-0000:00:17.0-ata-2"}, ById: []string{"/dev/disk/by-id/wwn-0x5000c500a1111111"}},
		{Name: "sdc", Path: "/dev/sdc", SizeBytes: 4000787030016, Rotational: true, Model: "ST4000NM0035", Serial: "ZC11BBBB", Wwn: "0x5000c500a2222222",
			ByPath: []string{"/dev/disk/by-path/pci-0000:00:17.0-ata-3"}, ById: []string{"/dev/disk/by-id/wwn-0x5000c500a2222222"}},
		{Name: "nvme0n1", Path: "/dev/nvme0n1", SizeBytes: 960197124096, Model: "INTEL SSDPE2KX010T8", Serial: "PHLJ912345671P0FGN", Wwn: "eui.01000000010000005cd2e4a1b2c3d4e5",
			ByPath: []string{"/dev/disk/by-path/pci-0000:3b:00.0-nvme-1"}},
		{Name: "sdd", Path: "/dev/sdd", SizeBytes: 31004295168, Removable: true, Model: "Ultra Fit"},
	}
}

func rot(b bool) *bool { return &b }

// TestChoose is the hint table of docs/laying.md: each hint against the
// same facts, and the disk chosen or the refusal.
func TestChoose(t *testing.T) {
	tests := []struct {
		name string
		hint *typesv1.RootDeviceHints
		want string // disk path, or "" for a refusal
		err  []string
	}{
		{"device path", Parse("/dev/sdb"), "/dev/sdb", nil},
		{"by-path link", Parse("/dev/disk/by-path/pci-0000:00:17.0-ata-3"), "/dev/sdc", nil},
		{"by-id link", Parse("/dev/disk/by-id/ata-SAMSUNG_MZ7LH480_S45PNA0M512345"), "/dev/sda", nil},
		{"by-id wwn link", Parse("/dev/disk/by-id/wwn-0x5000c500a1111111"), "/dev/sdb", nil},
		{"serial (string form)", Parse("PHLJ912345671P0FGN"), "/dev/nvme0n1", nil},
		{"serial", &typesv1.RootDeviceHints{Serial: "ZC11BBBB"}, "/dev/sdc", nil},
		{"wwn", &typesv1.RootDeviceHints{Wwn: "0x5002538e40a1b2c3"}, "/dev/sda", nil},
		{"wwn, other case", &typesv1.RootDeviceHints{Wwn: "0X5002538E40A1B2C3"}, "/dev/sda", nil},
		{"size range", &typesv1.RootDeviceHints{MinSizeGigabytes: 400, MaxSizeGigabytes: 500}, "/dev/sda", nil},
		{"rotational false and at least 800 GiB", &typesv1.RootDeviceHints{Rotational: rot(false), MinSizeGigabytes: 800}, "/dev/nvme0n1", nil},
		{"model and serial", &typesv1.RootDeviceHints{Model: "ST4000", Serial: "ZC11AAAA"}, "/dev/sdb", nil},
		{"empty hint: default /dev/sda", Hints("", nil), "/dev/sda", nil},
		{"serial of no disk", Parse("NOSUCHSERIAL"), "", []string{
			"matches none of this host's 5 disks",
			"/dev/sda (447.1 GiB, serial S45PNA0M512345, wwn 0x5002538e40a1b2c3, model SAMSUNG MZ7LH480, by-path /dev/disk/by-path/pci-0000:00:17.0-ata-1)",
			"/dev/sdd (28.9 GiB, no serial, model Ultra Fit)",
			"change spec.rootDiskHint (or spec.rootDeviceHints) to name one of them: /dev/sda",
		}},
		{"missing device", Parse("/dev/sdz"), "", []string{"deviceName=/dev/sdz matches none", "/dev/sdc (3726.0 GiB, serial ZC11BBBB"}},
		{"partition, not a disk", Parse("/dev/sda1"), "", []string{"matches none"}},
		{"rotational: two disks", &typesv1.RootDeviceHints{Rotational: rot(true)}, "", []string{
			"rotational=true matches 2 disks: add a hint that tells them apart (in spec.rootDeviceHints: deviceName with a by-path link, serial or wwn): /dev/sdb (3726.0 GiB, serial ZC11AAAA, wwn 0x5000c500a1111111, model ST4000NM0035, by-path /dev/disk/by-path/pci-0000:00:17.0-ata-2, rotational); /dev/sdc",
		}},
		{"model: two disks", &typesv1.RootDeviceHints{Model: "ST4000NM0035"}, "", []string{"matches 2 disks", "/dev/sdb", "/dev/sdc"}},
		{"size range: no disk", &typesv1.RootDeviceHints{MinSizeGigabytes: 1000, MaxSizeGigabytes: 2000}, "", []string{"minSizeGigabytes=1000 maxSizeGigabytes=2000 matches none"}},
		{"serial and wrong path", &typesv1.RootDeviceHints{DeviceName: "/dev/sda", Serial: "ZC11AAAA"}, "", []string{"matches none"}},
	}
	t.Log("| hint | result |")
	t.Log("|---|---|")
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.Empty(t, Validate(tt.hint), "the hint itself is valid")
			d, err := Choose(tt.hint, facts())
			result := ""
			if err != nil {
				result = "refused: " + err.Error()
			} else {
				result = d.GetPath()
			}
			t.Logf("| `%s` | %s |", String(tt.hint), result)
			if tt.want != "" {
				require.NoError(t, err, "Choose(%s)", String(tt.hint))
				if d.GetPath() != tt.want {
					t.Errorf("Choose(%s) = %s, want %s", String(tt.hint), d.GetPath(), tt.want)
				}
				return
			}
			require.Error(t, err, "Choose(%s) = %s, want a refusal", String(tt.hint), d.GetPath())
			if !errdefs.IsInvalidArgument(err) {
				t.Errorf("Choose(%s) error class: %v, want InvalidArgument (only a new hint helps)", String(tt.hint), err)
			}
			for _, s := range tt.err {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("Choose(%s) = %q, want it to contain %q", String(tt.hint), err, s)
				}
			}
		})
	}
}

func TestChooseNoDisks(t *testing.T) {
	_, err := Choose(Parse("/dev/sda"), nil)
	require.ErrorContains(t, err, "this host reports no disks")
}

func TestParse(t *testing.T) {
	tests := []struct {
		in   string
		want *typesv1.RootDeviceHints
	}{
		{"", nil},
		{"  ", nil},
		{"/dev/vda", &typesv1.RootDeviceHints{DeviceName: "/dev/vda"}},
		{"/dev/disk/by-path/pci-0000:00:04.0", &typesv1.RootDeviceHints{DeviceName: "/dev/disk/by-path/pci-0000:00:04.0"}},
		{"/var/lib/kiln/lab/kiln/hosts/h1/disk.raw", &typesv1.RootDeviceHints{DeviceName: "/var/lib/kiln/lab/kiln/hosts/h1/disk.raw"}},
		{"S45PNA0M512345", &typesv1.RootDeviceHints{Serial: "S45PNA0M512345"}},
	}
	for _, tt := range tests {
		if got := Parse(tt.in); !proto.Equal(got, tt.want) {
			t.Errorf("Parse(%q) = %v, want %v", tt.in, got, tt.want)
		}
	}
}

func TestHintsPrefersStructured(t *testing.T) {
	s := &typesv1.RootDeviceHints{Serial: "X"}
	if got := Hints("/dev/sdb", s); got != s {
		t.Errorf("Hints(/dev/sdb, serial=X) = %s, want serial=X", String(got))
	}
	if got := Hints("/dev/sdb", &typesv1.RootDeviceHints{}); got.GetDeviceName() != "/dev/sdb" {
		t.Errorf("Hints(/dev/sdb, {}) = %s, want deviceName=/dev/sdb", String(got))
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		hint  *typesv1.RootDeviceHints
		field string
		msg   string
	}{
		{&typesv1.RootDeviceHints{}, "", "sets no hint"},
		{&typesv1.RootDeviceHints{DeviceName: "sda"}, "deviceName", `"sda" is not a path`},
		{&typesv1.RootDeviceHints{MinSizeGigabytes: 10, MaxSizeGigabytes: 5}, "minSizeGigabytes", "larger than maxSizeGigabytes 5"},
		{&typesv1.RootDeviceHints{Serial: " X"}, "serial", "leading or trailing spaces"},
	}
	for _, tt := range tests {
		ps := Validate(tt.hint)
		if len(ps) != 1 || ps[0].Field != tt.field || !strings.Contains(ps[0].Message, tt.msg) {
			t.Errorf("Validate(%s) = %v, want one problem on %q containing %q", String(tt.hint), ps, tt.field, tt.msg)
		}
	}
	if msg := ValidateString("/dev/sda /dev/sdb"); !strings.Contains(msg, "spaces") {
		t.Errorf("ValidateString(two paths) = %q, want a complaint about spaces", msg)
	}
	if msg := ValidateString("S45PNA0M512345"); msg != "" {
		t.Errorf("ValidateString(serial) = %q, want none", msg)
	}
}
