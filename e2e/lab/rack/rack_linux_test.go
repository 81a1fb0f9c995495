package rack

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
	"github.com/kilnhq/kiln/e2e/lab/netns"
	"github.com/kilnhq/kiln/imagebuilder/disk"
	"github.com/kilnhq/kiln/imagebuilder/rootfs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// serveEnv makes the test binary act as the lab supervisor (what `kilnctl
// lab serve` does), so Up and Down are tested across processes.
const serveEnv = "KILN_RACK_TEST_SERVE"

func TestMain(m *testing.M) {
	if dir := os.Getenv(serveEnv); dir != "" {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
		err := Serve(ctx, dir, slog.New(slog.NewTextHandler(os.Stderr, nil)))
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, "serve:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// machineState is what a user would compare before and after a lab.
type machineState struct {
	netns, links, tables, mounts, cgroups, loops []string
}

func lines(t *testing.T, name string, args ...string) []string {
	t.Helper()
	out, err := exec.Command(name, args...).Output()
	require.NoError(t, err, "%s %v", name, args)
	var ls []string
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			ls = append(ls, strings.Fields(l)[0])
		}
	}
	return ls
}

func snapshot(t *testing.T) machineState {
	t.Helper()
	var s machineState
	s.netns = lines(t, "ip", "netns", "list")
	s.links = lines(t, "sh", "-c", "ip -o link show | cut -d: -f2 | cut -d@ -f1")
	s.tables = lines(t, "sh", "-c", "nft list tables | sed 's/^table //; s/ /:/'")
	b, err := os.ReadFile("/proc/self/mounts")
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 {
			s.mounts = append(s.mounts, f[1])
		}
	}
	s.cgroups, _ = filepath.Glob("/sys/fs/cgroup/*/kiln-*")
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		b, _ := os.ReadFile(f)
		s.loops = append(s.loops, strings.TrimSpace(string(b)))
	}
	return s
}

func diff(before, after []string) []string {
	var extra []string
	for _, x := range after {
		if !slices.Contains(before, x) {
			extra = append(extra, x)
		}
	}
	return extra
}

func needLab(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root for namespaces, bridges and nftables")
	}
	for tool, pkg := range map[string]string{"ip": "iproute2", "nft": "nftables", "ipmi_sim": "openipmi", "ipmitool": "ipmitool"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian package %s)", tool, pkg)
		}
	}
}

func redfishGet(t *testing.T, url string, c Credentials) int {
	t.Helper()
	cl := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // lab emulator, self-signed
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	req.SetBasicAuth(c.Username, c.Password)
	resp, err := cl.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	return resp.StatusCode
}

// redfishReset sets a one-time boot override to target (none when "")
// and sends a ComputerSystem.Reset.
func redfishReset(t *testing.T, base string, c Credentials, target, resetType string) {
	t.Helper()
	cl := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // lab emulator, self-signed
	do := func(method, path, body string) {
		req, err := http.NewRequest(method, base+path, strings.NewReader(body))
		require.NoError(t, err)
		req.SetBasicAuth(c.Username, c.Password)
		req.Header.Set("Content-Type", "application/json")
		resp, err := cl.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Less(t, resp.StatusCode, 300, "%s %s", method, path)
	}
	if target != "" {
		do(http.MethodPatch, "/redfish/v1/Systems/1", `{"Boot":{"BootSourceOverrideTarget":"`+target+`","BootSourceOverrideEnabled":"Once"}}`)
	}
	do(http.MethodPost, "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset", `{"ResetType":"`+resetType+`"}`)
}

func ipmiPower(t *testing.T, addr string, c Credentials, args ...string) string {
	t.Helper()
	return ipmitool(t, addr, c, append([]string{"chassis", "power"}, args...)...)
}

func ipmitool(t *testing.T, addr string, c Credentials, args ...string) string {
	t.Helper()
	host, port, _ := strings.Cut(addr, ":")
	cmd := exec.Command("ipmitool", append([]string{"-I", "lanplus", "-C", "3", "-H", host, "-p", port, "-U", c.Username, "-E"}, args...)...)
	cmd.Env = append(os.Environ(), "IPMITOOL_PASSWORD="+c.Password)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "ipmitool: %s", out)
	return strings.TrimSpace(string(out))
}

