// Package bootserver is the controller's boot and image HTTP server: it
// serves golden images and the agent's boot media with Range support and
// their sha256 in headers, a per-host iPXE script whose kernel command line
// carries the controller address, a one-time boot token scoped to that host
// and the CA hash, and a per-host ISO for virtual media with the same
// parameters in its grub.cfg. It also generates the dnsmasq configuration
// that chain-loads hosts into those scripts (DnsmasqConfig).
//
// Routes:
//
//	GET /boot/files/<name>     boot media (vmlinuz, initrd.img, kiln-agent.iso, bootmedia.json)
//	GET /images/<name>         golden images and their manifests
//	GET /boot/ipxe/<host>      the host's iPXE script (mints a boot token)
//	GET /boot/iso/<host>.iso   the host's virtual media (built once, cached; see Forget)
package bootserver

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/kilnhq/kiln/imagebuilder/bootmedia"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// TokenIssuer mints a one-time boot token that lets the boot agent of host
// enroll as that host and no other. The controller implements it with its
// enrollment tokens.
type TokenIssuer interface {
	BootToken(ctx context.Context, host string) (string, error)
}

// BootNetwork is a host's static network configuration for its boot
// media, for racks without DHCP (virtual media, "L3 first").
type BootNetwork struct {
	// Address in CIDR form, e.g. 10.0.0.5/24; required.
	Address string
	// Gateway is the default route; "" sets none.
	Gateway string
	// MAC selects the NIC; "" takes the first NIC.
	MAC string
	// DNS servers.
	DNS []string
}

// NetworkSource tells the boot server a host's static boot network. A nil
// BootNetwork (and nil error) means DHCP.
type NetworkSource interface {
	BootNetwork(ctx context.Context, host string) (*BootNetwork, error)
}

// Cmdline returns the kernel parameters of n: kiln.ip=, kiln.gateway=,
// kiln.mac=, kiln.dns=. It returns InvalidArgument for a malformed field.
func (n *BootNetwork) Cmdline() (string, error) {
	if n == nil {
		return "", nil
	}
	p, err := netip.ParsePrefix(n.Address)
	if err != nil {
		return "", errdefs.InvalidArgument("boot network address %q: want ADDR/PREFIX", n.Address)
	}
	parts := []string{"kiln.ip=" + p.String()}
	if n.Gateway != "" {
		gw, err := netip.ParseAddr(n.Gateway)
		if err != nil {
			return "", errdefs.InvalidArgument("boot network gateway %q: %v", n.Gateway, err)
		}
		if gw.Zone() != "" {
			// A zone is free text: it would put anything on the command line.
			return "", errdefs.InvalidArgument("boot network gateway %q: remove the zone (%%%s): the boot NIC is chosen by kiln.mac", n.Gateway, gw.Zone())
		}
		parts = append(parts, "kiln.gateway="+gw.String())
	}
	if n.MAC != "" {
		mac, err := net.ParseMAC(n.MAC)
		if err != nil {
			return "", errdefs.InvalidArgument("boot network MAC %q: %v", n.MAC, err)
		}
		parts = append(parts, "kiln.mac="+mac.String())
	}
	var dns []string
	for _, d := range n.DNS {
		a, err := netip.ParseAddr(d)
		if err != nil {
			return "", errdefs.InvalidArgument("boot network DNS server %q: %v", d, err)
		}
		if a.Zone() != "" {
			return "", errdefs.InvalidArgument("boot network DNS server %q: remove the zone (%%%s)", d, a.Zone())
		}
		dns = append(dns, a.String())
	}
	if len(dns) > 0 {
		parts = append(parts, "kiln.dns="+strings.Join(dns, ","))
	}
	return strings.Join(parts, " "), nil
}

// ISOBuilder writes an ISO to out that boots kernel and initrd with
// cmdline (bootmedia.BuildISO).
type ISOBuilder func(ctx context.Context, kernel, initrd, cmdline, out string) error

