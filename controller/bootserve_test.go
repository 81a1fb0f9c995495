package controller_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/testenv"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// bootEnv runs a controller with its boot server over a media directory
// holding a stand-in kernel and initramfs and an image directory holding
// one 1 MiB image; it applies hosts rack1-01 and rack1-02.
type bootEnv struct {
	*controllertest.Env
	kernel []byte
	image  []byte
	imageN string
}

func startBoot(t testing.TB, opts ...controllertest.Option) *bootEnv {
	t.Helper()
	media, images := t.TempDir(), t.TempDir()
	b := &bootEnv{kernel: []byte("stand-in kernel\n"), image: make([]byte, 1<<20), imageN: "debian12-k8s1.34.4-20261202.raw.zst"}
	_, _ = rand.Read(b.image)
	require.NoError(t, os.WriteFile(filepath.Join(media, "vmlinuz"), b.kernel, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(media, "initrd.img"), []byte("stand-in initramfs\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(images, b.imageN), b.image, 0o644))
	b.Env = controllertest.Start(t, append([]controllertest.Option{controllertest.WithBootServer(media, images)}, opts...)...)
	require.NotEmpty(t, b.BootURL, "boot server not started")
	rc := controllerv1.NewResourcesClient(b.Dial(t, b.AdminConfigPath))
	_, err := rc.Apply(context.Background(), &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{
		host("rack1-01", "pw-one"), host("rack1-02", "pw-two"),
	}})
	require.NoError(t, err)
	return b
}

func (b *bootEnv) get(t testing.TB, path string, header http.Header) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, b.BootURL+path, nil)
	require.NoError(t, err)
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, body
}

var paramRE = regexp.MustCompile(`\bkiln\.([a-z_]+)=([^ \n"]+)`)

// params are the kiln.* kernel parameters found in s.
func params(s string) map[string]string {
	m := map[string]string{}
	for _, p := range paramRE.FindAllStringSubmatch(s, -1) {
		m[p[1]] = p[2]
	}
	return m
}

func TestBootServerIPXETokenEnrollsThatHostOnce(t *testing.T) {
	env := startBoot(t)
	ctx := context.Background()

	resp, body := env.get(t, "/boot/ipxe/rack1-01", nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "GET /boot/ipxe/rack1-01: %s", body)
	script := string(body)
	require.True(t, strings.HasPrefix(script, "#!ipxe\n"), "not an iPXE script:\n%s", script)
	p := params(script)
	if got, want := p["controller"], env.Addr; got != want {
		t.Errorf("iPXE script kiln.controller = %q, want %q", got, want)
	}
	if got, want := p["ca_hash"], env.CAHash; got != want {
		t.Errorf("iPXE script kiln.ca_hash = %q, want %q", got, want)
	}
	if got, want := p["host"], "rack1-01"; got != want {
		t.Errorf("iPXE script kiln.host = %q, want %q", got, want)
	}
	if want := "kernel " + env.BootURL + "/boot/files/vmlinuz "; !strings.Contains(script, want) {
		t.Errorf("iPXE script does not load the kernel from %q:\n%s", want, script)
	}
	token := p["token"]
	tok, err := enrollment.ParseToken(token)
	require.NoError(t, err, "iPXE script token %q", token)

	// The script's kernel comes from the same server.
	resp, body = env.get(t, "/boot/files/vmlinuz", nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, env.kernel, body)

	// Another host cannot use it, and trying does not spend it.
	_, err = enroll(ctx, t, env.Env, token, "rack1-02")
	if code(err) != codes.PermissionDenied {
		t.Fatalf("enroll rack1-02 with rack1-01's boot token: %v, want PermissionDenied", err)
	}
	a, err := enroll(ctx, t, env.Env, token, "rack1-01")
	require.NoError(t, err, "enroll rack1-01 with its boot token")
	cert, err := pki.ParseCertificatePEM(a.certPEM)
	require.NoError(t, err)
	role, name, err := pki.Identity(cert)
	require.NoError(t, err)
	if role != pki.RoleAgent || name != "rack1-01" {
		t.Errorf("enrolled identity = %s/%s, want agent/rack1-01", role, name)
	}
	_, err = enroll(ctx, t, env.Env, token, "rack1-01")
	if code(err) != codes.PermissionDenied {
		t.Errorf("second enrollment with the same boot token: %v, want PermissionDenied", err)
	}

	// Each fetch mints a new token.
	_, body = env.get(t, "/boot/ipxe/rack1-01", nil)
	if again := params(string(body))["token"]; again == "" || again == token {
		t.Errorf("second iPXE fetch token = %q, want a new token", again)
	}

	// The token never reaches the logs; the lines around it do.
	logs := env.Logs()
	require.Contains(t, logs, "ipxe script served", "the controller's log was not captured")
	require.Contains(t, logs, tok.ID, "the enrollment with the token was not logged")
	if strings.Contains(logs, tok.Secret) {
		t.Errorf("the controller's log holds the boot token's secret")
	}
}

