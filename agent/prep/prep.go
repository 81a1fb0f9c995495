// Package prep makes a host's OS ready for Kubernetes: swap off (now and
// in fstab), the kernel modules br_netfilter and overlay available and
// persisted, the sysctls ip_forward and bridge-nf-call-ip{,6}tables set
// and persisted, containerd's SystemdCgroup matched to the kubelet's
// cgroup driver (and verified in the running containerd), and the
// containerd and kubelet units enabled.
//
// Prepare is idempotent: it only changes what differs, returns a
// before/after list of what it changed, and a second run on a prepared
// host changes nothing.
package prep

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kilnhq/kiln/host/containerd"
	"github.com/kilnhq/kiln/host/kmod"
	"github.com/kilnhq/kiln/host/swap"
	"github.com/kilnhq/kiln/host/sysctl"
	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// Runner runs a host command (command.Exec in production).
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
}

// Units is what Prepare needs from the host's service manager.
type Units interface {
	Enable(ctx context.Context, unit string) (changed bool, err error)
	Restart(ctx context.Context, unit string) error
	Close() error
}

var _ Units = (*systemd.Manager)(nil)

// DialUnits connects to the service manager of the host under root. It
// returns a NotSupported error when the host has none (no systemd).
type DialUnits func(ctx context.Context, root string) (Units, error)

func dialSystemd(ctx context.Context, root string) (Units, error) {
	m, err := systemd.Dial(ctx, root)
	if err != nil {
		return nil, err
	}
	return m, nil
}

// What Prepare sets up.
var (
	// modules come first: the bridge sysctls exist only with br_netfilter.
	modules = []string{"br_netfilter", "overlay"}
	sysctls = []setting{
		{"net.ipv4.ip_forward", "1"},
		{"net.bridge.bridge-nf-call-iptables", "1"},
		{"net.bridge.bridge-nf-call-ip6tables", "1"},
	}
	unitsToEnable = []string{"containerd.service", "kubelet.service"}
)

// setting is a kernel parameter and the value Prepare wants.
type setting struct{ Key, Value string }

// Preparer prepares the host under a root.
type Preparer struct {
	root      string
	run       Runner
	log       *slog.Logger
	dialUnits DialUnits
	// queryTimeout bounds the CRI query of the running containerd.
	queryTimeout time.Duration
}

// Option configures a Preparer.
type Option func(*Preparer)

// WithUnits replaces the systemd D-Bus connection (the lab connects to a
// node's own systemd; tests inject faults).
func WithUnits(d DialUnits) Option { return func(p *Preparer) { p.dialUnits = d } }

// New returns a Preparer for the host whose filesystem is at root ("/" in
// production; /proc and /sys are read under it too).
func New(root string, run Runner, log *slog.Logger, opts ...Option) *Preparer {
	p := &Preparer{root: root, run: run, log: log.With("component", "prep"), dialUnits: dialSystemd, queryTimeout: 10 * time.Second}
	for _, o := range opts {
		o(p)
	}
	return p
}

