package bootmedia_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/imagebuilder/bootmedia/bootmediatest"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

func TestResolveModules(t *testing.T) {
	for _, tc := range []struct {
		names       []string
		want        []string
		wantMissing []string
		wantErr     bool
	}{
		{
			names: []string{"virtio_net"},
			want:  []string{"kernel/net/core/failover.ko", "kernel/drivers/net/net_failover.ko", "kernel/drivers/net/virtio_net.ko"},
		},
		{
			// Dependencies once, in first-needed order; built-ins dropped.
			names: []string{"ext4", "virtio", "net_failover", "virtio_net", "isofs"},
			want: []string{"kernel/lib/crc16.ko", "kernel/fs/mbcache.ko", "kernel/fs/jbd2/jbd2.ko", "kernel/fs/ext4/ext4.ko",
				"kernel/net/core/failover.ko", "kernel/drivers/net/net_failover.ko", "kernel/drivers/net/virtio_net.ko"},
		},
		{names: []string{"nls-iso8859_1"}, want: []string{"kernel/fs/nls/nls_iso8859-1.ko"}},
		{names: []string{"floppy", "ext4"}, want: []string{"kernel/lib/crc16.ko", "kernel/fs/mbcache.ko", "kernel/fs/jbd2/jbd2.ko", "kernel/fs/ext4/ext4.ko"}, wantMissing: []string{"floppy"}},
		{names: []string{"a"}, wantErr: true},
	} {
		got, missing, err := bootmedia.ResolveModules("testdata/modules", tc.names)
		if (err != nil) != tc.wantErr {
			t.Errorf("ResolveModules(%q) error = %v, want error %v", tc.names, err, tc.wantErr)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) || !reflect.DeepEqual(missing, tc.wantMissing) {
			t.Errorf("ResolveModules(%q) = %q missing %q, want %q missing %q", tc.names, got, missing, tc.want, tc.wantMissing)
		}
	}
}

func testArchive(t *testing.T) *bootmedia.Archive {
	dir := t.TempDir()
	big := filepath.Join(dir, "agent")
	require.NoError(t, os.WriteFile(big, bytes.Repeat([]byte("kiln"), 1000), 0o755))
	ar := &bootmedia.Archive{}
	ar.Add(bootmedia.Entry{Path: "init", Mode: 0o755, Data: []byte("#!/bin/sh\necho hi\n")})
	ar.Add(bootmedia.Entry{Path: "sbin/kiln-agent", Mode: 0o755, Source: big})
	ar.Add(bootmedia.Entry{Path: "bin/sh", Mode: fs.ModeSymlink, Data: []byte("busybox")})
	ar.Add(bootmedia.Entry{Path: "lib/modules/kernel/fs/ext4/ext4.ko", Mode: 0o644, Data: []byte("x")})
	ar.Add(bootmedia.Entry{Path: "dev/console", Mode: fs.ModeDevice | fs.ModeCharDevice | 0o600, Major: 5, Minor: 1})
	return ar
}

func TestArchiveIsDeterministicAndReadableByCpio(t *testing.T) {
	ar := testArchive(t)
	var a, b bytes.Buffer
	_, err := ar.WriteTo(&a, 1700000000)
	require.NoError(t, err)
	_, err = ar.WriteTo(&b, 1700000000)
	require.NoError(t, err)
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Fatalf("two writes of the same archive differ")
	}
	if a.Len()%512 != 0 {
		t.Errorf("archive size %d is not a multiple of 512", a.Len())
	}
	if _, err := exec.LookPath("cpio"); err != nil {
		testenv.Skip(t, "cpio not installed (apt-get install cpio)")
	}
	// cpio itself lists and extracts what we wrote.
	cmd := exec.Command("cpio", "-itv", "--quiet")
	cmd.Stdin = bytes.NewReader(a.Bytes())
	out, err := cmd.Output()
	require.NoError(t, err)
	list := string(out)
	for _, want := range []string{
		"drwxr-xr-x   2 root     root            0 Nov 14  2023 bin",
		"lrwxrwxrwx   1 root     root            7 Nov 14  2023 bin/sh -> busybox",
		"crw-------   1 root     root       5,   1 Nov 14  2023 dev/console",
		"-rwxr-xr-x   1 root     root         4000 Nov 14  2023 sbin/kiln-agent",
	} {
		if !strings.Contains(list, want) {
			t.Errorf("cpio -itv lacks %q; got:\n%s", want, list)
		}
	}
	if strings.Index(list, " lib\n") > strings.Index(list, " lib/modules\n") {
		t.Errorf("a directory is listed after its contents:\n%s", list)
	}
	dir := t.TempDir()
	cmd = exec.Command("cpio", "-id", "--quiet", "--no-absolute-filenames", "--nonmatching", "dev/console")
	cmd.Dir = dir
	cmd.Stdin = bytes.NewReader(a.Bytes())
	require.NoError(t, cmd.Run())
	got, err := os.ReadFile(filepath.Join(dir, "sbin/kiln-agent"))
	require.NoError(t, err)
	if !bytes.Equal(got, bytes.Repeat([]byte("kiln"), 1000)) {
		t.Errorf("extracted sbin/kiln-agent differs from its source")
	}
}

