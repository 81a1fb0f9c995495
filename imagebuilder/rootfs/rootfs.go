// Package rootfs builds Debian root filesystem trees for Kiln's images and
// lab hosts: a debootstrap minbase root with systemd, dbus and iproute2,
// extra packages installed inside it with apt-get (under systemd-nspawn
// without booting, or chroot when nspawn is missing), cached on disk under
// a key derived from the spec, so a second build of the same spec returns
// at once. Overlay then copies such a root into a per-image tree and adds
// files (the agent binary, units) to it.
//
// Builds need root, debootstrap and the Debian mirror.
package rootfs

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Defaults of a Spec.
const (
	DefaultSuite  = "bookworm"
	DefaultMirror = "http://deb.debian.org/debian"
)

// BasePackages are always included by debootstrap: what a host needs to
// boot with systemd as PID 1 under systemd-nspawn and be reached on D-Bus.
var BasePackages = []string{"systemd", "systemd-sysv", "dbus", "iproute2"}

// Spec describes a root tree.
type Spec struct {
	// Suite is the Debian release (default "bookworm").
	Suite string
	// Mirror is the package mirror (default http://deb.debian.org/debian).
	Mirror string
	// Packages are installed with apt-get after debootstrap, without
	// recommends.
	Packages []string
	// CacheDir holds built roots, one directory per key (default
	// ${KILN_CACHE:-/var/cache/kiln}/rootfs).
	CacheDir string
}

func (s Spec) withDefaults() Spec {
	if s.Suite == "" {
		s.Suite = DefaultSuite
	}
	if s.Mirror == "" {
		s.Mirror = DefaultMirror
	}
	if s.CacheDir == "" {
		s.CacheDir = filepath.Join(CacheRoot(), "rootfs")
	}
	return s
}

// CacheRoot is ${KILN_CACHE:-/var/cache/kiln}.
func CacheRoot() string {
	if d := os.Getenv("KILN_CACHE"); d != "" {
		return d
	}
	return "/var/cache/kiln"
}

// Validate returns InvalidArgument for a suite, mirror or package name
// that could not be passed to debootstrap or apt-get safely.
func (s Spec) Validate() error {
	s = s.withDefaults()
	if !validName(s.Suite) {
		return errdefs.InvalidArgument("rootfs: suite %q: want a Debian release name", s.Suite)
	}
	if !strings.HasPrefix(s.Mirror, "http://") && !strings.HasPrefix(s.Mirror, "https://") && !strings.HasPrefix(s.Mirror, "file:/") {
		return errdefs.InvalidArgument("rootfs: mirror %q: want an http(s):// or file:/ URL", s.Mirror)
	}
	for _, p := range s.Packages {
		if !validName(p) {
			return errdefs.InvalidArgument("rootfs: package %q: not a Debian package name", p)
		}
	}
	return nil
}

func validName(s string) bool {
	if s == "" || s[0] == '-' {
		return false
	}
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', strings.ContainsRune("+-.:=~", r):
		default:
			return false
		}
	}
	return true
}

// Key is the cache key of the spec: the first 16 hex digits of the sha256
// of its suite, mirror, base packages and sorted extra packages. The cache
// directory does not take part.
func (s Spec) Key() string {
	s = s.withDefaults()
	pk := slices.Clone(s.Packages)
	slices.Sort(pk)
	pk = slices.Compact(pk)
	b, _ := json.Marshal(struct {
		V        int
		Suite    string
		Mirror   string
		Base     []string
		Packages []string
	}{1, s.Suite, s.Mirror, BasePackages, pk})
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// Dir is where the root of the spec lives once built.
func (s Spec) Dir() string {
	s = s.withDefaults()
	return filepath.Join(s.CacheDir, s.Key())
}

// File is a file Overlay adds to a root.
type File struct {
	// Path inside the root, absolute ("/usr/local/bin/kiln-agent").
	Path string
	// Mode of the file (default 0644).
	Mode fs.FileMode
	// Data is the content; ignored when Source is set.
	Data []byte
	// Source is a file on this machine to copy.
	Source string
	// Symlink, when set, makes Path a symbolic link to it (for enabling
	// units: /etc/systemd/system/multi-user.target.wants/x.service).
	Symlink string
}
