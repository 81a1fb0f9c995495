// Package seal encrypts secrets at rest (BMC passwords, the CA key) with
// AES-256-GCM under a 32-byte key kept in a file on the controller, so the
// store never sees plaintext.
//
// A sealed value is: one version byte, a 12-byte random nonce, then the GCM
// ciphertext and tag. The caller's additional data (aad), which the store
// sets to the value's key path, is authenticated with it: a sealed value
// copied to another path, or altered in any byte, does not open.
package seal

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// KeySize is the size of a sealing key in bytes (AES-256).
const KeySize = 32

// version1 is the format byte of values sealed with AES-256-GCM, a 12-byte
// nonce and a 16-byte tag.
const version1 byte = 1

// Sealer seals and opens values under one key. It is safe for concurrent use.
type Sealer struct {
	aead cipher.AEAD
}

// New returns a Sealer for a 32-byte key. It returns InvalidArgument for a
// key of another size.
func New(key []byte) (*Sealer, error) {
	if len(key) != KeySize {
		return nil, errdefs.InvalidArgument("sealing key is %d bytes, want %d", len(key), KeySize)
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("sealing key: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("sealing key: %w", err)
	}
	return &Sealer{aead: aead}, nil
}

// LoadOrCreateKey reads the sealing key at path, or creates it (32 random
// bytes, mode 0600, parent directories 0700) when the file does not exist.
//
// It refuses, with a FailedPrecondition error, a key file that is not a
// regular file, that is readable or writable by group or others, or whose
// size is not 32 bytes: a truncated or foreign file must not silently become
// a new key, which would make every stored secret unreadable.
func LoadOrCreateKey(path string) (*Sealer, error) {
	key, err := readKey(path)
	if errors.Is(err, fs.ErrNotExist) {
		key, err = createKey(path)
		if errors.Is(err, fs.ErrExist) { // Lost a race with another creator.
			key, err = readKey(path)
		}
	}
	if err != nil {
		return nil, err
	}
	return New(key)
}

func readKey(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		return nil, fmt.Errorf("sealing key %s: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("sealing key %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, errdefs.FailedPrecondition("sealing key %s: not a regular file (%v)", path, fi.Mode().Type())
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, errdefs.FailedPrecondition("sealing key %s: mode %04o gives access to group or others; run chmod 600 %s", path, perm, path)
	}
	if fi.Size() != KeySize {
		return nil, errdefs.FailedPrecondition("sealing key %s: file is %d bytes, want %d (wrong or damaged key file; restore it from backup)", path, fi.Size(), KeySize)
	}
	key := make([]byte, KeySize)
	if _, err := io.ReadFull(f, key); err != nil {
		return nil, fmt.Errorf("sealing key %s: read: %w", path, err)
	}
	return key, nil
}

// ReadKeyFile returns the key in the sealing key file at path, with the
// checks LoadOrCreateKey makes (a regular file, mode 0600, 32 bytes).
func ReadKeyFile(path string) ([]byte, error) { return readKey(path) }

// WriteKeyFile writes key as a new sealing key file at path (mode 0600,
// parent directories 0700), atomically. It refuses, with fs.ErrExist, to
// replace a file that is there: a key is never overwritten.
func WriteKeyFile(path string, key []byte) error {
	if len(key) != KeySize {
		return errdefs.InvalidArgument("sealing key is %d bytes, want %d", len(key), KeySize)
	}
	_, err := writeKey(path, key)
	return err
}

func createKey(path string) ([]byte, error) {
	key := make([]byte, KeySize)
	if _, err := rand.Read(key); err != nil {
		return nil, fmt.Errorf("sealing key %s: random: %w", path, err)
	}
	return writeKey(path, key)
}

func writeKey(path string, key []byte) ([]byte, error) {
	// Written whole and linked into place (not renamed), so a crash never
	// leaves a short key file behind and a concurrent creator loses cleanly.
	if err := atomicfile.Write(path, key, 0o600, atomicfile.NoReplace(), atomicfile.MkdirAll(0o700)); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, err
		}
		return nil, fmt.Errorf("sealing key %s: %w", path, err)
	}
	return key, nil
}

// Seal encrypts plaintext, binding it to aad (which is not stored).
func (s *Sealer) Seal(plaintext, aad []byte) ([]byte, error) {
	ns := s.aead.NonceSize()
	out := make([]byte, 1+ns, 1+ns+len(plaintext)+s.aead.Overhead())
	out[0] = version1
	if _, err := rand.Read(out[1 : 1+ns]); err != nil {
		return nil, fmt.Errorf("seal: nonce: %w", err)
	}
	return s.aead.Seal(out, out[1:1+ns], plaintext, s.additional(aad)), nil
}

// Open decrypts a value made by Seal with the same key and aad. It returns
// an InvalidArgument error for an unknown format and a PermissionDenied
// error when the value does not authenticate: it was altered, sealed under
// another key, or sealed with another aad (moved to another path).
func (s *Sealer) Open(sealed, aad []byte) ([]byte, error) {
	ns := s.aead.NonceSize()
	if len(sealed) == 0 {
		return nil, errdefs.InvalidArgument("open sealed value: empty")
	}
	if sealed[0] != version1 {
		return nil, errdefs.InvalidArgument("open sealed value: unknown format version %d", sealed[0])
	}
	if len(sealed) < 1+ns+s.aead.Overhead() {
		return nil, errdefs.InvalidArgument("open sealed value: %d bytes is too short", len(sealed))
	}
	pt, err := s.aead.Open(nil, sealed[1:1+ns], sealed[1+ns:], s.additional(aad))
	if err != nil {
		return nil, errdefs.PermissionDenied("open sealed value: does not authenticate (tampered, wrong key, or moved from another path)")
	}
	return pt, nil
}

// additional authenticates the version byte together with the caller's aad.
func (s *Sealer) additional(aad []byte) []byte {
	return append([]byte{version1}, aad...)
}