func TestArchiveSourceMissing(t *testing.T) {
	ar := &bootmedia.Archive{}
	ar.Add(bootmedia.Entry{Path: "sbin/kiln-agent", Mode: 0o755, Source: "/nonexistent/kiln-agent"})
	_, err := ar.WriteTo(&bytes.Buffer{}, 0)
	if err == nil || !strings.Contains(err.Error(), "sbin/kiln-agent") {
		t.Fatalf("WriteTo() with a missing source = %v, want an error naming the entry", err)
	}
}

func TestBuildRejectsBadSpec(t *testing.T) {
	agent := filepath.Join(t.TempDir(), "kiln-agent")
	require.NoError(t, os.WriteFile(agent, []byte("x"), 0o755))
	for _, tc := range []struct {
		name string
		spec bootmedia.Spec
	}{
		{"no output", bootmedia.Spec{AgentBinary: agent}},
		{"no agent", bootmedia.Spec{OutDir: t.TempDir()}},
		{"agent is a directory", bootmedia.Spec{OutDir: t.TempDir(), AgentBinary: t.TempDir()}},
	} {
		if _, err := bootmedia.Build(context.Background(), tc.spec, nil); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Build(%s) = %v, want InvalidArgument", tc.name, err)
		}
	}
}

func TestBuildISORefusesGrubSyntax(t *testing.T) {
	err := bootmedia.BuildISO(context.Background(), bootmedia.ExecRunner{}, "k", "i", `kiln.host=a"; reboot`, filepath.Join(t.TempDir(), "x.iso"))
	if !errdefs.IsInvalidArgument(err) {
		t.Fatalf("BuildISO(quote in cmdline) = %v, want InvalidArgument", err)
	}
}

