package netns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// The lab's boot firmware: what a host's firmware reads before the boot
// agent runs. With Agent.ReadMedia a virtual-media boot downloads the
// inserted ISO (as a BMC does, from the supervisor's network namespace)
// and takes the kernel command line of its boot configuration; with
// Agent.BootScript a PXE boot fetches the host's iPXE script from inside
// the host's network namespace (as its NIC would) and takes the command
// line of its kernel line. Boot media that cannot be read boot nothing,
// with the reason in LastBootError.

// firmwareTimeout bounds reading a boot script or an ISO.
const firmwareTimeout = 2 * time.Minute

// maxScript bounds an iPXE script.
const maxScript = 1 << 20

// firmwareCmdline returns the kernel command line the host's boot media
// carry, or "" when the lab's own command line applies (PXE without a boot
// script URL, virtual media without ReadMedia). Media that cannot be read
// are a *notBootable.
func (m *Machine) firmwareCmdline(ctx context.Context, dev, media string) (string, error) {
	a := m.o.Agent
	// Firmware boots whether or not whoever pressed the power button is
	// still there: the BMC request that powered the host on may end (its
	// client crashed) while the ISO is read.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), firmwareTimeout)
	defer cancel()
	switch {
	case dev == machine.BootCD && a.ReadMedia && media != "":
		c, err := m.isoCmdline(ctx, media)
		if err != nil {
			var nb *notBootable
			if errors.As(err, &nb) {
				nb.reason = "virtual media " + redact(media) + ": " + nb.reason
			}
			return "", err
		}
		return c, nil
	case dev == machine.BootPXE && a.BootScript != "":
		c, err := m.pxeCmdline(ctx, a.BootScript)
		var nb *notBootable
		if errors.As(err, &nb) {
			nb.reason = "PXE boot script " + redact(a.BootScript) + ": " + nb.reason
		}
		return c, err
	}
	return "", nil
}

// redact hides a password in a URL.
func redact(s string) string {
	if u, err := url.Parse(s); err == nil && u.User != nil {
		return u.Redacted()
	}
	return s
}

// statusError is an HTTP answer other than 200.
type statusError struct {
	status string
	code   int
}

func (e *statusError) Error() string { return "HTTP " + e.status }

// retrying runs f until it succeeds, fails for good (an HTTP 4xx), or
// Agent.FirmwareRetry has passed: firmware and BMCs try again when the
// boot server is briefly away (restarting), not when it says no.
func (m *Machine) retrying(ctx context.Context, f func() error) error {
	deadline := time.Now().Add(m.o.Agent.FirmwareRetry)
	for {
		err := f()
		var se *statusError
		if err == nil || (errors.As(err, &se) && se.code < 500) || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		m.log.Info("boot media not available yet, retrying", "error", err)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(2 * time.Second):
		}
	}
}

// --- virtual media

// isoCmdline downloads the ISO at media (http, https, file:// or an
// absolute path) into the host's state directory, reads its kernel
// command line and removes it.
func (m *Machine) isoCmdline(ctx context.Context, media string) (string, error) {
	if _, err := exec.LookPath("xorriso"); err != nil {
		return "", errdefs.FailedPrecondition("xorriso not found (Debian package xorriso): cannot read virtual media")
	}
	iso := media
	if p, ok := strings.CutPrefix(media, "file://"); ok {
		iso = p
	}
	if !filepath.IsAbs(iso) {
		u, err := url.Parse(media)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return "", &notBootable{"not an http(s) URL, file:// URL or absolute path"}
		}
		iso = filepath.Join(m.o.StateDir, "media.iso")
		defer os.Remove(iso)
		if err := m.retrying(ctx, func() error { return download(ctx, &http.Client{}, media, iso) }); err != nil {
			return "", &notBootable{err.Error()}
		}
	}
	if _, err := os.Stat(iso); err != nil {
		return "", &notBootable{err.Error()}
	}
	c, err := ReadISOCmdline(ctx, iso)
	if err != nil {
		return "", &notBootable{err.Error()}
	}
	return c, nil
}

// download writes the body of a 200 answer to GET u into path.
func download(ctx context.Context, c *http.Client, u, path string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // the URL, maybe with a password, is named by the caller
		}
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return &statusError{resp.Status, resp.StatusCode}
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("reading the body: %w", err)
	}
	return f.Close()
}

