// Package rootdisk resolves the root-disk hints the controller sends with
// LayImage, Wipe and WriteIdentity to one device of the agent's host: it
// lists the host's disks as its facts do (sysfs and the /dev/disk links
// under a root), chooses one with internal/diskhint, and checks that it is
// a block device. A regular file is a target only in file-target mode (the
// lab, whose disks are files).
package rootdisk

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/host"
	"github.com/kilnhq/kiln/internal/diskhint"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Resolver turns hints into a device path. The zero value is not usable:
// set Root.
type Resolver struct {
	// Root is the host's filesystem root ("/" in production): the disks
	// are read from ROOT/sys/block and ROOT/dev/disk.
	Root string
	// FileTargets accepts a device name outside /dev as a regular file
	// target (kiln-agent run --file-targets: the lab).
	FileTargets bool
	// VirtualDisks counts loop, ram and zram devices as disks (tests on
	// loop devices). Off in production, as in the facts.
	VirtualDisks bool
	// Log, if set, records the disk chosen.
	Log *slog.Logger
}

// Resolve returns the path of the one disk target and hints name: hints
// when set, else target in its one-string form (a path, else a serial),
// else /dev/sda. It reads sysfs and stats the device; it does not block.
//
// A hint that is invalid, names a path outside /dev (outside file-target
// mode), matches no disk or more than one, or resolves to something that
// is not a block device is an errdefs.InvalidArgument error that lists the
// host's disks: only a different hint helps. A disk listed by sysfs whose
// device node is missing is errdefs.NotFound.
func (r *Resolver) Resolve(ctx context.Context, target string, hints *typesv1.RootDeviceHints) (string, error) {
	path, err := r.resolve(ctx, target, hints)
	if err != nil && r.Log != nil {
		// In full here: the host's status keeps a shortened copy.
		r.Log.Warn("root disk hint refused", "component", "rootdisk", "error", err)
	}
	return path, err
}

func (r *Resolver) resolve(ctx context.Context, target string, hints *typesv1.RootDeviceHints) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	h := diskhint.Hints(target, hints)
	if ps := diskhint.Validate(h); len(ps) > 0 {
		msgs := make([]string, len(ps))
		for i, p := range ps {
			msgs[i] = strings.TrimSpace(p.Field + " " + p.Message)
		}
		return "", errdefs.InvalidArgument("root device hint %s: %s", diskhint.String(h), strings.Join(msgs, "; "))
	}
	disks, err := host.Disks(filepath.Join(r.Root, "sys/block"), r.VirtualDisks)
	if err != nil && !os.IsNotExist(err) {
		return "", fmt.Errorf("root device hint %s: list disks: %w", diskhint.String(h), err)
	}
	host.DiskLinks(filepath.Join(r.Root, "dev/disk"), disks)

	if name := h.GetDeviceName(); name != "" && !strings.HasPrefix(filepath.Clean(name), "/dev/") {
		if !r.FileTargets {
			return "", errdefs.InvalidArgument("root device hint %s: %q is not a device under /dev: images are laid only onto whole disks (regular files only by an agent run with --file-targets, as the lab's); change spec.rootDiskHint (or spec.rootDeviceHints) to name one of this host's disks: %s",
				diskhint.String(h), name, candidates(disks))
		}
		if !proto.Equal(h, &typesv1.RootDeviceHints{DeviceName: name}) {
			return "", errdefs.InvalidArgument("root device hint %s: a file target (%q) takes no other hint", diskhint.String(h), name)
		}
		r.chosen(h, name, "file target")
		return name, nil
	}

	if name := h.GetDeviceName(); name != "" && !named(disks, name) {
		// A link the facts do not list (another udev layout): follow it
		// to the disk it names, if any.
		if dest, err := filepath.EvalSymlinks(filepath.Join(r.Root, name)); err == nil {
			for _, d := range disks {
				if d.GetName() == filepath.Base(dest) {
					h = proto.CloneOf(h)
					h.DeviceName = d.GetPath()
					break
				}
			}
		}
	}
	d, err := diskhint.Choose(h, disks)
	if err != nil {
		if strings.HasPrefix(h.GetDeviceName(), "/dev/disk/") && !linked(disks) {
			return "", fmt.Errorf("%w (this host has no /dev/disk links: udev does not run here, as on Kiln's boot media; name the disk by serial, wwn or size instead)", err)
		}
		return "", err
	}
	fi, err := os.Stat(d.GetPath())
	if os.IsNotExist(err) {
		return "", errdefs.NotFound("root device hint %s chose %s, but %s does not exist (no device node: is /dev populated?)", diskhint.String(h), diskhint.Describe(d), d.GetPath())
	}
	if err != nil {
		return "", fmt.Errorf("root device hint %s: %w", diskhint.String(h), err)
	}
	if m := fi.Mode(); m&os.ModeDevice == 0 || m&os.ModeCharDevice != 0 {
		return "", errdefs.InvalidArgument("root device hint %s chose %s, but %s is not a block device (%v): images are laid only onto whole disks", diskhint.String(h), diskhint.Describe(d), d.GetPath(), m.Type())
	}
	r.chosen(h, d.GetPath(), diskhint.Describe(d))
	return d.GetPath(), nil
}

func (r *Resolver) chosen(h *typesv1.RootDeviceHints, path, disk string) {
	if r.Log != nil {
		r.Log.Info("root disk chosen", "component", "rootdisk", "hint", diskhint.String(h), "path", path, "disk", disk)
	}
}

// named reports whether name is a disk's path or one of its links.
func named(disks []*typesv1.Disk, name string) bool {
	for _, d := range disks {
		if diskhint.Matches(&typesv1.RootDeviceHints{DeviceName: name}, d) {
			return true
		}
	}
	return false
}

// linked reports whether any disk has a by-path or by-id link.
func linked(disks []*typesv1.Disk) bool {
	for _, d := range disks {
		if len(d.GetByPath()) > 0 || len(d.GetById()) > 0 {
			return true
		}
	}
	return false
}

func candidates(disks []*typesv1.Disk) string {
	if len(disks) == 0 {
		return "none"
	}
	return diskhint.Candidates(disks)
}