// TestUpDown brings up a lab of two Redfish hosts and one IPMI host
// through a supervisor process, powers hosts on through their BMCs, and
// tears it down — once with the supervisor alive and once after it was
// killed — checking that no namespace, link, nft table, mount or process
// of the lab remains.
func TestUpDown(t *testing.T) {
	needLab(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	bin := t.TempDir()
	chassis, err := ipmisim.BuildChassis(ctx, bin)
	if err != nil {
		testenv.Skipf(t, "cannot build kiln-chassis: %v", err)
	}
	debianRoot := ""
	if _, err := exec.LookPath("systemd-nspawn"); err == nil && !testing.Short() {
		if debianRoot, err = rootfs.Build(ctx, rootfs.Spec{Packages: []string{"procps"}}, nil); err != nil {
			t.Logf("no Debian root (%v): testing without a disk boot", err)
			debianRoot = ""
		}
	}
	agent := filepath.Join(bin, "agent")
	require.NoError(t, os.WriteFile(agent, []byte("#!/bin/sh\nexec sleep infinity\n"), 0o755))

	for _, crash := range []bool{false, true} {
		t.Run(fmt.Sprintf("supervisor crashed=%v", crash), func(t *testing.T) {
			before := snapshot(t)
			dir := filepath.Join(t.TempDir(), "lab")
			name := fmt.Sprintf("t%d", os.Getpid()%100000)
			rep, err := Up(ctx, Options{
				Name: name, Hosts: 2, IPMI: 1, StateDir: dir, DiskSize: 1 << 30,
				AgentBinary: agent, ControllerURL: "10.0.0.1:7443",
				ServeCommand: []string{os.Args[0], "-test.run=^$"}, ServeEnv: []string{serveEnv + "=" + dir},
				ChassisCommand: []string{chassis},
			})
			require.NoError(t, err)
			t.Cleanup(func() { _ = Down(context.Background(), dir, nil) })

			require.True(t, rep.Running, "supervisor not running")
			// Hosts running Kubernetes need more inotify instances than
			// Debian's 128 (shared by every host).
			if b, err := os.ReadFile("/proc/sys/fs/inotify/max_user_instances"); err == nil {
				if n, _ := strconv.Atoi(strings.TrimSpace(string(b))); n < inotifyInstances {
					t.Errorf("fs.inotify.max_user_instances = %d after lab up, want at least %d", n, inotifyInstances)
				}
			}

			// A second lab of the same name must not adopt (and later
			// remove) this one's guard and bridge.
			dir2 := filepath.Join(t.TempDir(), "lab2")
			_, err = Up(ctx, Options{
				Name: name, Hosts: 1, StateDir: dir2,
				ServeCommand: []string{os.Args[0], "-test.run=^$"}, ServeEnv: []string{serveEnv + "=" + dir2},
			})
			if err == nil || !strings.Contains(err.Error(), "exists") {
				t.Errorf("Up of a second lab named %q = %v, want an error saying the guard exists", name, err)
			}
			if got := diff(before.tables, snapshot(t).tables); !slices.Contains(got, "inet:kiln-lab-"+name) {
				t.Errorf("the failed second Up removed the first lab's nft table")
			}
			require.Len(t, rep.Hosts, 3)
			// The bridge keeps the MAC it was made with as hosts join
			// (netns.BridgeMAC): hosts up before keep reaching the gateway.
			if b, err := os.ReadFile(filepath.Join("/sys/class/net", rep.Bridge, "address")); err != nil || strings.TrimSpace(string(b)) != netns.BridgeMAC(rep.Bridge) {
				t.Errorf("bridge %s MAC = %q (%v), want its fixed %s", rep.Bridge, strings.TrimSpace(string(b)), err, netns.BridgeMAC(rep.Bridge))
			}
			if got := diff(before.tables, snapshot(t).tables); !slices.Contains(got, "inet:kiln-lab-"+name) {
				t.Errorf("nft tables added = %v, want inet kiln-lab-%s", got, name)
			}
			st, err := os.Stat(filepath.Join(dir, CredentialsFile))
			require.NoError(t, err)
			if st.Mode().Perm() != 0o600 {
				t.Errorf("credentials mode = %v, want 0600", st.Mode().Perm())
			}
			stateJSON, _ := os.ReadFile(filepath.Join(dir, StateFile))
			serveLog, _ := os.ReadFile(filepath.Join(dir, ServeLog))
			for _, h := range rep.Hosts {
				c := rep.Credentials[h.Name]
				require.NotEmpty(t, c.Password, "host %s has no credentials", h.Name)
				if strings.Contains(string(stateJSON), c.Password) || strings.Contains(string(serveLog), c.Password) {
					t.Errorf("host %s: BMC password written into the state file or the log", h.Name)
				}
			}

			// Redfish hosts answer with their credentials only, and power on.
			h1 := rep.Hosts[0]
			require.Equal(t, ProtocolRedfish, h1.BMC.Protocol)
			if code := redfishGet(t, h1.BMC.Address+"/redfish/v1/Systems/1", rep.Credentials[h1.Name]); code != http.StatusOK {
				t.Errorf("GET Systems/1 with the host's credentials = %d, want 200", code)
			}
			if code := redfishGet(t, h1.BMC.Address+"/redfish/v1/Systems/1", Credentials{"admin", "wrong"}); code != http.StatusUnauthorized {
				t.Errorf("GET Systems/1 with a wrong password = %d, want 401", code)
			}
			redfishReset(t, h1.BMC.Address, rep.Credentials[h1.Name], "Pxe", "On")

			// h2 boots a real disk under systemd-nspawn (when a Debian root
			// can be had), so teardown must also end nspawn, unmount the
			// disk, detach its loop device and remove its cgroups.
			if debianRoot != "" {
				h2 := rep.Hosts[1]
				_, err := disk.Build(ctx, disk.Spec{RootDir: debianRoot, Output: h2.Disk}, nil)
				require.NoError(t, err)
				redfishReset(t, h2.BMC.Address, rep.Credentials[h2.Name], "", "On")
				waitFor(t, "h2 booted under nspawn", 2*time.Minute, func() bool {
					b, _ := os.ReadFile(filepath.Join("/sys/fs/cgroup/pids", h2.Machine, "pids.current"))
					n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
					return n > 3
				})
			}

			// The IPMI host powers on through ipmi_sim.
			h3 := rep.Hosts[2]
			require.Equal(t, ProtocolIPMI, h3.BMC.Protocol)
			if got := ipmiPower(t, h3.BMC.Address, rep.Credentials[h3.Name], "status"); got != "Chassis Power is off" {
				t.Errorf("ipmitool power status = %q, want off", got)
			}
			ipmitool(t, h3.BMC.Address, rep.Credentials[h3.Name], "chassis", "bootdev", "pxe")
			ipmiPower(t, h3.BMC.Address, rep.Credentials[h3.Name], "on")
			if got := ipmiPower(t, h3.BMC.Address, rep.Credentials[h3.Name], "status"); got != "Chassis Power is on" {
				t.Errorf("ipmitool power status after on = %q, want on", got)
			}

			// The powered hosts run their boot agents in their namespaces.
			rep, err = Status(dir)
			require.NoError(t, err)
			var pids []string
			for _, r := range rep.Resources {
				if r.Kind == netns.KindPID {
					pids = append(pids, r.Value)
				}
			}
			pids = append(pids, rep.Serve)
			require.GreaterOrEqual(t, len(pids), 4, "want ipmi_sim, two agents and the supervisor recorded: %v", pids)

			if crash {
				pid := 0
				fmt.Sscanf(rep.Serve, "%d:", &pid)
				require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
				for netns.ProcessAlive(rep.Serve) {
					time.Sleep(50 * time.Millisecond)
				}
			}
			require.NoError(t, Down(ctx, dir, slog.New(slog.NewTextHandler(testWriter{t}, nil))))

			var veths []string
			for _, h := range rep.Hosts {
				veths = append(veths, netns.VethName(name, h.Name))
			}
			after := snapshot(t)
			for _, c := range []struct {
				what          string
				before, after []string
			}{{"network namespace", before.netns, after.netns}, {"link", before.links, after.links}, {"nft table", before.tables, after.tables}, {"mount", before.mounts, after.mounts},
				{"cgroup", before.cgroups, after.cgroups}, {"loop device", before.loops, after.loops}} {
				// Other labs may come and go on a shared machine: look at ours.
				extra := slices.DeleteFunc(diff(c.before, c.after), func(x string) bool {
					return !strings.Contains(x, name) && !strings.Contains(x, dir) && !slices.Contains(veths, x)
				})
				if len(extra) > 0 {
					t.Errorf("after Down: %s left behind: %v", c.what, extra)
				}
			}
			for _, p := range pids {
				if netns.ProcessAlive(p) {
					t.Errorf("after Down: process %s still running", p)
				}
			}
			if _, err := os.Stat(dir); err == nil {
				t.Errorf("after Down: state dir %s still there", dir)
			}
		})
	}
}

func TestUpInvalid(t *testing.T) {
	tests := []struct {
		name string
		opts Options
	}{
		{"no hosts", Options{ServeCommand: []string{"x"}}},
		{"long name", Options{Name: "waytoolongname", Hosts: 1, ServeCommand: []string{"x"}}},
		{"bad name", Options{Name: "Lab_1", Hosts: 1, ServeCommand: []string{"x"}}},
		{"ipmi without chassis", Options{IPMI: 1, ServeCommand: []string{"x"}}},
		{"unknown backend", Options{Hosts: 1, Backend: "xen", ServeCommand: []string{"x"}}},
		{"no serve command", Options{Hosts: 1, StateDir: t.TempDir()}},
		{"boot URL not http", Options{Hosts: 1, BootURL: "tftp://10.0.0.1/{host}", ServeCommand: []string{"x"}}},
		{"boot URL without host", Options{Hosts: 1, BootURL: "http://{gateway}:8080/boot/ipxe/h1", ServeCommand: []string{"x"}}},
		{"qemu boot URL not the boot server's route", Options{Hosts: 1, Backend: BackendQEMU, BootURL: "http://{gateway}:8080/pxe/{host}", ServeCommand: []string{"x"}}},
		{"libvirt boot URL not the boot server's route", Options{Hosts: 1, Backend: BackendLibvirt, BootURL: "http://{gateway}:8080/boot/ipxe/{host}/x", ServeCommand: []string{"x"}}},
		{"memory on netns", Options{Hosts: 1, MemoryMB: 2048, ServeCommand: []string{"x"}}},
		{"negative CPUs", Options{Hosts: 1, Backend: BackendLibvirt, CPUs: -1, ServeCommand: []string{"x"}}},
		{"unknown redfish auth", Options{Hosts: 1, RedfishAuth: []string{"digest"}, ServeCommand: []string{"x"}}},
		{"more redfish auths than hosts", Options{Hosts: 1, RedfishAuth: []string{"basic", "basic"}, ServeCommand: []string{"x"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := Up(context.Background(), tt.opts); err == nil {
				t.Errorf("Up(%+v) = nil error, want one", tt.opts)
			}
		})
	}
}

// TestQEMUHostLimit: without KVM a qemu lab refuses more hosts than the
// machine can run, naming the limit and KVM.
func TestQEMUHostLimit(t *testing.T) {
	t.Setenv("KILN_QEMU_ACCEL", "")
	for _, backend := range []string{BackendQEMU, BackendLibvirt} {
		_, err := Up(context.Background(), Options{Hosts: 2, IPMI: 1, Backend: backend, ChassisCommand: []string{"x"}, ServeCommand: []string{"x"}})
		require.Error(t, err, backend)
		for _, want := range []string{"3 " + backend + " hosts", "at most 2", "KVM"} {
			require.Contains(t, err.Error(), want)
		}
	}
}

// TestUpDownQEMU brings up a one-host qemu lab, powers the VM on with a
// blank disk through its Redfish emulator (no OS boots: QEMU's firmware
// just runs), checks the QEMU process runs and is recorded, powers it off,
// and checks Down leaves no process or file of the lab.
func TestUpDownQEMU(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root for the bridge and nftables")
	}
	for tool, pkg := range map[string]string{"ip": "iproute2", "nft": "nftables", "qemu-system-x86_64": "qemu-system-x86", "dnsmasq": "dnsmasq-base"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian package %s)", tool, pkg)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for _, crash := range []bool{false, true} {
		t.Run(fmt.Sprintf("supervisor crashed=%v", crash), func(t *testing.T) {
			before := snapshot(t)
			dir := filepath.Join(t.TempDir(), "lab")
			name := fmt.Sprintf("q%d", os.Getpid()%100000)
			rep, err := Up(ctx, Options{
				Name: name, Hosts: 1, Backend: BackendQEMU, StateDir: dir, DiskSize: 64 << 20,
				ServeCommand: []string{os.Args[0], "-test.run=^$"}, ServeEnv: []string{serveEnv + "=" + dir},
			})
			require.NoError(t, err)
			t.Cleanup(func() { _ = Down(context.Background(), dir, nil) })
			require.Len(t, rep.Hosts, 1)
			h := rep.Hosts[0]
			require.Equal(t, BackendQEMU, rep.Backend)
			require.Equal(t, ProtocolRedfish, h.BMC.Protocol)
			require.Equal(t, "kiln-"+name+"-h1", h.Machine)
			fi, err := os.Stat(h.Disk)
			require.NoError(t, err, "the host's disk")
			require.Equal(t, int64(64<<20), fi.Size())
			c := rep.Credentials[h.Name]

			powerState := func() string {
				cl := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // lab emulator, self-signed
				req, err := http.NewRequest(http.MethodGet, h.BMC.Address+"/redfish/v1/Systems/1", nil)
				require.NoError(t, err)
				req.SetBasicAuth(c.Username, c.Password)
				resp, err := cl.Do(req)
				require.NoError(t, err)
				defer resp.Body.Close()
				var sys struct{ PowerState string }
				require.NoError(t, json.NewDecoder(resp.Body).Decode(&sys))
				return sys.PowerState
			}
			require.Equal(t, "Off", powerState())
			redfishReset(t, h.BMC.Address, c, "Hdd", "On")
			require.Equal(t, "On", powerState())

			rep, err = Status(dir)
			require.NoError(t, err)
			var pids, dirs []string
			for _, r := range rep.Resources {
				switch r.Kind {
				case netns.KindPID:
					if r.Value == rep.DHCP {
						continue
					}
					pids = append(pids, r.Value)
				case netns.KindDir:
					dirs = append(dirs, r.Value)
				}
			}
			require.Len(t, pids, 1, "the QEMU process recorded: %v", rep.Resources)
			require.True(t, netns.ProcessAlive(pids[0]), "QEMU %s not running", pids[0])
			var pid int
			fmt.Sscanf(pids[0], "%d:", &pid)
			comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
			require.Contains(t, string(comm), "qemu")
			require.Contains(t, dirs, h.Dir)
			sock := ""
			for _, d := range dirs {
				if strings.Contains(filepath.Base(d), "kiln-qmp-") {
					sock = d
				}
			}
			require.NotEmpty(t, sock, "the QMP socket directory recorded: %v", dirs)
			require.FileExists(t, filepath.Join(sock, "qmp.sock"))
			// The VM's NIC is a tap in the lab bridge; dnsmasq serves it.
			requireOnBridge(t, rep)
			pids = append(pids, rep.DHCP)

			if crash {
				var spid int
				fmt.Sscanf(rep.Serve, "%d:", &spid)
				require.NoError(t, syscall.Kill(spid, syscall.SIGKILL))
				for netns.ProcessAlive(rep.Serve) {
					time.Sleep(50 * time.Millisecond)
				}
				require.True(t, netns.ProcessAlive(pids[0]), "QEMU outlives its killed supervisor")
			} else {
				redfishReset(t, h.BMC.Address, c, "", "ForceOff")
				require.Equal(t, "Off", powerState())
				require.True(t, netns.ProcessAlive(pids[0]), "QEMU stays (paused) while the host is off")
			}

			require.NoError(t, Down(ctx, dir, slog.New(slog.NewTextHandler(testWriter{t}, nil))))
			for _, p := range append(pids, rep.Serve) {
				if netns.ProcessAlive(p) {
					t.Errorf("after Down: process %s still running", p)
				}
			}
			for _, p := range []string{dir, sock, h.Disk} {
				if _, err := os.Stat(p); err == nil {
					t.Errorf("after Down: %s still there", p)
				}
			}
			after := snapshot(t)
			for _, c := range []struct {
				what          string
				before, after []string
			}{{"link", before.links, after.links}, {"nft table", before.tables, after.tables}} {
				extra := slices.DeleteFunc(diff(c.before, c.after), func(x string) bool { return !strings.Contains(x, name) })
				if len(extra) > 0 {
					t.Errorf("after Down: %s left behind: %v", c.what, extra)
				}
			}
		})
	}
}