// BootConfigs are the boot configuration files ReadISOCmdline looks for,
// in order: GRUB's (what imagebuilder/bootmedia writes), then isolinux's.
var BootConfigs = []string{"/boot/grub/grub.cfg", "/EFI/BOOT/grub.cfg", "/isolinux/isolinux.cfg", "/boot/isolinux/isolinux.cfg", "/syslinux/syslinux.cfg"}

// ReadISOCmdline returns the kernel command line of the first boot entry
// of the ISO 9660 image at path: the arguments of GRUB's `linux KERNEL
// ARGS…` or isolinux's `append ARGS…`. It reads the image with `xorriso
// -osirrox on -indev ISO -extract FILE OUT`. It returns InvalidArgument
// when the image is not an ISO or holds no boot configuration with a
// kernel command line.
func ReadISOCmdline(ctx context.Context, path string) (string, error) {
	dir, err := os.MkdirTemp("", "kiln-iso-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	for i, cfg := range BootConfigs {
		out := filepath.Join(dir, fmt.Sprintf("%d.cfg", i))
		b, err := exec.CommandContext(ctx, "xorriso", "-osirrox", "on", "-indev", path, "-extract", cfg, out).CombinedOutput()
		if ctx.Err() != nil {
			return "", ctx.Err()
		}
		if strings.Contains(string(b), "No ISO 9660 image") || strings.Contains(string(b), "Media status : is blank") {
			return "", errdefs.InvalidArgument("not an ISO 9660 image")
		}
		if err != nil {
			continue // no such file in the image
		}
		content, err := os.ReadFile(out)
		if err != nil {
			continue
		}
		if c, ok := ParseBootConfig(string(content)); ok {
			return c, nil
		}
	}
	return "", errdefs.InvalidArgument("no kernel command line in the ISO (looked in %s)", strings.Join(BootConfigs, ", "))
}

// ParseBootConfig returns the kernel command line of the first boot entry
// of a GRUB configuration (`linux KERNEL ARGS…`, also linuxefi and
// linux16) or an isolinux one (`append ARGS…`), and whether it found one.
func ParseBootConfig(cfg string) (string, bool) {
	sc := bufio.NewScanner(strings.NewReader(cfg))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		switch strings.ToLower(f[0]) {
		case "linux", "linuxefi", "linux16":
			if len(f) >= 2 {
				return strings.Join(f[2:], " "), true
			}
		case "append":
			return strings.Join(f[1:], " "), true
		}
	}
	return "", false
}

// --- PXE

// pxeCmdline fetches the iPXE script at script from inside the host's
// network namespace, follows `chain` (up to 4 times), checks that its
// kernel and initrd URLs answer, and returns the kernel's arguments with
// iPXE's ${mac…} settings expanded.
func (m *Machine) pxeCmdline(ctx context.Context, script string) (string, error) {
	tr := &http.Transport{DialContext: DialInNamespace(m.NetnsPath()), DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	u := script
	for range 5 {
		var body []byte
		err := m.retrying(ctx, func() (err error) { body, err = fetch(ctx, c, u, maxScript); return err })
		if err != nil {
			return "", &notBootable{err.Error()}
		}
		s, err := ParseIPXE(string(body), m.o.MAC)
		if err != nil {
			return "", &notBootable{err.Error()}
		}
		base, _ := url.Parse(u)
		if s.Chain != "" {
			next, err := base.Parse(s.Chain)
			if err != nil {
				return "", &notBootable{fmt.Sprintf("chain %q: %v", s.Chain, err)}
			}
			u = next.String()
			continue
		}
		for _, f := range append([]string{s.Kernel}, s.Initrds...) {
			fu, err := base.Parse(f)
			if err != nil {
				return "", &notBootable{fmt.Sprintf("%q: %v", f, err)}
			}
			if err := probe(ctx, c, fu.String()); err != nil {
				return "", &notBootable{fmt.Sprintf("%s: %v", redact(fu.String()), err)}
			}
		}
		return s.Cmdline, nil
	}
	return "", &notBootable{"more than 4 chained scripts"}
}

// fetch returns the body of a 200 answer to GET u, at most limit bytes.
func fetch(ctx context.Context, c *http.Client, u string, limit int64) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, &statusError{resp.Status, resp.StatusCode}
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("longer than %d bytes", limit)
	}
	return b, nil
}