// Options configure a Server.
type Options struct {
	// MediaDir holds the boot media (kiln-imagebuilder bootmedia -o DIR);
	// required.
	MediaDir string
	// ImagesDir holds golden images; "" serves none.
	ImagesDir string
	// ControllerAddr is the controller API address the agent enrolls with,
	// host:port as the hosts reach it; required.
	ControllerAddr string
	// CAHash pins the controller CA, "sha256:<hex>"; required.
	CAHash string
	// CurrentCAHash, when set, is asked for the pin of each script or ISO
	// instead of CAHash (which stays the check at New): the pin changes
	// when the controller's CA is rotated (kiln-controller rotate-ca).
	CurrentCAHash func() string
	// PublicURL is this server's base URL as hosts reach it
	// ("http://10.0.0.1:8080"); default: from the request's Host header.
	PublicURL string
	// Tokens mints the per-host boot tokens; required.
	Tokens TokenIssuer
	// Networks gives hosts without DHCP a static address on their ISO and
	// iPXE command line; nil means DHCP for all.
	Networks NetworkSource
	// Cmdline is added to every boot's kernel command line.
	Cmdline string
	// ISOCacheDir keeps the per-host ISOs; default a temporary directory
	// removed by Close.
	ISOCacheDir string
	// ISOMaxAge rebuilds a host's ISO (with a new token) once it is older
	// than this (default 1h: about a token's lifetime).
	ISOMaxAge time.Duration
	// BuildISO builds per-host ISOs (default bootmedia.BuildISO with
	// grub-mkrescue).
	BuildISO ISOBuilder
	// Log receives one line per boot request; tokens are never logged.
	Log *slog.Logger
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// Server is the boot HTTP server. It is an http.Handler.
type Server struct {
	o       Options
	log     *slog.Logger
	mux     *http.ServeMux
	tmpDir  string
	digests digestCache

	mu   sync.Mutex
	isos map[string]*hostISO
}

type hostISO struct {
	mu    sync.Mutex // held while building
	path  string
	built time.Time
	// gone is set (under mu) when the entry left Server.isos: a request
	// that waited for mu looks the host up again instead of building into
	// an entry nobody can find.
	gone bool
}

var _ http.Handler = (*Server)(nil)

// New returns a Server. It returns InvalidArgument for missing options.
func New(o Options) (*Server, error) {
	switch {
	case o.MediaDir == "":
		return nil, errdefs.InvalidArgument("boot server: a boot media directory is required")
	case o.ControllerAddr == "":
		return nil, errdefs.InvalidArgument("boot server: the controller address is required")
	case !hashRE.MatchString(o.CAHash):
		return nil, errdefs.InvalidArgument("boot server: CA hash %q: want sha256:<64 hex digits>", o.CAHash)
	case o.Tokens == nil:
		return nil, errdefs.InvalidArgument("boot server: a token issuer is required")
	case !cmdlineRE.MatchString(o.ControllerAddr) || (o.Cmdline != "" && !cmdlineRE.MatchString(strings.ReplaceAll(o.Cmdline, " ", ""))):
		return nil, errdefs.InvalidArgument("boot server: controller address and command line may hold only letters, digits and .:_-=/,[]")
	}
	if o.ISOMaxAge <= 0 {
		o.ISOMaxAge = time.Hour
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.BuildISO == nil {
		o.BuildISO = func(ctx context.Context, kernel, initrd, cmdline, out string) error {
			return bootmedia.BuildISO(ctx, bootmedia.ExecRunner{}, kernel, initrd, cmdline, out)
		}
	}
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{o: o, log: log.With("component", "bootserver"), mux: http.NewServeMux(), isos: map[string]*hostISO{}}
	if s.o.ISOCacheDir == "" {
		dir, err := os.MkdirTemp("", "kiln-boot-iso-")
		if err != nil {
			return nil, fmt.Errorf("boot server: %w", err)
		}
		s.o.ISOCacheDir, s.tmpDir = dir, dir
	} else if err := os.MkdirAll(s.o.ISOCacheDir, 0o700); err != nil {
		return nil, fmt.Errorf("boot server: %w", err)
	}
	s.mux.HandleFunc("GET /boot/files/{name}", func(w http.ResponseWriter, r *http.Request) {
		s.serveFile(w, r, o.MediaDir, r.PathValue("name"))
	})
	s.mux.HandleFunc("GET /images/{name}", func(w http.ResponseWriter, r *http.Request) {
		if o.ImagesDir == "" {
			http.NotFound(w, r)
			return
		}
		s.serveFile(w, r, o.ImagesDir, r.PathValue("name"))
	})
	s.mux.HandleFunc("GET /boot/ipxe/{host}", s.serveIPXE)
	s.mux.HandleFunc("GET /boot/iso/{file}", s.serveISO)
	// HEAD never mints a boot token (a GET pattern also matches HEAD):
	// the iPXE script is refused, an ISO is answered only when built.
	s.mux.HandleFunc("HEAD /boot/ipxe/{host}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", "GET")
		http.Error(w, "GET the iPXE script: each one carries a new boot token", http.StatusMethodNotAllowed)
	})
	s.mux.HandleFunc("HEAD /boot/iso/{file}", s.headISO)
	return s, nil
}