// TestBuild builds real boot media from Debian's kernel package and checks
// the outputs against the manifest. It needs apt sources with the kernel,
// busybox-static, kmod, cpio and grub-mkrescue.
func TestBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("downloads a kernel package")
	}
	agent := bootmediatest.BuildAgent(t, t.TempDir())
	out := t.TempDir()
	var lines []string
	cache := bootmediatest.CacheDir(t)
	spec := bootmedia.Spec{AgentBinary: agent, OutDir: out, CacheDir: cache, Cmdline: "kiln.host=vm1", SourceDateEpoch: 1764633600}
	m, err := bootmedia.Build(context.Background(), spec, func(l string) { lines = append(lines, l) })
	bootmediatest.SkipIfUnavailable(t, err)
	require.NoError(t, err)
	t.Logf("progress:\n%s", strings.Join(lines, "\n"))
	if len(lines) == 0 || !strings.HasPrefix(lines[0], "[") {
		t.Errorf("progress lines = %q, want lines with the elapsed time", lines)
	}

	for _, name := range []string{bootmedia.KernelFile, bootmedia.InitrdFile, bootmedia.ISOFile} {
		f, ok := m.File(name)
		if !ok {
			t.Fatalf("manifest has no %s", name)
		}
		b, err := os.ReadFile(filepath.Join(out, name))
		require.NoError(t, err)
		sum := sha256.Sum256(b)
		if hex.EncodeToString(sum[:]) != f.SHA256 || int64(len(b)) != f.Size {
			t.Errorf("%s: sha256 %x size %d, manifest says %s size %d", name, sum, len(b), f.SHA256, f.Size)
		}
	}
	if leftovers, _ := filepath.Glob(filepath.Join(out, ".*")); len(leftovers) > 0 {
		t.Errorf("temporary files left in the output: %v", leftovers)
	}
	read, err := bootmedia.ReadManifest(out)
	require.NoError(t, err)
	if read.Kernel.Release == "" || !strings.HasPrefix(read.Kernel.Package, "linux-image-6.1.") {
		t.Errorf("manifest kernel = %+v, want a linux-image-6.1 package", read.Kernel)
	}
	if !strings.Contains(read.Cmdline, "kiln.boot=virtualmedia") || !strings.Contains(read.Cmdline, "kiln.host=vm1") {
		t.Errorf("manifest cmdline = %q, want kiln.boot=virtualmedia and kiln.host=vm1", read.Cmdline)
	}

	// The initramfs holds init, the agent and the modules, in order.
	cmd := exec.Command("sh", "-c", "gzip -dc "+filepath.Join(out, bootmedia.InitrdFile)+" | cpio -it --quiet")
	list, err := cmd.Output()
	require.NoError(t, err)
	for _, want := range []string{"init", "sbin/kiln-agent", "bin/busybox", "etc/kiln/modules", "usr/lib/os-release", "sbin/debugfs", "lib64/ld-linux-x86-64.so.2", "lib/x86_64-linux-gnu/libext2fs.so.2"} {
		if !strings.Contains("\n"+string(list), "\n"+want+"\n") {
			t.Errorf("initramfs lacks %s", want)
		}
	}
	// The agent writes the host identity with debugfs: in the extracted
	// initramfs it runs, its libraries resolved.
	t.Run("debugfs", func(t *testing.T) {
		testenv.RequireRoot(t, "to chroot into the extracted initramfs")
		dir := t.TempDir()
		x := exec.Command("sh", "-c", "gzip -dc "+filepath.Join(out, bootmedia.InitrdFile)+" | cpio -idm --quiet --no-absolute-filenames")
		x.Dir = dir
		b, err := x.CombinedOutput()
		require.NoError(t, err, "extract initramfs: %s", b)
		b, err = exec.Command("chroot", dir, "/sbin/debugfs", "-V").CombinedOutput()
		require.NoError(t, err, "chroot %s /sbin/debugfs -V: %s", dir, b)
		if !regexp.MustCompile(`debugfs [0-9]+\.[0-9]+.*\n\s*Using EXT2FS Library version [0-9]`).Match(b) {
			t.Errorf("debugfs -V in the initramfs printed %q, want the e2fsprogs version", b)
		}
		t.Logf("debugfs -V: %s", strings.TrimSpace(string(b)))
	})

	// The boot agent can reboot the machine into its laid disk and power
	// it off (the controller's Reboot RPC): init gives it commands that
	// the initramfs's busybox has.
	t.Run("reboot", func(t *testing.T) {
		dir := t.TempDir()
		x := exec.Command("sh", "-c", "gzip -dc "+filepath.Join(out, bootmedia.InitrdFile)+" | cpio -idm --quiet --no-absolute-filenames init bin/busybox")
		x.Dir = dir
		b, err := x.CombinedOutput()
		require.NoError(t, err, "extract init and busybox: %s", b)
		init, err := os.ReadFile(filepath.Join(dir, "init"))
		require.NoError(t, err)
		applets, err := exec.Command(filepath.Join(dir, "bin/busybox"), "--list").Output()
		require.NoError(t, err)
		for _, flag := range []string{"--reboot-command", "--poweroff-command"} {
			m := regexp.MustCompile(`(?m)^\s*/sbin/kiln-agent run .*` + flag + ` "([^"]+)"`).FindSubmatch(init)
			require.NotNil(t, m, "init runs the agent without %s:\n%s", flag, init)
			prog := strings.Fields(string(m[1]))[0]
			require.Contains(t, "\n"+string(applets), "\n"+prog+"\n", "%s %q: busybox in the initramfs has no %s", flag, m[1], prog)
		}
	})

	var ext4, jbd2 = -1, -1
	for i, mod := range read.Modules {
		switch filepath.Base(mod) {
		case "ext4.ko":
			ext4 = i
		case "jbd2.ko":
			jbd2 = i
		}
	}
	if ext4 < 0 || jbd2 < 0 || jbd2 > ext4 {
		t.Errorf("modules: jbd2 at %d, ext4 at %d: want both, jbd2 first", jbd2, ext4)
	}

	if !read.BuildDate.Equal(time.Unix(1764633600, 0)) || read.SourceDateEpoch != 1764633600 {
		t.Errorf("manifest build date %s, epoch %d: want the spec's epoch 1764633600", read.BuildDate, read.SourceDateEpoch)
	}
	if len(read.Inputs) < 4 || read.Inputs[0].Name != "kiln-agent" || read.Inputs[0].SHA256 == "" || read.Inputs[1].Name != "busybox" || read.Inputs[2].Name != "debugfs" || read.Inputs[3].Name != "lib/x86_64-linux-gnu/libblkid.so.1" {
		t.Errorf("manifest inputs = %+v, want kiln-agent, busybox, debugfs and its libraries with their sha256", read.Inputs)
	}
	if !strings.HasPrefix(read.Tools["xorriso"], "xorriso ") || !strings.Contains(read.Tools["grub-mkimage"], "GRUB") || !strings.Contains(read.Tools["mformat"], "mtools") {
		t.Errorf("manifest tools = %q, want the versions of grub-mkimage, xorriso and mformat", read.Tools)
	}

	// A second build from the cache, later, gives the same bytes: every
	// file and the manifest.
	for now := time.Now().Unix(); time.Now().Unix() == now; {
		time.Sleep(50 * time.Millisecond)
	}
	spec.OutDir = t.TempDir()
	_, err = bootmedia.Build(context.Background(), spec, nil)
	require.NoError(t, err)
	for _, name := range []string{bootmedia.KernelFile, bootmedia.InitrdFile, bootmedia.ISOFile, bootmedia.ManifestFile} {
		a, err := os.ReadFile(filepath.Join(out, name))
		require.NoError(t, err)
		b, err := os.ReadFile(filepath.Join(spec.OutDir, name))
		require.NoError(t, err)
		if !bytes.Equal(a, b) {
			t.Errorf("%s of two builds from the same spec and epoch differ", name)
		}
	}

	// Kernel and initramfs only.
	m3, err := bootmedia.Build(context.Background(), bootmedia.Spec{AgentBinary: agent, OutDir: t.TempDir(), CacheDir: cache, NoISO: true, SourceDateEpoch: 1764633600}, nil)
	require.NoError(t, err)
	a, _ := m.File(bootmedia.InitrdFile)
	b, _ := m3.File(bootmedia.InitrdFile)
	if a.SHA256 != b.SHA256 {
		t.Errorf("initramfs of two builds: %s and %s, want identical", a.SHA256, b.SHA256)
	}
	if _, ok := m3.File(bootmedia.ISOFile); ok || m3.Tools != nil {
		t.Errorf("NoISO build lists an ISO or ISO tools")
	}
}

