// Package personalize writes a host's identity into a freshly laid golden
// image, before the host reboots into it: its host name, and the agent
// identity the controller issued for it (key, certificate, CA, controller
// address) in the installed agent's data directory. The installed agent then
// starts enrolled, with no token and no shared secret.
//
// A request may also carry the host's network configuration
// (network_config): the content of a systemd-networkd .network file, written
// as NetworkFile (0644, root-owned). It must have a [Match] and a [Network]
// section, be at most MaxNetworkConfig bytes of UTF-8 text with no control
// characters other than tab and newline, and is checked before anything is
// written (see ValidateNetworkConfig). An empty network_config writes
// nothing: the image keeps its own network setup (typically DHCP).
//
// It edits the image's root filesystem without mounting it, with debugfs
// (e2fsprogs) at the root partition's offset, and reads every file back to
// verify it. The root partition is the GPT partition of the discoverable
// root type (x86-64 or arm64), else the only Linux filesystem partition;
// a target that is a bare ext4 filesystem is used whole.
package personalize

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/kilnhq/kiln/agent/enroll"
	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// DataDir is the installed agent's data directory inside the image.
const DataDir = "/var/lib/kiln-agent"

// NetworkFile is where a request's network_config is written in the image.
const NetworkFile = "/etc/systemd/network/10-kiln.network"

// MaxNetworkConfig is the largest network_config accepted, in bytes.
const MaxNetworkConfig = 64 << 10

// Runner runs a host command and returns its standard output
// (command.Exec in production).
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
}

// Writer writes identities into images.
type Writer struct {
	run Runner
	log *slog.Logger
}

// New returns a Writer running debugfs through run.
func New(run Runner, log *slog.Logger) *Writer {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Writer{run: run, log: log.With("component", "personalize")}
}

// file is one file to put into the image.
type file struct {
	path string // absolute, inside the image
	data []byte
	mode os.FileMode
}