// Close removes the temporary ISO cache, if New made one.
func (s *Server) Close() error {
	if s.tmpDir != "" {
		return os.RemoveAll(s.tmpDir)
	}
	return nil
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

var (
	hostRE    = regexp.MustCompile(`^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$`)
	hashRE    = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)
	tokenRE   = regexp.MustCompile(`^[A-Za-z0-9._-]{1,256}$`)
	cmdlineRE = regexp.MustCompile(`^[A-Za-z0-9.:_=/,\[\]-]*$`)
)

// serveFile serves dir/name with Range support and its digest headers.
func (s *Server) serveFile(w http.ResponseWriter, r *http.Request, dir, name string) {
	if name == "" || name != path.Base(name) || strings.HasPrefix(name, ".") {
		http.NotFound(w, r)
		return
	}
	p := filepath.Join(dir, name)
	// Inside dir only: a symlink out of it is not followed.
	f, err := os.OpenInRoot(dir, name)
	if err != nil {
		http.NotFound(w, r)
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		http.NotFound(w, r)
		return
	}
	sum, err := s.digests.get(dir, name, p, st)
	if err != nil {
		s.log.Error("digest", "file", p, "error", err)
		http.Error(w, "cannot read "+name, http.StatusInternalServerError)
		return
	}
	setDigest(w.Header(), sum)
	serveContent(w, r, name, st.ModTime(), st.Size(), f)
}

// serveContent is http.ServeContent, but a Range asking for the last 0
// bytes ("bytes=-0") is answered 416: ServeContent answers it 206 with
// the impossible Content-Range "bytes SIZE-(SIZE-1)/SIZE" (found by
// FuzzBootServer).
func serveContent(w http.ResponseWriter, r *http.Request, name string, modtime time.Time, size int64, content io.ReadSeeker) {
	if spec, ok := strings.CutPrefix(r.Header.Get("Range"), "bytes="); ok {
		for _, ra := range strings.Split(spec, ",") {
			// net/http trims spaces around each number ("bytes=- 0").
			if n, ok := strings.CutPrefix(strings.TrimSpace(ra), "-"); ok && strings.TrimSpace(n) != "" && strings.Trim(strings.TrimSpace(n), "0") == "" {
				w.Header().Set("Content-Range", fmt.Sprintf("bytes */%d", size))
				http.Error(w, "requested range not satisfiable: a suffix range of 0 bytes", http.StatusRequestedRangeNotSatisfiable)
				return
			}
		}
	}
	http.ServeContent(w, r, name, modtime, content)
}

func fileSize(f *os.File) int64 {
	if st, err := f.Stat(); err == nil {
		return st.Size()
	}
	return 0
}

// setDigest sets X-Kiln-Sha256 (hex) and Digest: sha-256=<base64> (RFC 3230).
func setDigest(h http.Header, sum []byte) {
	h.Set("X-Kiln-Sha256", hex.EncodeToString(sum))
	h.Set("Digest", "sha-256="+base64.StdEncoding.EncodeToString(sum))
}

