package nspawn

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

func TestArgs(t *testing.T) {
	base := []string{"-D", "/r", "-M", "m1", "-b", "--register=no", "--keep-unit"}
	common := []string{"--system-call-filter=@keyring", "--resolv-conf=off", "--timezone=off",
		"--link-journal=no", "--console=read-only", "--bind=/dev/kmsg"}
	cat := func(parts ...[]string) []string { return slices.Concat(parts...) }
	for _, tc := range []struct {
		name    string
		o       Options
		want    []string
		wantEnv []string
	}{
		{"netns", Options{Name: "m1", Dir: "/r", NetNS: "/run/netns/n1"},
			cat(base, []string{"--network-namespace-path=/run/netns/n1", "--capability=all"}, common),
			[]string{"SYSTEMD_NSPAWN_API_VFS_WRITABLE=network"}},
		{"private network", Options{Name: "m1", Dir: "/r"},
			cat(base, []string{"--private-network", "--capability=all"}, common),
			[]string{"SYSTEMD_NSPAWN_API_VFS_WRITABLE=network"}},
		{"host network: no net admin, read-only /proc/sys/net", Options{Name: "m1", Dir: "/r", HostNetwork: true, NetNS: "/ignored"},
			cat(base, common), nil},
		{"binds then extra", Options{Name: "m1", Dir: "/r", NetNS: "/n", Binds: []string{"--bind=/a:/b", "--bind-ro=/c:/d"}, Extra: []string{"--volatile=overlay"}},
			cat(base, []string{"--network-namespace-path=/n", "--capability=all"}, common, []string{"--bind=/a:/b", "--bind-ro=/c:/d", "--volatile=overlay"}),
			[]string{"SYSTEMD_NSPAWN_API_VFS_WRITABLE=network"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Args(tc.o); !slices.Equal(got, tc.want) {
				t.Errorf("Args(%+v) = %q, want %q", tc.o, got, tc.want)
			}
			if got := Env(tc.o); !slices.Equal(got, tc.wantEnv) {
				t.Errorf("Env(%+v) = %q, want %q", tc.o, got, tc.wantEnv)
			}
		})
	}
}

func TestPropagateDir(t *testing.T) {
	if got, want := PropagateDir("kiln-a"), "/run/systemd/nspawn/propagate/kiln-a"; got != want {
		t.Errorf("PropagateDir(%q) = %q, want %q", "kiln-a", got, want)
	}
}

func TestShellQuote(t *testing.T) {
	args := []string{"plain", "a b", "it's", `$HOME "x"`, ""}
	out, err := exec.Command("sh", "-c", "printf '%s\\n' "+ShellQuote(args)).Output()
	if err != nil {
		t.Fatalf("sh: %v", err)
	}
	if got, want := string(out), strings.Join(args, "\n")+"\n"; got != want {
		t.Errorf("sh printf %s = %q, want %q", ShellQuote(args), got, want)
	}
	if got, want := JoinScript([]string{"/a b/cgroup.procs"}), `for p in '/a b/cgroup.procs'; do echo $$ > "$p" || exit 1; done`; got != want {
		t.Errorf("JoinScript() = %q, want %q", got, want)
	}
}
