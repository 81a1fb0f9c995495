package kubetools

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// mirror is a local dl.k8s.io-style server of tiny fake binaries with
// injectable faults.
type mirror struct {
	mu       sync.Mutex
	files    map[string][]byte // path -> content
	failures map[string]int    // path -> remaining 503 answers
	requests map[string]int
}

func newMirror(names ...string) *mirror {
	m := &mirror{files: map[string][]byte{}, failures: map[string]int{}, requests: map[string]int{}}
	for _, n := range names {
		m.put(n, []byte("mirror binary "+n))
	}
	return m
}

func mirrorPath(name string) string { return "/v1.34.4/bin/linux/amd64/" + name }

func (m *mirror) put(name string, data []byte) {
	sum := sha256.Sum256(data)
	m.files[mirrorPath(name)] = data
	// dl.k8s.io serves the bare digest.
	m.files[mirrorPath(name)+".sha256"] = []byte(hex.EncodeToString(sum[:]))
}

func (m *mirror) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.requests[r.URL.Path]++
	if m.failures[r.URL.Path] > 0 {
		m.failures[r.URL.Path]--
		http.Error(w, "overloaded", http.StatusServiceUnavailable)
		return
	}
	data, ok := m.files[r.URL.Path]
	if !ok {
		http.NotFound(w, r)
		return
	}
	w.Write(data)
}

func mirrorBuilder(t *testing.T, m *mirror, userinfo string) (*Builder, *fakeGo) {
	srv := httptest.NewServer(m)
	t.Cleanup(srv.Close)
	fake := newFakeGo(t)
	b, _ := newTestBuilder(t, fake)
	b.Arch = "amd64"
	b.Mirror = strings.Replace(srv.URL, "http://", "http://"+userinfo, 1) + "/"
	b.HTTP = srv.Client()
	return b, fake
}

func TestMirrorDownloadsAndVerifies(t *testing.T) {
	// Like dl.k8s.io: the seven Kubernetes binaries, plus etcd; coredns and
	// pause are missing and must be built.
	m := newMirror(append(KubernetesBinaries(), Etcd)...)
	m.failures[mirrorPath(Kubeadm)] = 2 // transient errors are retried
	b, fake := mirrorBuilder(t, m, "")
	man, err := b.Ensure(context.Background())
	require.NoError(t, err)

	origins := map[string]string{}
	for _, bin := range man.Binaries {
		origins[bin.Name] = bin.Origin
	}
	for _, name := range append(KubernetesBinaries(), Etcd) {
		got, err := os.ReadFile(filepath.Join(b.Cache.BinDir(b.Release), name))
		require.NoError(t, err)
		if string(got) != "mirror binary "+name || origins[name] != "downloaded" {
			t.Errorf("cached %s = %q origin %q, want the mirror's file, downloaded", name, got, origins[name])
		}
	}
	for _, name := range []string{CoreDNS, Pause} {
		if origins[name] != "built" {
			t.Errorf("%s origin = %q, want built (the mirror lacks it)", name, origins[name])
		}
	}
	if n := len(fake.builds()); n != 2 {
		t.Errorf("go build/install calls = %d, want 2 (coredns, pause)", n)
	}
	if !strings.HasPrefix(man.Source, "mirror http://127.0.0.1") {
		t.Errorf("manifest source = %q, want the mirror", man.Source)
	}
	if got := m.requests[mirrorPath(Kubeadm)]; got != 3 {
		t.Errorf("requests for kubeadm = %d, want 3 (two 503s, then success)", got)
	}
	if _, err := b.Cache.Verify(b.Release); err != nil {
		t.Errorf("Verify() after mirror download = %v", err)
	}
}