// Cmdline is the kernel command line of host's boot by bootSource ("pxe"
// or "virtualmedia"), token and static network (netCmdline, may be "")
// included.
func (s *Server) Cmdline(host, bootSource, token, netCmdline string) string {
	parts := []string{bootmedia.DefaultCmdline, "kiln.boot=" + bootSource,
		"kiln.controller=" + s.o.ControllerAddr, "kiln.token=" + token,
		"kiln.ca_hash=" + s.caHash(), "kiln.host=" + host}
	if netCmdline != "" {
		parts = append(parts, netCmdline)
	}
	if s.o.Cmdline != "" {
		parts = append(parts, s.o.Cmdline)
	}
	return strings.Join(parts, " ")
}

// network returns the kernel parameters of host's static boot network,
// "" for DHCP.
func (s *Server) network(ctx context.Context, host string) (string, int, error) {
	if s.o.Networks == nil {
		return "", 0, nil
	}
	n, err := s.o.Networks.BootNetwork(ctx, host)
	switch {
	case errdefs.IsNotFound(err):
		return "", http.StatusNotFound, err
	case err != nil:
		return "", http.StatusServiceUnavailable, err
	}
	c, err := n.Cmdline()
	if err != nil {
		return "", http.StatusInternalServerError, err
	}
	return c, 0, nil
}

func (s *Server) token(ctx context.Context, host string) (string, int, error) {
	tok, err := s.o.Tokens.BootToken(ctx, host)
	switch {
	case errdefs.IsNotFound(err):
		return "", http.StatusNotFound, err
	case errdefs.IsPermissionDenied(err), errdefs.IsFailedPrecondition(err):
		return "", http.StatusForbidden, err
	case err != nil:
		return "", http.StatusServiceUnavailable, err
	case !tokenRE.MatchString(tok):
		return "", http.StatusInternalServerError, errors.New("token issuer returned a malformed token")
	}
	return tok, 0, nil
}

func (s *Server) baseURL(r *http.Request) string {
	if s.o.PublicURL != "" {
		return strings.TrimSuffix(s.o.PublicURL, "/")
	}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	return scheme + "://" + r.Host
}

func (s *Server) serveIPXE(w http.ResponseWriter, r *http.Request) {
	host := r.PathValue("host")
	if !hostRE.MatchString(host) {
		http.Error(w, "bad host name", http.StatusBadRequest)
		return
	}
	netc, code, err := s.network(r.Context(), host)
	if err != nil {
		s.log.Warn("ipxe script refused", "host", host, "remote", r.RemoteAddr, "error", err)
		http.Error(w, fmt.Sprintf("no boot network for host %s: %v", host, err), code)
		return
	}
	tok, code, err := s.token(r.Context(), host)
	if err != nil {
		s.log.Warn("ipxe script refused", "host", host, "remote", r.RemoteAddr, "error", err)
		http.Error(w, fmt.Sprintf("no boot token for host %s: %v", host, err), code)
		return
	}
	base := s.baseURL(r)
	script := IPXEScript(host, base, s.Cmdline(host, "pxe", tok, netc))
	s.log.Info("ipxe script served", "host", host, "remote", r.RemoteAddr)
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = io.WriteString(w, script)
}

// IPXEScript is the iPXE script that boots host from the boot media under
// base (a URL) with cmdline. BOOTIF tells the init which NIC booted.
func IPXEScript(host, base, cmdline string) string {
	return "#!ipxe\n" +
		"echo Kiln: booting the agent of host " + host + "\n" +
		"kernel " + base + "/boot/files/" + bootmedia.KernelFile + " initrd=" + bootmedia.InitrdFile + " " + cmdline + " BOOTIF=01-${mac:hexhyp}\n" +
		"initrd " + base + "/boot/files/" + bootmedia.InitrdFile + "\n" +
		"boot\n"
}

