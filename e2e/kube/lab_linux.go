package kube

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Net is a lab network: a bridge with an address on the host, one network
// namespace per node with a veth into the bridge, and an nftables guard
// that drops forwarded traffic leaving through the host's uplink, so that
// nothing from the lab reaches the outside network.
type Net struct {
	Bridge  string // e.g. kilnkb0
	Prefix  string // first three octets, e.g. "10.252.0"
	Uplink  string // the host's default-route interface
	Table   string // nft table name
	created []func() error
}

// Addr returns the address of the n-th lab address (1 is the bridge).
func (n *Net) Addr(i int) string { return fmt.Sprintf("%s.%d", n.Prefix, i) }

// run runs a host command and returns its combined output in the error.
func run(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return string(out), nil
}

// uplink returns the interface of the host's default route.
func uplink(ctx context.Context) (string, error) {
	out, err := run(ctx, "ip", "-o", "route", "show", "default")
	if err != nil {
		return "", err
	}
	f := strings.Fields(out)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "dev" {
			return f[i+1], nil
		}
	}
	return "", errors.New("no default route: cannot name the uplink to guard")
}

// NewNet creates the guard first, then the bridge. Close undoes
// everything it created, in reverse.
func NewNet(ctx context.Context, bridge, prefix, table string) (*Net, error) {
	up, err := uplink(ctx)
	if err != nil {
		return nil, err
	}
	n := &Net{Bridge: bridge, Prefix: prefix, Uplink: up, Table: table}
	steps := []struct {
		do   [][]string
		undo []string
	}{
		{[][]string{
			{"nft", "add", "table", "inet", table},
			{"nft", "add", "chain", "inet", table, "guardfwd", "{ type filter hook forward priority -200; policy accept; }"},
			{"nft", "add", "rule", "inet", table, "guardfwd", "oifname", up, "counter", "drop"},
		}, []string{"nft", "delete", "table", "inet", table}},
		{[][]string{
			{"ip", "link", "add", bridge, "type", "bridge"},
			{"ip", "addr", "add", n.Addr(1) + "/24", "dev", bridge},
			{"ip", "link", "set", bridge, "up"},
		}, []string{"ip", "link", "del", bridge}},
	}
	for _, s := range steps {
		undo := s.undo
		n.created = append(n.created, func() error { _, err := run(context.Background(), undo[0], undo[1:]...); return err })
		for _, c := range s.do {
			if _, err := run(ctx, c[0], c[1:]...); err != nil {
				return n, err
			}
		}
	}
	return n, nil
}

// AddNode creates network namespace ns with address Addr(i)/24 on eth0,
// a veth into the bridge, and a default route via the bridge.
func (n *Net) AddNode(ctx context.Context, ns string, i int) error {
	host := fmt.Sprintf("%sv%d", n.Bridge, i)
	n.created = append(n.created, func() error {
		_, err := run(context.Background(), "ip", "netns", "del", ns)
		return err
	})
	for _, c := range [][]string{
		{"ip", "netns", "add", ns},
		{"ip", "link", "add", host, "type", "veth", "peer", "name", host + "c"},
		{"ip", "link", "set", host, "master", n.Bridge, "up"},
		{"ip", "link", "set", host + "c", "netns", ns},
		{"ip", "-n", ns, "link", "set", host + "c", "name", "eth0"},
		{"ip", "-n", ns, "addr", "add", n.Addr(i) + "/24", "dev", "eth0"},
		{"ip", "-n", ns, "link", "set", "eth0", "up"},
		{"ip", "-n", ns, "link", "set", "lo", "up"},
		{"ip", "-n", ns, "route", "add", "default", "via", n.Addr(1)},
	} {
		if _, err := run(ctx, c[0], c[1:]...); err != nil {
			return err
		}
	}
	return nil
}

// Close removes what NewNet and AddNode created (namespaces first, then
// the bridge, then the guard), and returns every error.
func (n *Net) Close() error {
	var errs []error
	for i := len(n.created) - 1; i >= 0; i-- {
		errs = append(errs, n.created[i]())
	}
	n.created = nil
	return errors.Join(errs...)
}