// BenchmarkBuild measures a boot media build with the kernel already in
// the cache: initramfs (gzip) and ISO.
func BenchmarkBuild(b *testing.B) {
	agent := bootmediatest.BuildAgent(b, b.TempDir())
	cache := bootmediatest.CacheDir(b)
	// Warm the kernel cache outside the timer.
	_, err := bootmedia.Build(context.Background(), bootmedia.Spec{AgentBinary: agent, OutDir: b.TempDir(), NoISO: true, CacheDir: cache}, nil)
	bootmediatest.SkipIfUnavailable(b, err)
	require.NoError(b, err)
	b.ResetTimer()
	for range b.N {
		m, err := bootmedia.Build(context.Background(), bootmedia.Spec{AgentBinary: agent, OutDir: b.TempDir(), CacheDir: cache}, nil)
		require.NoError(b, err)
		f, _ := m.File(bootmedia.InitrdFile)
		b.ReportMetric(float64(f.Size)/(1<<20), "MiB-initrd")
	}
}

// TestArchiveRefusesWhatNewcCannotHold: each of these was written into a
// corrupt archive before FuzzArchive found it (a TRAILER!!! entry ended
// the archive early for the kernel; a NUL cut a name; sizes and times
// were truncated to 32 bits).
func TestArchiveRefusesWhatNewcCannotHold(t *testing.T) {
	big := filepath.Join(t.TempDir(), "big")
	f, err := os.Create(big)
	require.NoError(t, err)
	require.NoError(t, f.Truncate(1<<32)) // sparse: no disk used
	require.NoError(t, f.Close())
	for _, tc := range []struct {
		name  string
		e     bootmedia.Entry
		mtime int64
	}{
		{"trailer name", bootmedia.Entry{Path: "TRAILER!!!", Mode: 0o644, Data: []byte("x")}, 0},
		{"NUL in name", bootmedia.Entry{Path: "a\x00b", Mode: 0o644}, 0},
		{"empty name", bootmedia.Entry{Path: "/", Mode: fs.ModeDir | 0o755}, 0},
		{"4 GiB file", bootmedia.Entry{Path: "big", Mode: 0o644, Source: big}, 0},
		{"negative mtime", bootmedia.Entry{Path: "a", Mode: 0o644}, -1},
		{"mtime after 2106", bootmedia.Entry{Path: "a", Mode: 0o644}, 1 << 32},
	} {
		ar := &bootmedia.Archive{}
		ar.Add(tc.e)
		if _, err := ar.WriteTo(io.Discard, tc.mtime); !errdefs.IsInvalidArgument(err) {
			t.Errorf("WriteTo(%s) = %v, want InvalidArgument", tc.name, err)
		}
	}
}