func (s *Server) serveISO(w http.ResponseWriter, r *http.Request) {
	host, ok := strings.CutSuffix(r.PathValue("file"), ".iso")
	if !ok || !hostRE.MatchString(host) {
		http.NotFound(w, r)
		return
	}
	iso, code, err := s.hostISO(r.Context(), host)
	if err != nil {
		s.log.Warn("iso refused", "host", host, "remote", r.RemoteAddr, "error", err)
		http.Error(w, fmt.Sprintf("no ISO for host %s: %v", host, err), code)
		return
	}
	f, err := os.Open(iso.path)
	if err != nil {
		http.Error(w, "ISO vanished, retry", http.StatusServiceUnavailable)
		return
	}
	defer f.Close()
	sum, err := s.digests.get(s.o.ISOCacheDir, filepath.Base(iso.path), iso.path, nil)
	if err != nil {
		http.Error(w, "cannot read the ISO", http.StatusInternalServerError)
		return
	}
	setDigest(w.Header(), sum)
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Type", "application/x-iso9660-image")
	serveContent(w, r, host+".iso", iso.built, fileSize(f), f)
}

// headISO answers HEAD for a host's ISO from the ISO already built, and
// 404 when there is none: building one would mint a boot token.
func (s *Server) headISO(w http.ResponseWriter, r *http.Request) {
	host, ok := strings.CutSuffix(r.PathValue("file"), ".iso")
	if !ok || !hostRE.MatchString(host) {
		http.NotFound(w, r)
		return
	}
	s.mu.Lock()
	h := s.isos[host]
	s.mu.Unlock()
	if h == nil {
		http.Error(w, "no ISO built for host "+host+" yet: GET builds it", http.StatusNotFound)
		return
	}
	h.mu.Lock()
	path, built := h.path, h.built
	h.mu.Unlock()
	f, err := os.Open(path)
	if path == "" || err != nil {
		http.Error(w, "no ISO built for host "+host+" yet: GET builds it", http.StatusNotFound)
		return
	}
	defer f.Close()
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Type", "application/x-iso9660-image")
	serveContent(w, r, host+".iso", built, fileSize(f), f)
}

// hostISO returns the host's ISO, building it (with a new boot token) when
// there is none or it is older than ISOMaxAge. Concurrent requests (a
// BMC reading with many Range requests) wait for one build.
func (s *Server) hostISO(ctx context.Context, host string) (*hostISO, int, error) {
	for {
		s.mu.Lock()
		h := s.isos[host]
		if h == nil {
			h = &hostISO{}
			s.isos[host] = h
		}
		s.mu.Unlock()
		h.mu.Lock()
		if h.gone {
			h.mu.Unlock()
			continue
		}
		iso, code, err := s.buildISO(ctx, host, h)
		if err != nil && h.path == "" {
			// Nothing cached: the entry goes, so that requests for hosts
			// that do not exist (or may not boot) leave nothing behind.
			s.drop(host, h)
		}
		h.mu.Unlock()
		return iso, code, err
	}
}

// drop removes h from the cache when it is still host's entry. The caller
// holds h.mu.
func (s *Server) drop(host string, h *hostISO) {
	s.mu.Lock()
	if s.isos[host] == h {
		delete(s.isos, host)
	}
	s.mu.Unlock()
	h.gone = true
}

// buildISO returns h when its ISO is fresh, or builds a new one into it.
// The caller holds h.mu.
func (s *Server) buildISO(ctx context.Context, host string, h *hostISO) (*hostISO, int, error) {
	if h.path != "" && s.o.Now().Sub(h.built) < s.o.ISOMaxAge {
		if _, err := os.Stat(h.path); err == nil {
			return h, 0, nil
		}
	}
	netc, code, err := s.network(ctx, host)
	if err != nil {
		return nil, code, err
	}
	tok, code, err := s.token(ctx, host)
	if err != nil {
		return nil, code, err
	}
	t0 := time.Now()
	out := filepath.Join(s.o.ISOCacheDir, fmt.Sprintf("%s-%d.iso", host, s.o.Now().UnixNano()))
	if err := s.o.BuildISO(ctx, filepath.Join(s.o.MediaDir, bootmedia.KernelFile), filepath.Join(s.o.MediaDir, bootmedia.InitrdFile),
		s.Cmdline(host, "virtualmedia", tok, netc), out); err != nil {
		return nil, http.StatusInternalServerError, fmt.Errorf("build ISO: %w", err)
	}
	if h.path != "" {
		_ = os.Remove(h.path)
		s.digests.forget(h.path)
	}
	h.path, h.built = out, s.o.Now()
	s.log.Info("iso built", "host", host, "path", out, "duration", time.Since(t0).Round(time.Millisecond))
	return h, 0, nil
}