// Prepare makes the host ready for Kubernetes, reporting each step to
// progress (may be nil), and returns what it changed.
//
// Sysctls under net/ are per network namespace: Prepare sets them in the
// namespace of the calling thread. containerd's cgroup driver is verified
// from the running daemon over CRI, not from the file: with systemd,
// Prepare restarts containerd when its config changed or the running
// value differs. Without systemd (no D-Bus), enabling and restarting
// units is skipped and said so through progress; that is not a failure
// and not a change (Preflight then reports a containerd that still runs
// with the other driver). It blocks until done.
//
// It returns an InvalidArgument error for an unknown cgroup driver or a
// containerd config path outside the root, and an error naming the step
// for anything that fails (a module that cannot be loaded, a read-only
// /proc/sys, a broken containerd config, a unit that systemd does not
// know); the result then lists what was changed before the failure.
func (p *Preparer) Prepare(ctx context.Context, req *agentv1.PrepareRequest, progress func(string)) (*agentv1.PrepareResult, error) {
	if progress == nil {
		progress = func(string) {}
	}
	driver := req.GetCgroupDriver()
	if driver == "" {
		driver = containerd.DriverSystemd
	}
	if driver != containerd.DriverSystemd && driver != containerd.DriverCgroupfs {
		return nil, errdefs.InvalidArgument("cgroup driver %q: want %q or %q", driver, containerd.DriverSystemd, containerd.DriverCgroupfs)
	}
	config := req.GetContainerdConfig()
	if config == "" {
		config = containerd.DefaultConfig
	}
	if rel := filepath.Clean(strings.TrimPrefix(config, "/")); rel == ".." || strings.HasPrefix(rel, "../") {
		return nil, errdefs.InvalidArgument("containerd config %q: outside the host's root", config)
	}
	s := &step{ctx: ctx, p: p, progress: progress, res: &agentv1.PrepareResult{}}
	defer func() {
		if s.unitsConn != nil {
			s.unitsConn.Close()
		}
	}()
	for _, f := range []func() error{
		s.swap,
		s.modules,
		s.sysctls,
		func() error { return s.containerd(config, driver) },
		s.units,
		func() error { return s.verifyContainerd(driver) },
	} {
		err := ctx.Err()
		if err == nil {
			err = f()
		}
		if err != nil {
			// What was changed before the failure stays reported.
			s.res.Changed = len(s.res.Changes) > 0
			return s.res, fmt.Errorf("prepare: %w", err)
		}
	}
	s.res.Changed = len(s.res.Changes) > 0
	p.log.InfoContext(ctx, "prepared", "changes", len(s.res.Changes))
	return s.res, nil
}

// step is one Prepare run.
type step struct {
	ctx      context.Context
	p        *Preparer
	progress func(string)
	res      *agentv1.PrepareResult
	// configChanged is set when containerd's config file changed.
	configChanged bool
	// unitsConn is the service manager, nil without systemd.
	unitsConn Units
}

func (s *step) change(item, before, after string) {
	s.res.Changes = append(s.res.Changes, &agentv1.Change{Item: item, Before: before, After: after})
	s.p.log.InfoContext(s.ctx, "changed", "item", item, "before", before, "after", after)
	s.progress(fmt.Sprintf("%s: %s -> %s", item, before, after))
}

func (s *step) swap() error {
	s.progress("swap: turning off")
	was, err := swap.Off(s.ctx, s.p.root, s.p.run)
	if err != nil {
		return err
	}
	if len(was) > 0 {
		s.change("swap", "on ("+strings.Join(was, ", ")+")", "off")
	}
	lines, err := swap.DisableInFstab(s.p.root)
	if err != nil {
		return err
	}
	for _, l := range lines {
		s.change("fstab swap entry", l, "#"+l)
	}
	return nil
}

func (s *step) modules() error {
	s.progress("kernel modules: " + strings.Join(modules, ", "))
	release := readTrim(filepath.Join(s.p.root, "proc/sys/kernel/osrelease"))
	for _, m := range modules {
		before, after, err := kmod.Ensure(s.ctx, s.p.root, release, s.p.run, m)
		if err != nil {
			return err
		}
		if before != after {
			s.change("module "+m, string(before), string(after))
		}
	}
	return s.persist(kmod.PersistFile, func() (bool, error) { return kmod.Persist(s.p.root, modules) })
}

func (s *step) sysctls() error {
	s.progress("sysctls")
	want := map[string]string{}
	for _, sc := range sysctls {
		want[sc.Key] = sc.Value
		cur, err := sysctl.Get(s.p.root, sc.Key)
		if err != nil {
			return err
		}
		if cur == sc.Value {
			continue
		}
		if err := sysctl.Set(s.p.root, sc.Key, sc.Value); err != nil {
			return err
		}
		s.change("sysctl "+sc.Key, cur, sc.Value)
	}
	return s.persist(sysctl.PersistFile, func() (bool, error) { return sysctl.Persist(s.p.root, want) })
}

// persist runs write and records the file's content before and after
// when it changed.
func (s *step) persist(rel string, write func() (bool, error)) error {
	path := filepath.Join(s.p.root, rel)
	before, err := summary(path)
	if err != nil {
		return err
	}
	changed, err := write()
	if err != nil || !changed {
		return err
	}
	after, err := summary(path)
	if err != nil {
		return err
	}
	s.change("file /"+rel, before, after)
	return nil
}

