package personalize_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/agent/personalize"
	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/testenv"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

func need(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skipf(t, "%s not found (Debian packages e2fsprogs, fdisk): %v", tool, err)
		}
	}
}

// run runs a command and returns its standard output.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "%s %s: %s%s", name, strings.Join(args, " "), out, stderr.String())
	return string(out)
}

// gptImage makes a golden-image-like disk: GPT, one x86-64 root partition
// at 1 MiB holding an ext4 filesystem with an /etc/hostname.
func gptImage(t *testing.T) (path string, offset int64) {
	t.Helper()
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	require.NoError(t, os.MkdirAll(filepath.Join(root, "etc"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(root, "etc/hostname"), []byte("debian\n"), 0o644))
	path = filepath.Join(dir, "disk.raw")
	run(t, "truncate", "-s", "64M", path)
	sf := exec.Command("sfdisk", "-q", path)
	sf.Stdin = strings.NewReader("label: gpt\nstart=2048, size=120000, type=" + personalize.TypeRootX86_64 + "\n")
	out, err := sf.CombinedOutput()
	require.NoError(t, err, "sfdisk: %s", out)
	run(t, "mkfs.ext4", "-q", "-d", root, "-E", "offset=1048576", path, "60000k")
	return path, 1 << 20
}

func request(t *testing.T, target, host string) *agentv1.WriteIdentityRequest {
	t.Helper()
	ca, err := pki.NewCA("kiln", time.Now())
	require.NoError(t, err)
	key, csr, err := pki.NewKeyAndCSR(host)
	require.NoError(t, err)
	cert, err := ca.SignCSR(csr, pki.RoleAgent, host, time.Hour, time.Now())
	require.NoError(t, err)
	return &agentv1.WriteIdentityRequest{
		Target: target, Hostname: host, ControllerUrl: "https://10.0.0.1:7443", CaHash: ca.Hash(),
		CertificatePem: cert, KeyPem: key, CaPem: ca.CertPEM(),
	}
}

// extract copies the image's agent data directory out, as the installed
// agent would see it.
func extract(t *testing.T, fs string) string {
	t.Helper()
	dir := t.TempDir()
	run(t, "debugfs", "-R", "rdump "+personalize.DataDir+" "+dir, fs)
	return filepath.Join(dir, "kiln-agent")
}

func TestWriteIdentity(t *testing.T) {
	need(t, "debugfs", "mkfs.ext4", "sfdisk", "truncate", "e2fsck")
	disk, off := gptImage(t)
	got, err := personalize.RootOffset(disk)
	require.NoError(t, err)
	require.Equal(t, off, got, "RootOffset(%s)", disk)

	w := personalize.New(command.Exec{}, nil)
	fs := disk + "?offset=1048576"
	for _, host := range []string{"rack1-07", "rack1-08"} { // a second write replaces the first
		req := request(t, disk, host)
		require.NoError(t, w.WriteIdentity(context.Background(), req))

		if got := run(t, "debugfs", "-R", "cat /etc/hostname", fs); got != host+"\n" {
			t.Errorf("/etc/hostname = %q, want %q", got, host+"\n")
		}
		id, err := identity.Load(extract(t, fs))
		require.NoError(t, err, "the installed agent loads its identity")
		if id.Host() != host || id.Controller.Address != "10.0.0.1:7443" || id.Controller.CAHash != req.GetCaHash() {
			t.Errorf("identity in image = %+v, want host %s at 10.0.0.1:7443", id.Controller, host)
		}
		stat := run(t, "debugfs", "-R", "stat "+personalize.DataDir+"/agent.key", fs)
		require.Contains(t, stat, "Mode:  0600", "agent.key mode")
		stat = run(t, "debugfs", "-R", "stat "+personalize.DataDir, fs)
		require.Contains(t, stat, "Mode:  0700", "data directory mode")
		// No network_config: the image keeps its own network setup.
		stat = run(t, "debugfs", "-R", "stat "+personalize.NetworkFile, fs)
		require.NotContains(t, stat, "Type:", "%s written without a network_config", personalize.NetworkFile)
	}
	run(t, "e2fsck", "-fn", fs) // the filesystem is consistent
}

func TestWriteIdentityBareFilesystem(t *testing.T) {
	need(t, "debugfs", "mkfs.ext4", "truncate")
	img := filepath.Join(t.TempDir(), "root.ext4")
	run(t, "truncate", "-s", "32M", img)
	run(t, "mkfs.ext4", "-q", img)
	require.NoError(t, personalize.New(command.Exec{}, nil).WriteIdentity(context.Background(), request(t, img, "h1")))
	id, err := identity.Load(extract(t, img+"?offset=0"))
	require.NoError(t, err)
	require.Equal(t, "h1", id.Host())
}

func TestWriteIdentityRefuses(t *testing.T) {
	need(t, "debugfs", "mkfs.ext4", "sfdisk", "truncate")
	disk, _ := gptImage(t)
	blank := filepath.Join(t.TempDir(), "blank.raw")
	require.NoError(t, os.WriteFile(blank, make([]byte, 1<<20), 0o644))

	otherHost := request(t, disk, "h1")
	otherHost.Hostname = "h2"
	badPin := request(t, disk, "h1")
	badPin.CaHash = "sha256:" + strings.Repeat("0", 64)
	noKey := request(t, disk, "h1")
	noKey.KeyPem = nil
	noNetworkSection := request(t, disk, "h1")
	noNetworkSection.NetworkConfig = "[Match]\nName=eth0\n"
	junk := request(t, disk, "h1")
	junk.NetworkConfig = "[Match]\nName=eth0\n[Network]\nDHCP=yes\n\x00\x7fELF\x01\x02"
	tooLarge := request(t, disk, "h1")
	tooLarge.NetworkConfig = "[Match]\nName=eth0\n[Network]\nDHCP=yes\n" + strings.Repeat("# padding\n", personalize.MaxNetworkConfig/10)

	tests := []struct {
		name string
		req  *agentv1.WriteIdentityRequest
		is   func(error) bool
	}{
		{"certificate for another host", otherHost, errdefs.IsInvalidArgument},
		{"CA not matching ca_hash", badPin, errdefs.IsInvalidArgument},
		{"no key", noKey, errdefs.IsInvalidArgument},
		{"network config without [Network]", noNetworkSection, errdefs.IsInvalidArgument},
		{"network config with binary junk", junk, errdefs.IsInvalidArgument},
		{"network config too large", tooLarge, errdefs.IsInvalidArgument},
		{"blank disk", request(t, blank, "h1"), errdefs.IsFailedPrecondition},
		{"missing target", request(t, filepath.Join(t.TempDir(), "nope"), "h1"), errdefs.IsNotFound},
	}
	before := fileHash(t, disk)
	w := personalize.New(command.Exec{}, nil)
	for _, tt := range tests {
		err := w.WriteIdentity(context.Background(), tt.req)
		if !tt.is(err) {
			t.Errorf("WriteIdentity(%s) = %v, wrong class", tt.name, err)
		}
		if err != nil && strings.Contains(err.Error(), "PRIVATE KEY") {
			t.Errorf("WriteIdentity(%s) error carries the key: %v", tt.name, err)
		}
	}
	// Nothing was written by the refused requests.
	require.Equal(t, before, fileHash(t, disk), "image changed by refused requests")
	if got := run(t, "debugfs", "-R", "cat /etc/hostname", disk+"?offset=1048576"); got != "debian\n" {
		t.Errorf("/etc/hostname after refused writes = %q, want the image's own", got)
	}
}

func fileHash(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	h := sha256.New()
	_, err = io.Copy(h, f)
	require.NoError(t, err)
	return hex.EncodeToString(h.Sum(nil))
}

const networkConfig = `# written by kiln
[Match]
MACAddress=52:54:00:12:34:56

[Network]
Address=10.0.0.7/24
Gateway=10.0.0.1
DNS=10.0.0.1 \
    10.0.0.2
`

func TestWriteIdentityNetworkConfig(t *testing.T) {
	need(t, "debugfs", "mkfs.ext4", "sfdisk", "truncate", "e2fsck")
	disk, _ := gptImage(t)
	fs := disk + "?offset=1048576"
	w := personalize.New(command.Exec{}, nil)
	for _, cfg := range []string{networkConfig, strings.Replace(networkConfig, "10.0.0.7", "10.0.0.8", 1)} { // a second write replaces the first
		req := request(t, disk, "rack1-07")
		req.NetworkConfig = cfg
		require.NoError(t, w.WriteIdentity(context.Background(), req))
		if got := run(t, "debugfs", "-R", "cat "+personalize.NetworkFile, fs); got != cfg {
			t.Errorf("%s = %q, want %q", personalize.NetworkFile, got, cfg)
		}
		stat := run(t, "debugfs", "-R", "stat "+personalize.NetworkFile, fs)
		require.Contains(t, stat, "Type: regular", "%s type", personalize.NetworkFile)
		require.Contains(t, stat, "Mode:  0644", "%s mode", personalize.NetworkFile)
		require.Regexp(t, `User:\s+0\s+Group:\s+0\b`, stat, "%s owner", personalize.NetworkFile)
		if got := run(t, "debugfs", "-R", "cat /etc/hostname", fs); got != "rack1-07\n" {
			t.Errorf("/etc/hostname = %q", got)
		}
	}
	run(t, "e2fsck", "-fn", fs) // the filesystem is consistent
}

func TestValidateNetworkConfig(t *testing.T) {
	for _, ok := range []string{
		"",
		networkConfig,
		"[Match]\nName=en*\n[Network]\nDHCP=yes",
		"; comment\n[Match]\n\tName = eth0\n[Network]\nDHCP=ipv4\n[Route]\nGateway=10.0.0.1\n",
	} {
		require.NoError(t, personalize.ValidateNetworkConfig(ok), "%q", ok)
	}
	for _, tt := range []struct{ name, config, msg string }{
		{"no [Network]", "[Match]\nName=eth0\n", "no [Network] section"},
		{"no [Match]", "[Network]\nDHCP=yes\n", "no [Match] section"},
		{"neither", "# nothing\n", "no [Match] or [Network] section"},
		{"NUL", "[Match]\nName=eth0\x00\n[Network]\nDHCP=yes\n", "line 2: control character U+0000"},
		{"carriage return", "[Match]\r\nName=eth0\r\n[Network]\r\nDHCP=yes\r\n", "line 1: control character U+000D"},
		{"not UTF-8", "[Match]\nName=\xff\xfe\n[Network]\n", "not UTF-8"},
		{"too large", "[Match]\n[Network]\n" + strings.Repeat("#", personalize.MaxNetworkConfig), "at most 65536"},
		{"no key", "[Match]\nName=eth0\n[Network]\nDHCP\n", `line 4: want "[Section]" or "Key=Value", got "DHCP"`},
		{"empty key", "[Match]\n=eth0\n[Network]\n", "line 2"},
		{"key before section", "Name=eth0\n[Match]\n[Network]\n", `line 1: "Name" before any section`},
		{"bad header", "[Match\nName=eth0\n[Network]\n", "line 1: malformed section header"},
	} {
		err := personalize.ValidateNetworkConfig(tt.config)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), tt.msg) {
			t.Errorf("ValidateNetworkConfig(%s) = %v, want InvalidArgument containing %q", tt.name, err, tt.msg)
		}
	}
}
