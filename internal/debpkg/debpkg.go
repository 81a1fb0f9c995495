// Package debpkg builds Kiln's Debian packages — kiln-agent,
// kiln-controller and kilnctl — with nfpm used as a library
// (github.com/goreleaser/nfpm/v2): the binaries, the systemd units of
// internal/units, the default configuration files under /etc/kiln
// (conffiles) and the maintainer scripts that enable, restart and stop
// the units. A build is reproducible: every time stamp is the one given
// (the commit time, SOURCE_DATE_EPOCH), so the same binaries and version
// give byte-identical packages (docs/packages.md).
package debpkg

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/goreleaser/nfpm/v2"
	"github.com/goreleaser/nfpm/v2/deb"
	"github.com/goreleaser/nfpm/v2/files"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/units"
)

// Names of the packages, which are also the names of their binaries.
const (
	Agent      = "kiln-agent"
	Controller = "kiln-controller"
	Kilnctl    = "kilnctl"
)

// Names lists the packages Build makes, in order.
var Names = []string{Agent, Controller, Kilnctl}

const (
	maintainer = "Kiln developers <kiln@kilnhq.invalid>"
	homepage   = "https://github.com/kilnhq/kiln"
)

// Options describe one build.
type Options struct {
	// BinDir holds the binaries kiln-agent, kiln-controller and kilnctl
	// (make build puts them in bin/); required.
	BinDir string
	// OutDir receives NAME_VERSION_ARCH.deb for each package; created
	// when missing.
	OutDir string
	// Version is the Debian version of every package (DebVersion);
	// required.
	Version string
	// MTime is the time stamp of every file and archive member (the
	// commit time, SOURCE_DATE_EPOCH); required, so that two builds
	// agree.
	MTime time.Time
	// Arch is the Debian architecture (default amd64).
	Arch string
}

