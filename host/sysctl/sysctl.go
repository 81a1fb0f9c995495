// Package sysctl reads and writes kernel parameters through /proc/sys under
// a root, and persists them in ROOT/etc/sysctl.d/99-kiln.conf so that they
// survive a reboot.
//
// Parameters under net/ belong to the network namespace of the thread that
// opens the file; callers that work in another namespace must run on a
// locked OS thread inside it.
package sysctl

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// PersistFile is where Persist writes, relative to the root.
const PersistFile = "etc/sysctl.d/99-kiln.conf"

// Path returns the /proc/sys file of key under root:
// "net.ipv4.ip_forward" → ROOT/proc/sys/net/ipv4/ip_forward.
func Path(root, key string) string {
	return filepath.Join(root, "proc/sys", strings.ReplaceAll(key, ".", "/"))
}

// Get returns the value of key, trimmed.
//
// Equivalent to: `sysctl -n net.ipv4.ip_forward`.
//
// It returns a NotFound error when the kernel has no such parameter (for
// net.bridge.*: br_netfilter is not loaded).
func Get(root, key string) (string, error) {
	b, err := os.ReadFile(Path(root, key))
	if errors.Is(err, fs.ErrNotExist) {
		return "", errdefs.NotFound("sysctl %s: no such parameter", key)
	}
	if err != nil {
		return "", fmt.Errorf("sysctl %s: %w", key, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// Set writes value to key.
//
// Equivalent to: `sysctl -w net.ipv4.ip_forward=1`.
//
// It returns a NotFound error when the kernel has no such parameter and a
// PermissionDenied error when /proc/sys is read-only to the caller.
func Set(root, key, value string) error {
	f, err := os.OpenFile(Path(root, key), os.O_WRONLY|os.O_TRUNC, 0)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errdefs.NotFound("sysctl %s: no such parameter", key)
	case errors.Is(err, fs.ErrPermission):
		return errdefs.PermissionDenied("sysctl %s: %v", key, err)
	case err != nil:
		return fmt.Errorf("sysctl %s: %w", key, err)
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("sysctl -w %s=%s: %w", key, value, err)
	}
	return nil
}

// Persisted returns the settings in ROOT/etc/sysctl.d/99-kiln.conf; a
// missing file is an empty map.
func Persisted(root string) (map[string]string, error) {
	b, err := os.ReadFile(filepath.Join(root, PersistFile))
	if errors.Is(err, fs.ErrNotExist) {
		return map[string]string{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", PersistFile, err)
	}
	return Parse(string(b)), nil
}

// Parse parses sysctl.conf(5) lines: "key = value", comments with # or ;.
func Parse(data string) map[string]string {
	m := map[string]string{}
	for line := range strings.Lines(data) {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			continue
		}
		k = strings.TrimPrefix(strings.TrimSpace(k), "-")
		m[strings.ReplaceAll(k, "/", ".")] = strings.TrimSpace(v)
	}
	return m
}

// Persist merges values into ROOT/etc/sysctl.d/99-kiln.conf (keys already
// there and not in values are kept) and reports whether the file changed.
// The file is replaced atomically; it is not rewritten when nothing changes.
//
// Equivalent to: `echo net.ipv4.ip_forward=1 >> /etc/sysctl.d/99-kiln.conf`.
func Persist(root string, values map[string]string) (changed bool, err error) {
	path := filepath.Join(root, PersistFile)
	old, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("read %s: %w", PersistFile, err)
	}
	merged := Parse(string(old))
	maps.Copy(merged, values)
	var b bytes.Buffer
	b.WriteString("# Written by kiln-agent (Prepare): settings Kubernetes needs.\n")
	for _, k := range slices.Sorted(maps.Keys(merged)) {
		fmt.Fprintf(&b, "%s = %s\n", k, merged[k])
	}
	if bytes.Equal(old, b.Bytes()) {
		return false, nil
	}
	if err := atomicfile.Write(path, b.Bytes(), 0o644, atomicfile.MkdirAll(0o755)); err != nil {
		return false, err
	}
	return true, nil
}
