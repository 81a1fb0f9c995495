package kube

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/e2e/lab/nspawn"
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
			{"ip", "link", "add", bridge, "address", netns.BridgeMAC(bridge), "type", "bridge"},
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
// systemd-nspawn (e2e/lab/nspawn), in its own network namespace, its root
// an overlay of the lab's shared lower layers and its own upper directory.
type Node struct {
	Name  string   // machine and host name
	NetNS string   // network namespace name (/run/netns/NAME)
	Dir   string   // the node's own files: upper, work, root, containerd, console.log
	Lower []string // overlay lower directories, top first
	Binds []string // extra nspawn --bind/--bind-ro arguments
	Root  string   // the merged root, Dir/root

	c       *nspawn.Container
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

// Boot starts the node (nspawn.Start, in its own cgroups, with
// /var/lib/containerd bound from a plain directory: containerd's
// snapshots cannot live on overlay) and waits until systemd reports the
// system running (or degraded). It returns the boot time.
func (n *Node) Boot(ctx context.Context) (time.Duration, error) {
	start := time.Now()
	c, err := nspawn.Start(nspawn.Options{
		Name: n.Name, Dir: n.Root, NetNS: "/run/netns/" + n.NetNS,
		Binds:   append([]string{"--bind=" + filepath.Join(n.Dir, "containerd") + ":/var/lib/containerd"}, n.Binds...),
		Console: filepath.Join(n.Dir, "console.log"),
	})
	if err != nil {
		return 0, err
	}
	n.c = c
	if err := c.WaitRunning(ctx); err != nil {
		return 0, fmt.Errorf("node %s: boot: %w", n.Name, err)
	}
	return time.Since(start), nil
}

// Leader is the PID of the node's systemd, 0 when it does not run.
func (n *Node) Leader() int {
	if n.c == nil {
		return 0
	}
	return n.c.Leader()
}

// Exec runs a command inside the node (all its namespaces).
//
// Equivalent to: `nsenter -t LEADER -a CMD...`.
func (n *Node) Exec(ctx context.Context, name string, args ...string) (string, error) {
	if n.c == nil {
		return "", fmt.Errorf("node %s is not running", n.Name)
	}
	return n.c.Exec(ctx, name, args...)
}

// Stop powers the node off (nspawn's Stop: systemctl poweroff inside,
// then SIGTERM and SIGKILL by PID; its cgroups and nspawn's leftovers
// removed) and unmounts its root.
func (n *Node) Stop() error {
	var errs []error
	if n.c != nil {
		errs = append(errs, n.c.Stop(context.Background()))
	}
	if n.mounted {
		if _, err := run(context.Background(), "umount", n.Root); err != nil {
			if _, err2 := run(context.Background(), "umount", "-l", n.Root); err2 != nil {
				errs = append(errs, err)
			}
		}
		n.mounted = false
	}
	return errors.Join(errs...)
}

func tail(s string, n int) string {
	ls := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(ls[max(0, len(ls)-n):], "\n")
}