// TestUpDownLibvirt brings up a one-host libvirt lab (the system libvirtd
// when its socket answers, else a private one the supervisor starts),
// powers the domain on with a blank disk through its Redfish emulator,
// checks libvirt runs it (virsh domstate) and its QEMU is recorded, and
// checks Down leaves no domain, libvirtd, QEMU, file, link or nft table of
// the lab, after a clean stop and after the supervisor was killed.
func TestUpDownLibvirt(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.Skip(t, "needs root for the bridge, nftables and libvirtd")
	}
	for tool, pkg := range map[string]string{"ip": "iproute2", "nft": "nftables", "qemu-system-x86_64": "qemu-system-x86",
		"libvirtd": "libvirt-daemon-system", "virsh": "libvirt-clients", "unshare": "util-linux", "dnsmasq": "dnsmasq-base"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not installed (Debian package %s)", tool, pkg)
		}
	}
	// Long: Up waits while another private libvirtd runs (libvirt.LockFile).
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	for _, crash := range []bool{false, true} {
		t.Run(fmt.Sprintf("supervisor crashed=%v", crash), func(t *testing.T) {
			before := snapshot(t)
			// Short: the private libvirtd's socket lives in it (108 bytes).
			dir, err := os.MkdirTemp("", "kiln-lvlab-")
			require.NoError(t, err)
			t.Cleanup(func() { os.RemoveAll(dir) })
			dir = filepath.Join(dir, "lab")
			name := fmt.Sprintf("v%d", os.Getpid()%100000)
			rep, err := Up(ctx, Options{
				Name: name, Hosts: 1, Backend: BackendLibvirt, StateDir: dir, DiskSize: 64 << 20,
				ServeCommand: []string{os.Args[0], "-test.run=^$"}, ServeEnv: []string{serveEnv + "=" + dir},
			})
			require.NoError(t, err)
			t.Cleanup(func() { _ = Down(context.Background(), dir, nil) })
			require.Len(t, rep.Hosts, 1)
			h := rep.Hosts[0]
			require.Equal(t, BackendLibvirt, rep.Backend)
			require.NotEmpty(t, rep.LibvirtSocket)
			t.Logf("libvirtd at %s (private: %v)", rep.LibvirtSocket, rep.LibvirtPrivate)
			dom := "kiln-" + name + "-h1"
			require.Equal(t, dom, h.Machine)
			virsh := func(args ...string) (string, error) {
				out, err := exec.Command("virsh", append([]string{"-c", "qemu:///system?socket=" + rep.LibvirtSocket}, args...)...).CombinedOutput()
				return strings.TrimSpace(string(out)), err
			}
			st, err := virsh("domstate", dom)
			require.NoError(t, err, "virsh domstate %s: %s", dom, st)
			require.Equal(t, "shut off", st)

			c := rep.Credentials[h.Name]
			redfishReset(t, h.BMC.Address, c, "Hdd", "On")
			st, err = virsh("domstate", dom)
			require.NoError(t, err, st)
			require.Equal(t, "running", st, "virsh domstate after a Redfish power on")

			rep, err = Status(dir)
			require.NoError(t, err)
			require.True(t, rep.Running)
			var pids []string
			for _, r := range rep.Resources {
				if r.Kind == netns.KindPID && r.Value != rep.DHCP {
					pids = append(pids, r.Value)
				}
			}
			want := 1 // QEMU
			if rep.LibvirtPrivate {
				want = 2 // and libvirtd
			}
			require.Len(t, pids, want, "processes recorded: %v", rep.Resources)
			// The domain's NIC is in the lab bridge; dnsmasq serves it.
			requireOnBridge(t, rep)
			pids = append(pids, rep.DHCP)
			for _, p := range pids {
				require.True(t, netns.ProcessAlive(p), "recorded process %s not running", p)
			}
			require.Contains(t, rep.Resources, netns.Resource{Kind: KindDomain, Value: dom})

			if crash {
				var spid int
				fmt.Sscanf(rep.Serve, "%d:", &spid)
				require.NoError(t, syscall.Kill(spid, syscall.SIGKILL))
				for netns.ProcessAlive(rep.Serve) {
					time.Sleep(50 * time.Millisecond)
				}
				for _, p := range pids {
					require.True(t, netns.ProcessAlive(p), "%s outlives its killed supervisor", p)
				}
			}

			t0 := time.Now()
			require.NoError(t, Down(ctx, dir, slog.New(slog.NewTextHandler(testWriter{t}, nil))))
			t.Logf("lab down took %s", time.Since(t0).Round(time.Millisecond))
			for _, p := range append(pids, rep.Serve) {
				if netns.ProcessAlive(p) {
					t.Errorf("after Down: process %s still running", p)
				}
			}
			if rep.LibvirtPrivate {
				for _, p := range []string{"/etc/libvirt/qemu/" + dom + ".xml", "/run/libvirt/qemu/" + dom + ".pid", "/run/libvirt/qemu/" + dom + ".xml", "/var/log/libvirt/qemu/" + dom + ".log"} {
					if _, err := os.Stat(p); err == nil {
						t.Errorf("after Down: %s (the domain at the private libvirtd) still there", p)
					}
				}
			} else if out, err := virsh("dominfo", dom); err == nil {
				t.Errorf("after Down: domain %s still defined:\n%s", dom, out)
			}
			for _, p := range []string{dir, h.Disk} {
				if _, err := os.Stat(p); err == nil {
					t.Errorf("after Down: %s still there", p)
				}
			}
			after := snapshot(t)
			for _, c := range []struct {
				what          string
				before, after []string
			}{{"link", before.links, after.links}, {"nft table", before.tables, after.tables}} {
				extra := slices.DeleteFunc(diff(c.before, c.after), func(x string) bool { return !strings.Contains(x, name) })
				if len(extra) > 0 {
					t.Errorf("after Down: %s left behind: %v", c.what, extra)
				}
			}
		})
	}
}