func TestBootServerRefusesHostsItMustNotBoot(t *testing.T) {
	env := startBoot(t)
	ctx := context.Background()
	st := env.Store()
	h := &typesv1.Host{}
	rev, err := st.Get(ctx, enrollment.HostsKind, "rack1-02", h)
	require.NoError(t, err)
	if h.Status == nil {
		h.Status = &typesv1.HostStatus{}
	}
	h.Status.State = typesv1.HostState_HOST_STATE_PROVISIONED
	_, err = st.Update(ctx, enrollment.HostsKind, "rack1-02", h, rev)
	require.NoError(t, err)

	tests := []struct {
		path string
		want int
	}{
		{"/boot/ipxe/rack1-01", http.StatusOK},
		{"/boot/ipxe/no-such-host", http.StatusNotFound},
		{"/boot/ipxe/rack1-02", http.StatusForbidden}, // Provisioned: boots from disk
		{"/boot/files/../secret.key", http.StatusNotFound},
		{"/images/no-such-image.raw.zst", http.StatusNotFound},
	}
	for _, tt := range tests {
		resp, body := env.get(t, tt.path, nil)
		if resp.StatusCode != tt.want {
			t.Errorf("GET(%q) = %d %s, want %d", tt.path, resp.StatusCode, body, tt.want)
		}
	}
}

// TestBootServerLimitsTokensPerHost: the boot server answers without
// authentication and every token is an etcd record, so one host gets at
// most BootTokenLimit tokens per token lifetime; other hosts are not
// affected.
func TestBootServerLimitsTokensPerHost(t *testing.T) {
	env := startBoot(t, controllertest.WithConfig(func(c *controller.Config) { c.BootTokenLimit = 2 }))
	for i, want := range []int{http.StatusOK, http.StatusOK, http.StatusServiceUnavailable} {
		resp, body := env.get(t, "/boot/ipxe/rack1-01", nil)
		if resp.StatusCode != want {
			t.Errorf("GET /boot/ipxe/rack1-01 #%d = %d %s, want %d", i+1, resp.StatusCode, body, want)
		}
	}
	if resp, body := env.get(t, "/boot/ipxe/rack1-02", nil); resp.StatusCode != http.StatusOK {
		t.Errorf("GET /boot/ipxe/rack1-02 after rack1-01 hit its limit = %d %s, want 200", resp.StatusCode, body)
	}
}