func (s *step) containerd(config, driver string) error {
	path := filepath.Join(s.p.root, config)
	want := driver == containerd.DriverSystemd
	s.progress(fmt.Sprintf("containerd: SystemdCgroup = %v in %s", want, config))
	before, changed, err := containerd.WriteSystemdCgroup(path, want)
	if err != nil {
		return err
	}
	if changed {
		s.change("containerd SystemdCgroup", before, fmt.Sprint(want))
		s.configChanged = true
	}
	return nil
}

func (s *step) units() error {
	u, err := s.p.dialUnits(s.ctx, s.p.root)
	if errdefs.IsNotSupported(err) {
		s.p.log.WarnContext(s.ctx, "no systemd: units not enabled", "error", err)
		s.progress(fmt.Sprintf("units: skipped enabling %s: %v", strings.Join(unitsToEnable, ", "), err))
		return nil
	}
	if err != nil {
		return fmt.Errorf("systemd: %w", err)
	}
	s.unitsConn = u
	for _, unit := range unitsToEnable {
		s.progress("units: enable " + unit)
		changed, err := u.Enable(s.ctx, unit)
		if err != nil {
			return err
		}
		if changed {
			s.change("unit "+unit, "disabled", "enabled")
		}
	}
	return nil
}

// verifyContainerd makes sure the running containerd uses driver: its
// config file is read only at start, so a running daemon may still use
// the old value. With systemd it restarts containerd when the config
// changed or the running value differs; without systemd it says what to
// do. A containerd that is not running is not verified (Preflight's
// runtime-socket check fails for it).
func (s *step) verifyContainerd(driver string) error {
	const unit = "containerd.service"
	sock := filepath.Join(s.p.root, containerd.DefaultSocket)
	query := func() (containerd.Running, error) {
		ctx, cancel := context.WithTimeout(s.ctx, s.p.queryTimeout)
		defer cancel()
		return containerd.Query(ctx, sock)
	}
	restart := func(before string) error {
		s.progress("units: restart " + unit)
		if err := s.unitsConn.Restart(s.ctx, unit); err != nil {
			return err
		}
		s.change("unit "+unit, before, "restarted")
		return nil
	}
	if s.configChanged && s.unitsConn != nil {
		if err := restart("running with the old config"); err != nil {
			return err
		}
	}
	r, err := query()
	if errdefs.IsUnavailable(err) {
		s.progress("containerd: not running, its cgroup driver is not verified")
		return nil
	}
	if err != nil {
		return fmt.Errorf("verify containerd: %w", err)
	}
	if r.Driver() == driver {
		s.progress("containerd: running with the " + driver + " cgroup driver")
		return nil
	}
	if s.unitsConn == nil {
		s.p.log.WarnContext(s.ctx, "containerd runs with another cgroup driver", "running", r.Driver(), "want", driver)
		s.progress(fmt.Sprintf("containerd: runs with the %s cgroup driver, its config says %s: restart containerd to apply (no systemd to do it)", r.Driver(), driver))
		return nil
	}
	if !s.configChanged {
		if err := restart("running with the " + r.Driver() + " cgroup driver"); err != nil {
			return err
		}
		if r, err = query(); err != nil {
			return fmt.Errorf("verify containerd after restart: %w", err)
		}
	}
	if r.Driver() != driver {
		return errdefs.FailedPrecondition("containerd runs with the %s cgroup driver after a restart, want %s: is %s its config?", r.Driver(), driver, sock)
	}
	return nil
}

// summary is a file's non-comment lines joined with "; ", or "absent".
func summary(path string) (string, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "absent", nil
	}
	if err != nil {
		return "", err
	}
	var lines []string
	for line := range strings.Lines(string(b)) {
		line = strings.TrimSpace(line)
		if line != "" && line[0] != '#' {
			lines = append(lines, line)
		}
	}
	if len(lines) == 0 {
		return "empty", nil
	}
	return strings.Join(lines, "; "), nil
}

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