// requireOnBridge checks that the lab's single VM host has its NIC in the
// lab bridge (a port whose address is the NIC's MAC with the tap's fe:
// prefix, as QEMU's taps and libvirt's vnetN are) and that the lab's
// dnsmasq, recorded as a process, runs.
func requireOnBridge(t *testing.T, rep *Report) {
	t.Helper()
	h := rep.Hosts[0]
	ports, err := os.ReadDir(filepath.Join("/sys/class/net", rep.Bridge, "brif"))
	require.NoError(t, err, "bridge %s", rep.Bridge)
	var found []string
	for _, p := range ports {
		mac, _ := os.ReadFile(filepath.Join("/sys/class/net", p.Name(), "address"))
		found = append(found, p.Name()+"="+strings.TrimSpace(string(mac)))
		if strings.TrimSpace(string(mac)) == "fe"+h.MAC[2:] {
			require.NotEmpty(t, rep.DHCP, "the lab's dnsmasq in the state")
			require.Contains(t, rep.Resources, netns.Resource{Kind: netns.KindPID, Value: rep.DHCP})
			require.True(t, netns.ProcessAlive(rep.DHCP), "dnsmasq %s not running", rep.DHCP)
			require.True(t, strings.HasPrefix(h.Address, strings.TrimSuffix(rep.Gateway, ".1")+"."), "host address %s on the lab subnet %s", h.Address, rep.Subnet)
			return
		}
	}
	t.Fatalf("no port of bridge %s is the NIC of %s (MAC %s): %v", rep.Bridge, h.Name, h.MAC, found)
}

func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %s", what, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}