func TestBootServerImageRange(t *testing.T) {
	env := startBoot(t)
	sum := sha256.Sum256(env.image)

	resp, body := env.get(t, "/images/"+env.imageN, http.Header{"Range": {"bytes=1000-1999"}})
	require.Equal(t, http.StatusPartialContent, resp.StatusCode, "%s", body)
	if !bytes.Equal(body, env.image[1000:2000]) {
		t.Errorf("Range bytes=1000-1999 returned %d bytes that differ from the file's", len(body))
	}
	if got, want := resp.Header.Get("X-Kiln-Sha256"), hex.EncodeToString(sum[:]); got != want {
		t.Errorf("X-Kiln-Sha256 = %q, want %q", got, want)
	}
	if got, want := resp.Header.Get("Content-Range"), fmt.Sprintf("bytes 1000-1999/%d", len(env.image)); got != want {
		t.Errorf("Content-Range = %q, want %q", got, want)
	}

	resp, body = env.get(t, "/images/"+env.imageN, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	if got := sha256.Sum256(body); got != sum {
		t.Errorf("full GET returned %d bytes with another sha256", len(body))
	}
}

// TestBootServerISOTokenRenewedAfterUse boots from virtual media twice:
// the host's cached ISO carries a token that enrolls it; once used, the
// next fetch gets an ISO with a fresh token.
func TestBootServerISOTokenRenewedAfterUse(t *testing.T) {
	if _, err := exec.LookPath("grub-mkrescue"); err != nil {
		testenv.Skip(t, "grub-mkrescue not installed (apt-get install grub-common grub-pc-bin grub-efi-amd64-bin xorriso mtools)")
	}
	env := startBoot(t)
	ctx := context.Background()
	isoToken := func() (string, string) {
		t.Helper()
		resp, body := env.get(t, "/boot/iso/rack1-01.iso", nil)
		require.Equal(t, http.StatusOK, resp.StatusCode, "GET ISO: %.200s", body)
		p := params(string(body))
		require.NotEmpty(t, p["token"], "no kiln.token= in the ISO")
		require.Equal(t, "virtualmedia", p["boot"])
		return p["token"], resp.Header.Get("X-Kiln-Sha256")
	}
	tok1, sum1 := isoToken()
	tok1b, sum1b := isoToken()
	require.Equal(t, tok1, tok1b, "the ISO was rebuilt between two reads")
	require.Equal(t, sum1, sum1b)

	_, err := enroll(ctx, t, env.Env, tok1, "rack1-01")
	require.NoError(t, err, "enroll with the ISO's token")

	// The cached ISO is dropped when its token is used (a store watch).
	var tok2 string
	require.Eventually(t, func() bool {
		tok2, _ = isoToken()
		return tok2 != tok1
	}, 30*time.Second, 200*time.Millisecond, "the ISO still carries the spent token")
	_, err = enroll(ctx, t, env.Env, tok2, "rack1-01")
	require.NoError(t, err, "enroll with the new ISO's token")
}

func TestBootServerConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  controller.Config
	}{
		{"no media dir", controller.Config{DataDir: t.TempDir(), BootListenAddr: "127.0.0.1:0"}},
		{"bad boot address", controller.Config{DataDir: t.TempDir(), BootListenAddr: "8080", BootMediaDir: "/srv"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := controller.New(tt.cfg, nil); err == nil {
				t.Errorf("New(%+v) = nil error, want InvalidArgument", tt.cfg)
			}
		})
	}
}

// BenchmarkBootIPXE measures serving iPXE scripts through the controller:
// each request reads the Host and stores a new enrollment token in the
// embedded etcd. "serial" is one client; "parallel" is 8 x GOMAXPROCS
// concurrent clients (a rack powering on at once).
func BenchmarkBootIPXE(b *testing.B) {
	env := startBoot(b, controllertest.WithConfig(func(c *controller.Config) { c.BootTokenLimit = -1 }))
	fetch := func(b *testing.B) bool {
		resp, err := http.Get(env.BootURL + "/boot/ipxe/rack1-01")
		if err != nil {
			b.Error(err)
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Errorf("GET iPXE script: %s", resp.Status)
			return false
		}
		return true
	}
	b.Run("serial", func(b *testing.B) {
		for range b.N {
			if !fetch(b) {
				return
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.SetParallelism(8)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if !fetch(b) {
					return
				}
			}
		})
	})
}