// Build writes the three packages to o.OutDir and returns their paths in
// the order of Names. It returns InvalidArgument for missing options and
// NotFound for a missing binary.
func Build(o Options) ([]string, error) {
	if o.BinDir == "" || o.OutDir == "" || o.Version == "" || o.MTime.IsZero() {
		return nil, errdefs.InvalidArgument("debpkg: BinDir, OutDir, Version and MTime are required")
	}
	if !validVersion.MatchString(o.Version) {
		return nil, errdefs.InvalidArgument("debpkg: version %q is not a Debian version (it must start with a digit)", o.Version)
	}
	if o.Arch == "" {
		o.Arch = "amd64"
	}
	for _, n := range Names {
		if _, err := os.Stat(filepath.Join(o.BinDir, n)); err != nil {
			return nil, errdefs.NotFound("debpkg: binary %s: %v (run make build)", n, err)
		}
	}
	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return nil, fmt.Errorf("debpkg: %w", err)
	}
	stage, err := os.MkdirTemp("", "kiln-debpkg-")
	if err != nil {
		return nil, fmt.Errorf("debpkg: %w", err)
	}
	defer os.RemoveAll(stage)
	var out []string
	for _, name := range Names {
		info, err := packageInfo(name, o, filepath.Join(stage, name))
		if err != nil {
			return nil, err
		}
		p, err := write(info, o.OutDir)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// packageInfo is the nfpm description of package name; the generated
// files (units, configuration, scripts) are written under stage.
func packageInfo(name string, o Options, stage string) (*nfpm.Info, error) {
	gen := map[string]string{} // staged file name -> content
	var contents files.Contents
	bin := func(n string) {
		contents = append(contents, &files.Content{Source: filepath.Join(o.BinDir, n), Destination: "/usr/bin/" + n,
			FileInfo: &files.ContentFileInfo{Mode: 0o755}})
	}
	staged := func(src, dst, typ string, content string) {
		gen[src] = content
		contents = append(contents, &files.Content{Source: filepath.Join(stage, src), Destination: dst, Type: typ,
			FileInfo: &files.ContentFileInfo{Mode: 0o644}})
	}
	var scripts nfpm.Scripts
	script := func(slot *string, file, content string) {
		gen[file] = content
		*slot = filepath.Join(stage, file)
	}
	info := &nfpm.Info{
		Name: name, Arch: o.Arch, Platform: "linux", Version: o.Version, VersionSchema: "none",
		Section: "admin", Priority: "optional", Maintainer: maintainer, Vendor: "Kiln", Homepage: homepage,
		MTime: o.MTime,
	}
	switch name {
	case Agent:
		info.Description = "Kiln host agent\n" +
			" Prepares the host for Kubernetes, runs kubeadm, lays images and reports\n" +
			" health for a Kiln controller. Enroll with kiln-agent enroll --install-unit."
		bin(Agent)
		staged("kiln-agent.service", "/usr/lib/systemd/system/"+units.AgentName, "", string(units.AgentUnit(units.Agent{})))
		staged("agent.env", units.AgentEnvFile, files.TypeConfigNoReplace, units.AgentEnv)
		script(&scripts.PostInstall, "postinst", agentPostinst)
		script(&scripts.PreRemove, "prerm", prerm(units.AgentName))
		script(&scripts.PostRemove, "postrm", postrm)
	case Controller:
		info.Description = "Kiln controller\n" +
			" Keeps a fleet of bare-metal Kubernetes nodes as declared: API, embedded\n" +
			" etcd, CA, BMC power and boot, image laying and the host lifecycle."
		bin(Controller)
		staged("kiln-controller.service", "/usr/lib/systemd/system/"+units.ControllerName, "", string(units.ControllerUnit()))
		staged("controller.env", units.ControllerEnvFile, files.TypeConfigNoReplace, units.ControllerEnv)
		script(&scripts.PostInstall, "postinst", controllerPostinst)
		script(&scripts.PreRemove, "prerm", prerm(units.ControllerName))
		script(&scripts.PostRemove, "postrm", postrm)
	case Kilnctl:
		info.Description = "Kiln command-line client\n" +
			" Applies, lists, describes and watches Kiln resources, makes enrollment\n" +
			" tokens and backups, and runs the built-in lab."
		bin(Kilnctl)
	default:
		return nil, errdefs.InvalidArgument("debpkg: no package %q", name)
	}
	if err := os.MkdirAll(stage, 0o755); err != nil {
		return nil, fmt.Errorf("debpkg: %w", err)
	}
	for f, c := range gen {
		if err := os.WriteFile(filepath.Join(stage, f), []byte(c), 0o644); err != nil {
			return nil, fmt.Errorf("debpkg: %w", err)
		}
	}
	info.Contents = contents
	info.Scripts = scripts
	return info, nil
}

// write validates info and writes its package into dir.
func write(info *nfpm.Info, dir string) (string, error) {
	info = nfpm.WithDefaults(info)
	if err := nfpm.PrepareForPackager(info, "deb"); err != nil {
		return "", fmt.Errorf("debpkg: %s: %w", info.Name, err)
	}
	p := filepath.Join(dir, deb.Default.ConventionalFileName(info))
	tmp, err := os.CreateTemp(dir, ".debpkg-*")
	if err != nil {
		return "", fmt.Errorf("debpkg: %w", err)
	}
	defer os.Remove(tmp.Name())
	if err := deb.Default.Package(info, tmp); err != nil {
		tmp.Close()
		return "", fmt.Errorf("debpkg: %s: %w", info.Name, err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return "", fmt.Errorf("debpkg: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("debpkg: %w", err)
	}
	if err := os.Rename(tmp.Name(), p); err != nil {
		return "", fmt.Errorf("debpkg: %w", err)
	}
	return p, nil
}

// validVersion is what dpkg accepts as an upstream version without an
// epoch or revision: a digit first, then alphanumerics and . + ~.
var validVersion = regexp.MustCompile(`^[0-9][A-Za-z0-9.+~]*$`)

// describeRE matches `git describe --tags --always --dirty` output.
// A bare abbreviated hash (no tag reachable) comes first: "9b0c7bf"
// also looks like a version that starts with a digit.
var describeRE = regexp.MustCompile(`^(?:([0-9a-f]{7,40})|v?([0-9][0-9A-Za-z.]*)(?:-([0-9]+)-g([0-9a-f]+))?)(-dirty)?$`)

// DebVersion turns `git describe --tags --always --dirty` output into a
// Debian version that sorts as the commits do:
//
//	v1.2.0                 -> 1.2.0
//	v1.2.0-5-gabc1234      -> 1.2.0+git5.abc1234    (5 commits after v1.2.0)
//	abc1234 (no tag)       -> 0~git20261206123456.abc1234 (commit time)
//	9b0c7bf (no tag)       -> 0~git20261206123456.9b0c7bf (7 to 40 hex digits
//	                          and nothing else are a hash, not a tag)
//	...-dirty              -> ...+dirty / ...dirty  (a tree with changes)
//
// It returns InvalidArgument for anything else.
func DebVersion(describe string, commit time.Time) (string, error) {
	m := describeRE.FindStringSubmatch(strings.TrimSpace(describe))
	if m == nil {
		return "", errdefs.InvalidArgument("debpkg: git describe %q: want vX.Y.Z[-N-gHASH][-dirty] or a commit hash", describe)
	}
	var v string
	switch {
	case m[1] != "":
		v = "0~git" + commit.UTC().Format("20060102150405") + "." + m[1]
	case m[3] != "":
		v = m[2] + "+git" + m[3] + "." + m[4]
	default:
		v = m[2]
	}
	if m[5] != "" {
		if strings.Contains(v, "+") {
			v += ".dirty"
		} else {
			v += "+dirty"
		}
	}
	return v, nil
}

// Maintainer scripts. dpkg runs them with sh -e; each does nothing about
// units where systemd is not running (a chroot, an image build).

const agentPostinst = `#!/bin/sh
set -e
# kiln-agent: the unit starts only once the host is enrolled
# (kiln-agent enroll --install-unit enables and starts it); an upgrade
# restarts a running agent.
if [ -d /run/systemd/system ]; then
	systemctl daemon-reload
	if [ "$1" = configure ] && [ -n "$2" ]; then
		systemctl try-restart kiln-agent.service || true
	fi
fi
`

const controllerPostinst = `#!/bin/sh
set -e
# kiln-controller: enabled and started on first install, restarted on
# upgrade. Its state is in /var/lib/kiln-controller (StateDirectory=).
if [ -d /run/systemd/system ]; then
	systemctl daemon-reload
	if [ "$1" = configure ] && [ -z "$2" ]; then
		systemctl enable --now kiln-controller.service
	elif [ "$1" = configure ]; then
		systemctl try-restart kiln-controller.service || true
	fi
fi
`

// prerm stops and disables unit when the package goes away (not on
// upgrade: the new postinst restarts it).
func prerm(unit string) string {
	return `#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
	systemctl disable --now ` + unit + ` || true
fi
`
}

// postrm reloads systemd after the unit file is gone and, on purge,
// removes /etc/kiln once no Kiln package's file is left in it. State
// directories stay (docs/packages.md, "Purge").
const postrm = `#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
	systemctl daemon-reload || true
fi
if [ "$1" = purge ]; then
	rmdir /etc/kiln 2>/dev/null || true
fi
`