func TestMirrorSHA256Formats(t *testing.T) {
	data := []byte("x")
	sum := sha256.Sum256(data)
	hexSum := hex.EncodeToString(sum[:])
	tests := []struct {
		body string
		want string
		ok   bool
	}{
		{body: hexSum, want: hexSum, ok: true},
		{body: hexSum + "\n", want: hexSum, ok: true},
		{body: strings.ToUpper(hexSum) + "  kubeadm\n", want: hexSum, ok: true},
		{body: "", ok: false},
		{body: "<html>not found</html>", ok: false},
		{body: hexSum[:40], ok: false},
	}
	for _, tt := range tests {
		got, err := parseSHA256([]byte(tt.body), "kubeadm.sha256")
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("parseSHA256(%q) = %q, %v, want %q ok=%v", tt.body, got, err, tt.want, tt.ok)
		}
	}
}

func TestMirrorFailures(t *testing.T) {
	const secret = "s3cr3t-token"
	tests := []struct {
		name   string
		mirror func() *mirror
		is     func(error) bool
	}{
		{
			name: "checksum mismatch",
			mirror: func() *mirror {
				m := newMirror(Binaries()...)
				m.files[mirrorPath(Kubelet)] = []byte("truncated")
				return m
			},
			is: errdefs.IsFailedPrecondition,
		},
		{
			name:   "kubernetes binary missing",
			mirror: func() *mirror { return newMirror(Kubeadm, Kubelet) },
			is:     errdefs.IsNotFound,
		},
		{
			name: "mirror keeps failing",
			mirror: func() *mirror {
				m := newMirror(Binaries()...)
				m.failures[mirrorPath(KubeAPIServer)+".sha256"] = 100
				return m
			},
			is: errdefs.IsUnavailable,
		},
		{
			name: "garbage checksum file",
			mirror: func() *mirror {
				m := newMirror(Binaries()...)
				m.files[mirrorPath(Kubectl)+".sha256"] = []byte("<html>")
				return m
			},
			is: errdefs.IsInvalidArgument,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, fake := mirrorBuilder(t, tt.mirror(), "kiln:"+secret+"@")
			_, err := b.Ensure(context.Background())
			if err == nil || !tt.is(err) {
				t.Fatalf("Ensure(%s) = %v, want an error of the right class", tt.name, err)
			}
			t.Logf("Ensure(%s) = %v", tt.name, err)
			if strings.Contains(err.Error(), secret) {
				t.Errorf("Ensure(%s) error %q contains the mirror's password", tt.name, err)
			}
			if _, verr := b.Cache.Verify(b.Release); !errdefs.IsNotFound(verr) {
				t.Errorf("Verify() after %s = %v, want NotFound (no partial cache)", tt.name, verr)
			}
			if n := len(fake.builds()); n != 0 {
				t.Errorf("Ensure(%s) built %d binaries, want none", tt.name, n)
			}
		})
	}
}

func TestRedactURL(t *testing.T) {
	tests := []struct{ in, want string }{
		{"https://user:pw@mirror.example/k8s?token=abc", "https://mirror.example/k8s"},
		{"http://127.0.0.1:8080/", "http://127.0.0.1:8080/"},
	}
	for _, tt := range tests {
		if got := redactURL(tt.in); got != tt.want {
			t.Errorf("redactURL(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestMirrorUnreachable(t *testing.T) {
	const secret = "s3cr3t-token"
	srv := httptest.NewServer(http.NotFoundHandler())
	u := strings.Replace(srv.URL, "http://", "http://kiln:"+secret+"@", 1)
	srv.Close() // nothing listens there any more
	fake := newFakeGo(t)
	b, _ := newTestBuilder(t, fake)
	b.Mirror = u
	_, err := b.Ensure(context.Background())
	t.Logf("Ensure(unreachable) = %v", err)
	if !errdefs.IsUnavailable(err) {
		t.Errorf("Ensure(unreachable mirror) = %v, want Unavailable", err)
	}
	if err != nil && strings.Contains(err.Error(), secret) {
		t.Errorf("Ensure(unreachable mirror) error %q contains the password", err)
	}
}
