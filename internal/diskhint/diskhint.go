// Package diskhint chooses the disk a host's images are laid on from root
// device hints (a device name, by-path or by-id link, serial, WWN, model,
// size range, rotational) and the disks a host reports in its facts, as
// Metal3's root device hints do. It is pure: the agent lists the disks and
// calls Choose; the controller calls Validate when a Host is applied.
package diskhint

import (
	"fmt"
	"slices"
	"strings"
	"unicode"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Default is the device name used when a host names no disk.
const Default = "/dev/sda"

const gib = 1 << 30

// Parse reads the one-string form of a hint (HostSpec.root_disk_hint, the
// agent requests' target): a string that starts with "/" is a device name
// (/dev/sda, /dev/disk/by-path/..., /dev/disk/by-id/..., or a lab disk
// file), anything else a serial number. An empty string is no hint (nil).
func Parse(s string) *typesv1.RootDeviceHints {
	s = strings.TrimSpace(s)
	switch {
	case s == "":
		return nil
	case strings.HasPrefix(s, "/"):
		return &typesv1.RootDeviceHints{DeviceName: s}
	default:
		return &typesv1.RootDeviceHints{Serial: s}
	}
}

// Hints returns the hints a request or host names: structured when set,
// else target parsed, else Default.
func Hints(target string, structured *typesv1.RootDeviceHints) *typesv1.RootDeviceHints {
	if !Empty(structured) {
		return structured
	}
	if h := Parse(target); h != nil {
		return h
	}
	return &typesv1.RootDeviceHints{DeviceName: Default}
}

// Empty reports whether h sets no hint.
func Empty(h *typesv1.RootDeviceHints) bool {
	return h.GetDeviceName() == "" && h.GetSerial() == "" && h.GetWwn() == "" && h.GetModel() == "" &&
		h.GetMinSizeGigabytes() == 0 && h.GetMaxSizeGigabytes() == 0 && !hasRotational(h)
}

// Problem is one thing wrong with a hint: Field in YAML spelling
// (deviceName, minSizeGigabytes) and what to do about it.
type Problem struct {
	Field, Message string
}

// Validate returns what is wrong with h on its own, before any disk is
// looked at: an empty set of hints, a device name that is not an absolute
// path, a size range whose minimum exceeds its maximum, values with spaces
// or control characters.
func Validate(h *typesv1.RootDeviceHints) []Problem {
	var ps []Problem
	if Empty(h) {
		return []Problem{{"", "sets no hint: set deviceName, serial, wwn, model, minSizeGigabytes, maxSizeGigabytes or rotational, or remove it"}}
	}
	for _, f := range []struct{ name, v string }{
		{"deviceName", h.GetDeviceName()}, {"serial", h.GetSerial()}, {"wwn", h.GetWwn()}, {"model", h.GetModel()},
	} {
		if f.v != "" && strings.TrimSpace(f.v) != f.v {
			ps = append(ps, Problem{f.name, fmt.Sprintf("%q has leading or trailing spaces: remove them", f.v)})
		}
		if strings.ContainsFunc(f.v, unicode.IsControl) {
			ps = append(ps, Problem{f.name, fmt.Sprintf("%q holds control characters", f.v)})
		}
	}
	if n := h.GetDeviceName(); n != "" && !strings.HasPrefix(n, "/") {
		ps = append(ps, Problem{"deviceName", fmt.Sprintf("%q is not a path: use /dev/NAME, /dev/disk/by-path/... or /dev/disk/by-id/... (a serial number goes in serial)", n)})
	}
	if lo, hi := h.GetMinSizeGigabytes(), h.GetMaxSizeGigabytes(); hi > 0 && lo > hi {
		ps = append(ps, Problem{"minSizeGigabytes", fmt.Sprintf("%d is larger than maxSizeGigabytes %d: no disk can match", lo, hi)})
	}
	return ps
}

// ValidateString returns what is wrong with the one-string form s
// (HostSpec.root_disk_hint), or "".
func ValidateString(s string) string {
	switch {
	case s != strings.TrimSpace(s):
		return fmt.Sprintf("%q has leading or trailing spaces: remove them", s)
	case strings.ContainsFunc(s, unicode.IsSpace) || strings.ContainsFunc(s, unicode.IsControl):
		return fmt.Sprintf("%q holds spaces or control characters: give one device path (/dev/sda, /dev/disk/by-path/...) or one serial number", s)
	}
	return ""
}

// String renders h for messages and logs: "deviceName=/dev/sda",
// "serial=S3Z1NB0K minSizeGigabytes=100 rotational=false".
func String(h *typesv1.RootDeviceHints) string {
	var parts []string
	add := func(k, v string) {
		if v != "" {
			parts = append(parts, k+"="+v)
		}
	}
	add("deviceName", h.GetDeviceName())
	add("serial", h.GetSerial())
	add("wwn", h.GetWwn())
	add("model", h.GetModel())
	if n := h.GetMinSizeGigabytes(); n > 0 {
		add("minSizeGigabytes", fmt.Sprint(n))
	}
	if n := h.GetMaxSizeGigabytes(); n > 0 {
		add("maxSizeGigabytes", fmt.Sprint(n))
	}
	if hasRotational(h) {
		add("rotational", fmt.Sprint(h.GetRotational()))
	}
	if len(parts) == 0 {
		return "(none)"
	}
	return strings.Join(parts, " ")
}

// Matches reports whether disk d satisfies every hint h sets. The device
// name matches the disk's path or one of its by-path or by-id links; the
// serial and WWN match exactly (the WWN without regard to case); the model
// matches as a substring; sizes are inclusive GiB bounds.
func Matches(h *typesv1.RootDeviceHints, d *typesv1.Disk) bool {
	if n := h.GetDeviceName(); n != "" && n != d.GetPath() && !slices.Contains(d.GetByPath(), n) && !slices.Contains(d.GetById(), n) {
		return false
	}
	if s := h.GetSerial(); s != "" && s != strings.TrimSpace(d.GetSerial()) {
		return false
	}
	if w := h.GetWwn(); w != "" && !strings.EqualFold(w, d.GetWwn()) {
		return false
	}
	if m := h.GetModel(); m != "" && !strings.Contains(d.GetModel(), m) {
		return false
	}
	if lo := uint64(h.GetMinSizeGigabytes()); lo > 0 && d.GetSizeBytes() < lo*gib {
		return false
	}
	if hi := uint64(h.GetMaxSizeGigabytes()); hi > 0 && d.GetSizeBytes() > hi*gib {
		return false
	}
	if hasRotational(h) && h.GetRotational() != d.GetRotational() {
		return false
	}
	return true
}

// Choose returns the one disk of disks that h matches. A hint that matches
// no disk, or more than one, is an errdefs.InvalidArgument error that says
// what to change (only a different hint helps) and then lists the disks
// in question (path, size, serial, WWN, model, by-path), so that a message
// cut short for a status field loses disks, not the advice.
func Choose(h *typesv1.RootDeviceHints, disks []*typesv1.Disk) (*typesv1.Disk, error) {
	var found []*typesv1.Disk
	for _, d := range disks {
		if Matches(h, d) {
			found = append(found, d)
		}
	}
	switch {
	case len(found) == 1:
		return found[0], nil
	case len(disks) == 0:
		return nil, errdefs.InvalidArgument("root device hint %s: this host reports no disks: check that its disk controller is seen by the kernel", String(h))
	case len(found) == 0:
		return nil, errdefs.InvalidArgument("root device hint %s matches none of this host's %d disks: change spec.rootDiskHint (or spec.rootDeviceHints) to name one of them: %s",
			String(h), len(disks), Candidates(disks))
	default:
		return nil, errdefs.InvalidArgument("root device hint %s matches %d disks: add a hint that tells them apart (in spec.rootDeviceHints: deviceName with a by-path link, serial or wwn): %s",
			String(h), len(found), Candidates(found))
	}
}

// Candidates lists disks for a message: "sda (480.0 GiB, serial S3Z1,
// by-path /dev/disk/by-path/pci-0000:00:1f.2-ata-1); sdb (...)".
func Candidates(disks []*typesv1.Disk) string {
	parts := make([]string, len(disks))
	for i, d := range disks {
		parts[i] = Describe(d)
	}
	return strings.Join(parts, "; ")
}

// Describe renders one disk: its name, size, and the serial, WWN, model,
// by-path link and rotational flag it has.
func Describe(d *typesv1.Disk) string {
	attrs := []string{Size(d.GetSizeBytes())}
	if s := strings.TrimSpace(d.GetSerial()); s != "" {
		attrs = append(attrs, "serial "+s)
	} else {
		attrs = append(attrs, "no serial")
	}
	if w := d.GetWwn(); w != "" {
		attrs = append(attrs, "wwn "+w)
	}
	if m := d.GetModel(); m != "" {
		attrs = append(attrs, "model "+m)
	}
	if bp := d.GetByPath(); len(bp) > 0 {
		attrs = append(attrs, "by-path "+bp[0])
	}
	if d.GetRotational() {
		attrs = append(attrs, "rotational")
	}
	return fmt.Sprintf("%s (%s)", d.GetPath(), strings.Join(attrs, ", "))
}

// Size renders a byte count in GiB, or MiB below one GiB.
func Size(b uint64) string {
	if b >= gib {
		return fmt.Sprintf("%.1f GiB", float64(b)/gib)
	}
	return fmt.Sprintf("%d MiB", b>>20)
}

func hasRotational(h *typesv1.RootDeviceHints) bool { return h != nil && h.Rotational != nil }