// Node is a lab host: a Debian root with systemd as PID 1 under
// systemd-nspawn, in its own network namespace, its root an overlay of
// the lab's shared lower layers and its own upper directory.
type Node struct {
	Name   string   // machine and host name
	NetNS  string   // network namespace name (/run/netns/NAME)
	Dir    string   // the node's own files: upper, work, root, containerd, console.log
	Lower  []string // overlay lower directories, top first
	Binds  []string // extra nspawn --bind/--bind-ro arguments
	Root   string   // the merged root, Dir/root
	Leader int      // PID of the node's systemd (0 when not running)

	cmd     *exec.Cmd
	done    chan struct{}
	cgroups []string
	mounted bool
}

// Mount mounts the node's overlay root so that files can be put in it
// before it boots.
func (n *Node) Mount(ctx context.Context) error {
	n.Root = filepath.Join(n.Dir, "root")
	for _, d := range []string{"upper", "work", "root", "containerd"} {
		if err := os.MkdirAll(filepath.Join(n.Dir, d), 0o755); err != nil {
			return err
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", strings.Join(n.Lower, ":"), filepath.Join(n.Dir, "upper"), filepath.Join(n.Dir, "work"))
	if _, err := run(ctx, "mount", "-t", "overlay", "overlay", "-o", opts, n.Root); err != nil {
		return err
	}
	n.mounted = true
	return nil
}

// Boot starts systemd-nspawn in the node's own cgroups and waits until
// systemd reports the system running (or degraded). It returns the boot
// time.
//
// Equivalent to: `SYSTEMD_NSPAWN_API_VFS_WRITABLE=network systemd-nspawn
// -D ROOT -M NAME -b --register=no --keep-unit
// --network-namespace-path=/run/netns/NS --capability=all
// --system-call-filter=@keyring --resolv-conf=off --timezone=off
// --link-journal=no --console=read-only --bind=/dev/kmsg
// --bind=DIR/containerd:/var/lib/containerd ...`.
func (n *Node) Boot(ctx context.Context) (time.Duration, error) {
	start := time.Now()
	procs, err := n.makeCgroups()
	if err != nil {
		return 0, err
	}
	nspawn, err := exec.LookPath("systemd-nspawn")
	if err != nil {
		return 0, err
	}
	args := []string{"-D", n.Root, "-M", n.Name, "-b", "--register=no", "--keep-unit",
		"--network-namespace-path=/run/netns/" + n.NetNS, "--capability=all", "--system-call-filter=@keyring",
		"--resolv-conf=off", "--timezone=off", "--link-journal=no", "--console=read-only",
		"--bind=/dev/kmsg", "--bind=" + filepath.Join(n.Dir, "containerd") + ":/var/lib/containerd"}
	args = append(args, n.Binds...)
	script := `for p in ` + strings.Join(procs, " ") + `; do echo $$ > "$p"; done; exec "$0" "$@"`
	n.cmd = exec.Command("sh", append([]string{"-c", script, nspawn}, args...)...)
	n.cmd.Env = append(os.Environ(), "SYSTEMD_NSPAWN_API_VFS_WRITABLE=network")
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	logf, err := os.Create(filepath.Join(n.Dir, "console.log"))
	if err != nil {
		return 0, err
	}
	n.cmd.Stdout, n.cmd.Stderr = logf, logf
	if err := n.cmd.Start(); err != nil {
		logf.Close()
		return 0, err
	}
	n.done = make(chan struct{})
	go func() { _ = n.cmd.Wait(); logf.Close(); close(n.done) }()

	for {
		select {
		case <-n.done:
			b, _ := os.ReadFile(filepath.Join(n.Dir, "console.log"))
			return 0, fmt.Errorf("node %s: systemd-nspawn exited: %s", n.Name, tail(string(b), 20))
		case <-ctx.Done():
			return 0, fmt.Errorf("node %s: boot: %w", n.Name, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
		if n.Leader == 0 {
			n.Leader = child(n.cmd.Process.Pid)
			continue
		}
		out, _ := exec.CommandContext(ctx, "nsenter", "-t", strconv.Itoa(n.Leader), "-a", "systemctl", "is-system-running").Output()
		switch strings.TrimSpace(string(out)) {
		case "running", "degraded":
			return time.Since(start), nil
		}
	}
}

// Exec runs a command inside the node (all its namespaces).
//
// Equivalent to: `nsenter -t LEADER -a CMD...`.
func (n *Node) Exec(ctx context.Context, name string, args ...string) (string, error) {
	if n.Leader == 0 {
		return "", fmt.Errorf("node %s is not running", n.Name)
	}
	return run(ctx, "nsenter", append([]string{"-t", strconv.Itoa(n.Leader), "-a", name}, args...)...)
}

// Stop powers the node off (systemctl poweroff inside; SIGTERM then
// SIGKILL of its nspawn process, by PID, when it does not end), unmounts
// its root and removes its cgroups and nspawn's leftovers.
func (n *Node) Stop() error {
	var errs []error
	if n.cmd != nil && n.cmd.Process != nil {
		select {
		case <-n.done:
		default:
			if n.Leader != 0 {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				_, _ = n.Exec(ctx, "systemctl", "poweroff", "--no-block")
				cancel()
			}
			select {
			case <-n.done:
			case <-time.After(45 * time.Second):
				_ = n.cmd.Process.Signal(syscall.SIGTERM)
				select {
				case <-n.done:
				case <-time.After(15 * time.Second):
					_ = n.cmd.Process.Kill()
					<-n.done
				}
			}
		}
		n.Leader = 0
	}
	_ = os.RemoveAll("/run/systemd/nspawn/propagate/" + n.Name)
	if n.mounted {
		if _, err := run(context.Background(), "umount", n.Root); err != nil {
			if _, err2 := run(context.Background(), "umount", "-l", n.Root); err2 != nil {
				errs = append(errs, err)
			}
		}
		n.mounted = false
	}
	errs = append(errs, n.removeCgroups())
	return errors.Join(errs...)
}

// makeCgroups creates a cgroup named for the node in every v1 hierarchy
// (and the v2 one) and returns their cgroup.procs files.
func (n *Node) makeCgroups() ([]string, error) {
	entries, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var procs []string
	for _, e := range entries {
		real, err := filepath.EvalSymlinks(filepath.Join("/sys/fs/cgroup", e.Name()))
		if err != nil || seen[real] {
			continue
		}
		if _, err := os.Stat(filepath.Join(real, "cgroup.procs")); err != nil {
			continue
		}
		seen[real] = true
		d := filepath.Join(real, n.Name)
		if err := os.Mkdir(d, 0o755); err != nil && !os.IsExist(err) {
			continue
		}
		n.cgroups = append(n.cgroups, d)
		if strings.Contains(filepath.Base(real), "cpuset") {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, _ := os.ReadFile(filepath.Join(real, f))
				_ = os.WriteFile(filepath.Join(d, f), b, 0o644)
			}
		}
		procs = append(procs, filepath.Join(d, "cgroup.procs"))
	}
	return procs, nil
}

// removeCgroups removes the node's cgroups, deepest first (kubelet's
// kubepods trees live below them).
func (n *Node) removeCgroups() error {
	var errs []error
	for _, d := range n.cgroups {
		var sub []string
		_ = filepath.WalkDir(d, func(p string, e os.DirEntry, err error) error {
			if err == nil && e.IsDir() {
				sub = append(sub, p)
			}
			return nil
		})
		slices.Reverse(sub)
		for _, s := range sub {
			if err := syscall.Rmdir(s); err != nil && !errors.Is(err, syscall.ENOENT) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", s, err))
			}
		}
	}
	n.cgroups = nil
	return errors.Join(errs...)
}

// child returns the first child of pid, or 0.
func child(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	c, _ := strconv.Atoi(f[0])
	return c
}

func tail(s string, n int) string {
	ls := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(ls[max(0, len(ls)-n):], "\n")
}