// WriteIdentity writes req's identity into the root filesystem of the
// image on req.Target. The image must not be mounted.
//
// Equivalent to: `debugfs -w -f SCRIPT 'TARGET?offset=ROOT_PARTITION_OFFSET'`.
//
// Errors: InvalidArgument for a missing field or an identity that does not
// hold together (key and certificate, certificate and CA, CA and ca_hash,
// certificate and hostname) or a network_config that is not a valid
// systemd-networkd .network file (ValidateNetworkConfig); NotFound for a missing target; FailedPrecondition when the
// target holds no root filesystem or a file does not read back as written;
// the runner's error when debugfs fails. The private key never appears in
// errors or logs. It blocks until written and verified.
func (w *Writer) WriteIdentity(ctx context.Context, req *agentv1.WriteIdentityRequest) error {
	var missing []string
	for _, f := range []struct {
		name string
		ok   bool
	}{
		{"target", req.GetTarget() != ""},
		{"hostname", req.GetHostname() != ""},
		{"controller_url", req.GetControllerUrl() != ""},
		{"ca_hash", req.GetCaHash() != ""},
		{"certificate_pem", len(req.GetCertificatePem()) > 0},
		{"key_pem", len(req.GetKeyPem()) > 0},
		{"ca_pem", len(req.GetCaPem()) > 0},
	} {
		if !f.ok {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return errdefs.InvalidArgument("write identity: %s required", strings.Join(missing, ", "))
	}
	if err := ValidateNetworkConfig(req.GetNetworkConfig()); err != nil {
		return fmt.Errorf("write identity for host %q: %w", req.GetHostname(), err)
	}

	// Lay the identity out exactly as the agent keeps it, which also checks
	// that it holds together.
	stage, err := os.MkdirTemp("", "kiln-identity-")
	if err != nil {
		return fmt.Errorf("write identity: %w", err)
	}
	defer os.RemoveAll(stage)
	idDir := filepath.Join(stage, "id")
	if _, err := identity.Save(idDir, identity.Files{
		KeyPEM:  req.GetKeyPem(),
		CertPEM: req.GetCertificatePem(),
		CAPEM:   req.GetCaPem(),
		Controller: identity.Controller{
			Address: enroll.Address(req.GetControllerUrl()),
			CAHash:  req.GetCaHash(),
			Host:    req.GetHostname(),
		},
	}); err != nil {
		return fmt.Errorf("write identity for host %q: %w", req.GetHostname(), err)
	}
	files := []file{{path: "/etc/hostname", data: []byte(req.GetHostname() + "\n"), mode: 0o644}}
	for _, f := range []struct {
		name string
		mode os.FileMode
	}{
		{identity.KeyFile, 0o600},
		{identity.CertFile, 0o644},
		{identity.CAFile, 0o644},
		{identity.ControllerFile, 0o644},
	} {
		data, err := os.ReadFile(filepath.Join(idDir, f.name))
		if err != nil {
			return fmt.Errorf("write identity: %w", err)
		}
		files = append(files, file{path: path.Join(DataDir, f.name), data: data, mode: f.mode})
	}
	if nc := req.GetNetworkConfig(); nc != "" {
		files = append(files, file{path: NetworkFile, data: []byte(nc), mode: 0o644})
	}

	off, err := RootOffset(req.GetTarget())
	if err != nil {
		return fmt.Errorf("write identity: %w", err)
	}
	fs := req.GetTarget() + "?offset=" + strconv.FormatInt(off, 10)
	mkdirs, err := w.missingDirs(ctx, fs, files)
	if err != nil {
		return fmt.Errorf("write identity into %s: %w", req.GetTarget(), err)
	}
	script, err := w.script(stage, mkdirs, files)
	if err != nil {
		return fmt.Errorf("write identity: %w", err)
	}
	if _, err := w.run.Run(ctx, "debugfs", "-w", "-f", script, fs); err != nil {
		return fmt.Errorf("write identity into %s: %w", req.GetTarget(), err)
	}
	for _, f := range files {
		got, err := w.run.Run(ctx, "debugfs", "-R", "cat "+f.path, fs)
		if err != nil {
			return fmt.Errorf("write identity: read back %s: %w", f.path, err)
		}
		if !bytes.Equal(got, f.data) {
			return errdefs.FailedPrecondition("write identity into %s: %s does not read back as written (%d bytes, want %d): is the image mounted or read-only?", req.GetTarget(), f.path, len(got), len(f.data))
		}
	}
	if err := syncTarget(req.GetTarget()); err != nil {
		return fmt.Errorf("write identity: %w", err)
	}
	w.log.Info("identity written into image", "target", req.GetTarget(), "host", req.GetHostname(), "offset", off)
	return nil
}

// ValidateNetworkConfig checks that config is the content of a
// systemd-networkd .network file, as WriteIdentity accepts it in
// network_config: "" (nothing to write), or at most MaxNetworkConfig bytes
// of UTF-8 text without control characters other than tab and newline
// (no NUL, no carriage return), parsing as a unit file (lines are blank,
// comments starting with '#' or ';', "[Section]" headers, or "Key=Value"
// inside a section; a line ending in a backslash continues on the next)
// with a [Match] and a [Network] section. Errors are InvalidArgument,
// naming the problem and its line.
func ValidateNetworkConfig(config string) error {
	if config == "" {
		return nil
	}
	bad := func(format string, args ...any) error {
		return errdefs.InvalidArgument("network_config: "+format, args...)
	}
	if len(config) > MaxNetworkConfig {
		return bad("%d bytes, at most %d allowed", len(config), MaxNetworkConfig)
	}
	if !utf8.ValidString(config) {
		return bad("not UTF-8 text")
	}
	sections := map[string]bool{}
	section := ""
	continued := false
	for i, line := range strings.Split(config, "\n") {
		n := i + 1
		for _, r := range line {
			if r == '\t' {
				continue
			}
			if unicode.IsControl(r) {
				return bad("line %d: control character %U (want a text .network file)", n, r)
			}
		}
		cont := continued
		continued = strings.HasSuffix(line, "\\")
		if cont {
			continue // a continuation of the previous line's value
		}
		t := strings.TrimSpace(line)
		switch {
		case t == "" || t[0] == '#' || t[0] == ';':
			continued = false // comments do not continue
		case t[0] == '[':
			if !strings.HasSuffix(t, "]") || len(t) < 3 || strings.ContainsAny(t[1:len(t)-1], "[]") {
				return bad("line %d: malformed section header %q", n, clip(t))
			}
			section = t[1 : len(t)-1]
			sections[section] = true
			continued = false
		default:
			key, _, ok := strings.Cut(t, "=")
			if !ok || strings.TrimSpace(key) == "" {
				return bad("line %d: want \"[Section]\" or \"Key=Value\", got %q", n, clip(t))
			}
			if section == "" {
				return bad("line %d: %q before any section", n, clip(strings.TrimSpace(key)))
			}
		}
	}
	var missing []string
	for _, s := range []string{"Match", "Network"} {
		if !sections[s] {
			missing = append(missing, "["+s+"]")
		}
	}
	if len(missing) > 0 {
		return bad("no %s section (want a systemd-networkd .network file)", strings.Join(missing, " or "))
	}
	return nil
}

// clip shortens s for an error message.
func clip(s string) string {
	const max = 64
	if len(s) <= max {
		return s
	}
	for i := max; i > 0; i-- {
		if utf8.RuneStart(s[i]) {
			return s[:i] + "..."
		}
	}
	return s[:max] + "..."
}

// missingDirs returns the parent directories of files that the image
// lacks, parents first. debugfs's mkdir of an existing directory leaks an
// inode and a block (e2fsck then finds errors), so only these are made.
func (w *Writer) missingDirs(ctx context.Context, fs string, files []file) ([]string, error) {
	seen := map[string]bool{"/": true}
	var dirs []string
	var add func(d string)
	add = func(d string) {
		if seen[d] {
			return
		}
		add(path.Dir(d))
		seen[d] = true
		dirs = append(dirs, d)
	}
	for _, f := range files {
		add(path.Dir(f.path))
	}
	var missing []string
	for _, d := range dirs {
		out, err := w.run.Run(ctx, "debugfs", "-R", "stat "+d, fs)
		if err != nil {
			return nil, fmt.Errorf("stat %s: %w", d, err)
		}
		switch typ := inodeType(string(out)); typ {
		case "":
			missing = append(missing, d)
		case "directory":
		default:
			return nil, errdefs.FailedPrecondition("%s in the image is a %s, not a directory", d, typ)
		}
	}
	return missing, nil
}

// inodeType reads "Type: directory" from debugfs's stat output; "" when
// the path does not exist (debugfs then prints nothing on stdout).
func inodeType(stat string) string {
	_, rest, ok := strings.Cut(stat, "Type: ")
	if !ok {
		return ""
	}
	if f := strings.Fields(rest); len(f) > 0 {
		return f[0]
	}
	return ""
}

// script stages the files under dir with their modes (debugfs copies the
// mode of the local file) and returns the path of a debugfs command file
// that creates the missing directories, makes the data directory 0700 and
// replaces each file, owned by root.
func (w *Writer) script(dir string, mkdirs []string, files []file) (string, error) {
	var b strings.Builder
	for _, d := range mkdirs {
		fmt.Fprintf(&b, "mkdir %s\n", d)
	}
	fmt.Fprintf(&b, "set_inode_field %s mode 040700\n", DataDir)
	for i, f := range files {
		local := filepath.Join(dir, "f"+strconv.Itoa(i))
		if err := os.WriteFile(local, f.data, f.mode); err != nil {
			return "", err
		}
		if err := os.Chmod(local, f.mode); err != nil { // past the umask
			return "", err
		}
		fmt.Fprintf(&b, "rm %s\nwrite %s %s\n", f.path, local, f.path)                          // rm of a missing file is only a message
		fmt.Fprintf(&b, "set_inode_field %s uid 0\nset_inode_field %s gid 0\n", f.path, f.path) // root-owned, whoever runs debugfs
	}
	script := filepath.Join(dir, "debugfs.cmds")
	return script, os.WriteFile(script, []byte(b.String()), 0o600)
}

// GPT partition type GUIDs (as printed; stored mixed-endian).
const (
	TypeRootX86_64 = "4f68bce3-e8cd-4db1-96e7-fbcaf984b709"
	TypeRootARM64  = "b921b045-1df0-41c3-af44-4c6f280d3fae"
	TypeLinuxData  = "0fc63daf-8483-4772-8e79-3d69d8477de4"
)

// RootOffset returns the byte offset of the root filesystem on target: the
// start of the GPT root partition, or 0 when target is a bare ext4
// filesystem. Errors: NotFound for a missing target, FailedPrecondition when
// there is no root filesystem to find.
func RootOffset(target string) (int64, error) {
	f, err := os.Open(target)
	if os.IsNotExist(err) {
		return 0, errdefs.NotFound("target %s does not exist", target)
	}
	if err != nil {
		return 0, err
	}
	defer f.Close()
	head := make([]byte, 8192)
	n, err := io.ReadFull(f, head)
	if err != nil && err != io.ErrUnexpectedEOF {
		return 0, fmt.Errorf("read %s: %w", target, err)
	}
	head = head[:n]
	if len(head) >= 1082 && binary.LittleEndian.Uint16(head[1080:]) == 0xEF53 {
		return 0, nil // ext4 superblock magic at 1024+56: a bare filesystem
	}
	for _, sector := range []int64{512, 4096} {
		if int64(len(head)) < sector+92 || string(head[sector:sector+8]) != "EFI PART" {
			continue
		}
		hdr := head[sector:]
		entriesLBA := int64(binary.LittleEndian.Uint64(hdr[72:]))
		count := int64(binary.LittleEndian.Uint32(hdr[80:]))
		size := int64(binary.LittleEndian.Uint32(hdr[84:]))
		if size < 128 || count <= 0 || count > 1024 {
			return 0, errdefs.FailedPrecondition("%s: malformed GPT header", target)
		}
		entries := make([]byte, count*size)
		if _, err := f.ReadAt(entries, entriesLBA*sector); err != nil {
			return 0, fmt.Errorf("read GPT entries of %s: %w", target, err)
		}
		var root, data []int64
		for i := int64(0); i < count; i++ {
			e := entries[i*size : (i+1)*size]
			first := int64(binary.LittleEndian.Uint64(e[32:]))
			switch guid(e[:16]) {
			case TypeRootX86_64, TypeRootARM64:
				root = append(root, first*sector)
			case TypeLinuxData:
				data = append(data, first*sector)
			}
		}
		switch {
		case len(root) == 1:
			return root[0], nil
		case len(root) == 0 && len(data) == 1:
			return data[0], nil
		}
		return 0, errdefs.FailedPrecondition("%s: want one root partition (type %s), found %d root and %d Linux data partitions", target, TypeRootX86_64, len(root), len(data))
	}
	return 0, errdefs.FailedPrecondition("%s holds neither a GPT nor an ext4 filesystem: lay an image first", target)
}

// guid formats a mixed-endian on-disk GUID.
func guid(b []byte) string {
	return fmt.Sprintf("%08x-%04x-%04x-%x-%x",
		binary.LittleEndian.Uint32(b[0:]), binary.LittleEndian.Uint16(b[4:]), binary.LittleEndian.Uint16(b[6:]), b[8:10], b[10:16])
}

func syncTarget(target string) error {
	f, err := os.OpenFile(target, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