// probe checks that GET u answers with its first byte (Range: bytes=0-0).
func probe(ctx context.Context, c *http.Client, u string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Range", "bytes=0-0")
	resp, err := c.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusPartialContent {
		return fmt.Errorf("HTTP %s", resp.Status)
	}
	return nil
}

// IPXEScript is what the lab's firmware takes from an iPXE script.
type IPXEScript struct {
	// Kernel is the URL of the kernel line, Cmdline its arguments.
	Kernel, Cmdline string
	// Initrds are the URLs of the initrd lines.
	Initrds []string
	// Chain is the URL of a chain line that comes before any kernel line.
	Chain string
}

// ParseIPXE reads an iPXE script (it must start with #!ipxe): the first
// `kernel [--name N] URL ARGS…` line, `initrd URL` lines and a `chain URL` before any kernel. ${mac},
// ${mac:hexhyp}, ${mac:hex} and ${netX/mac…} expand to mac (the booting
// NIC, as iPXE does); other settings expand to "".
func ParseIPXE(script, mac string) (*IPXEScript, error) {
	lines := strings.Split(strings.ReplaceAll(script, "\r\n", "\n"), "\n")
	if len(lines) == 0 || !strings.HasPrefix(strings.TrimSpace(lines[0]), "#!ipxe") {
		return nil, errdefs.InvalidArgument("not an iPXE script (no #!ipxe line)")
	}
	s := &IPXEScript{}
	for _, l := range lines[1:] {
		f := strings.Fields(expandIPXE(l, mac))
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		args := f[1:]
		for len(args) > 0 && strings.HasPrefix(args[0], "-") { // --name x, --autofree, ...
			if (args[0] == "--name" || args[0] == "-n" || args[0] == "--timeout") && len(args) > 1 {
				args = args[1:]
			}
			args = args[1:]
		}
		switch f[0] {
		case "kernel":
			if s.Kernel == "" && len(args) > 0 {
				s.Kernel, s.Cmdline = args[0], strings.Join(args[1:], " ")
			}
		case "initrd", "module":
			if len(args) > 0 {
				s.Initrds = append(s.Initrds, args[0])
			}
		case "chain", "chainload":
			if s.Kernel == "" && s.Chain == "" && len(args) > 0 {
				s.Chain = args[0]
			}
		}
		if s.Chain != "" {
			return s, nil
		}
	}
	if s.Kernel == "" {
		return nil, errdefs.InvalidArgument("the iPXE script has no kernel line")
	}
	return s, nil
}

// expandIPXE expands ${…} settings of one script line.
func expandIPXE(line, mac string) string {
	var b strings.Builder
	for {
		i := strings.Index(line, "${")
		if i < 0 {
			b.WriteString(line)
			return b.String()
		}
		j := strings.Index(line[i:], "}")
		if j < 0 {
			b.WriteString(line)
			return b.String()
		}
		b.WriteString(line[:i])
		name := line[i+2 : i+j]
		setting, typ, _ := strings.Cut(name, ":")
		if setting == "mac" || strings.HasSuffix(setting, "/mac") {
			switch typ {
			case "hexhyp":
				b.WriteString(strings.ReplaceAll(mac, ":", "-"))
			case "hexraw":
				b.WriteString(strings.ReplaceAll(mac, ":", ""))
			default:
				b.WriteString(mac)
			}
		}
		line = line[i+j+1:]
	}
}

// DialInNamespace returns a DialContext that opens its connections inside
// the network namespace at nsPath (/run/netns/NAME), as a host's own NIC
// would: the socket is made by a thread that entered the namespace, and
// that thread is discarded afterwards. Addresses should be IP literals (a
// name is resolved from this namespace's view).
func DialInNamespace(nsPath string) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		type result struct {
			c   net.Conn
			err error
		}
		ch := make(chan result, 1)
		go func() {
			// Never unlocked: the thread in the other namespace ends with
			// this goroutine.
			runtime.LockOSThread()
			fd, err := unix.Open(nsPath, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				ch <- result{nil, fmt.Errorf("network namespace: %w", err)}
				return
			}
			err = unix.Setns(fd, unix.CLONE_NEWNET)
			unix.Close(fd)
			if err != nil {
				ch <- result{nil, fmt.Errorf("enter network namespace %s: %w", nsPath, err)}
				return
			}
			d := net.Dialer{FallbackDelay: -1}
			c, err := d.DialContext(ctx, network, addr)
			ch <- result{c, err}
		}()
		r := <-ch
		return r.c, r.err
	}
}