// Forget drops host's cached ISO, so that its next boot from virtual media
// gets a fresh boot token. The controller calls it when it provisions the
// host again.
func (s *Server) Forget(host string) {
	s.mu.Lock()
	h := s.isos[host]
	delete(s.isos, host)
	s.mu.Unlock()
	if h != nil {
		h.mu.Lock()
		h.gone = true
		if h.path != "" {
			_ = os.Remove(h.path)
			s.digests.forget(h.path)
		}
		h.mu.Unlock()
	}
}

// CachedISOs is the number of hosts with an entry in the ISO cache.
func (s *Server) CachedISOs() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.isos)
}

// ISOURL is the URL of host's virtual media under base (PublicURL).
func ISOURL(base, host string) string {
	return strings.TrimSuffix(base, "/") + "/boot/iso/" + host + ".iso"
}

// IPXEURL is the URL of host's iPXE script under base (PublicURL).
func IPXEURL(base, host string) string {
	return strings.TrimSuffix(base, "/") + "/boot/ipxe/" + host
}

// digestCache keeps sha256 of served files, from the directory's
// bootmedia.json or image manifests' "<name>.sha256" sidecars when present,
// else computed once per (path, size, mtime).
type digestCache struct {
	mu sync.Mutex
	m  map[string]digestEntry
}

type digestEntry struct {
	size  int64
	mtime time.Time
	sum   []byte
}

func (c *digestCache) get(dir, name, p string, st os.FileInfo) ([]byte, error) {
	if st == nil {
		var err error
		if st, err = os.Stat(p); err != nil {
			return nil, err
		}
	}
	c.mu.Lock()
	e, ok := c.m[p]
	c.mu.Unlock()
	if ok && e.size == st.Size() && e.mtime.Equal(st.ModTime()) {
		return e.sum, nil
	}
	sum := declaredDigest(dir, name, st.Size())
	if sum == nil {
		f, err := os.Open(p)
		if err != nil {
			return nil, err
		}
		h := sha256.New()
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return nil, err
		}
		sum = h.Sum(nil)
	}
	c.mu.Lock()
	if c.m == nil {
		c.m = map[string]digestEntry{}
	}
	c.m[p] = digestEntry{size: st.Size(), mtime: st.ModTime(), sum: sum}
	c.mu.Unlock()
	return sum, nil
}

func (c *digestCache) forget(p string) {
	c.mu.Lock()
	delete(c.m, p)
	c.mu.Unlock()
}

// declaredDigest reads name's sha256 from dir/bootmedia.json or the
// sidecar dir/name.sha256 ("<hex>  name", as sha256sum writes it); nil
// when neither declares it for a file of this size.
func declaredDigest(dir, name string, size int64) []byte {
	if m, err := bootmedia.ReadManifest(dir); err == nil {
		if f, ok := m.File(name); ok && f.Size == size {
			if b, err := hex.DecodeString(f.SHA256); err == nil && len(b) == sha256.Size {
				return b
			}
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, name+".sha256")); err == nil {
		if fields := strings.Fields(string(b)); len(fields) > 0 {
			if sum, err := hex.DecodeString(fields[0]); err == nil && len(sum) == sha256.Size {
				return sum
			}
		}
	}
	return nil
}

// caHash is the CA pin to hand out now.
func (s *Server) caHash() string {
	if s.o.CurrentCAHash != nil {
		if h := s.o.CurrentCAHash(); hashRE.MatchString(h) {
			return h
		}
	}
	return s.o.CAHash
}
