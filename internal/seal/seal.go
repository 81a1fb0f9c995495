// Package seal encrypts secrets at rest (BMC passwords, the CA key) with
// AES-256-GCM under a 32-byte key kept in a file on the controller, so the
// store never sees plaintext.
//
// A sealed value is: one version byte (2), the 4-byte id of the key it is
// sealed under (KeyID), a 12-byte random nonce, then the GCM ciphertext and
// tag. Values of version 1 (no key id) are still opened. The caller's
// additional data (aad), which the store sets to the value's key path, is
// authenticated with the header: a sealed value copied to another path, or
// altered in any byte, does not open.
//
// A Sealer holds a key ring: the current key seals, every key opens. The
// ring is the key file and, while a rotation is under way, the files next
// to it (rotate.go).
package seal

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"sync"

	"github.com/kilnhq/kiln/internal/atomicfile"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// KeySize is the size of a sealing key in bytes (AES-256).
const KeySize = 32

// Format version bytes. Version 1 (AES-256-GCM, 12-byte nonce, 16-byte
// tag) names no key: it is what controllers before key rotation wrote, and
// it opens under whichever key of the ring authenticates it. Version 2 is
// the same cipher with the 4-byte id of the sealing key after the version
// byte, so a ring of several keys opens it with the right one and a
// rotation can tell what is left to re-seal.
const (
	version1 byte = 1
	version2 byte = 2
)

// idSize is the size of a key id in a version-2 value.
const idSize = 4

// KeyID names a key without revealing it: the first 4 bytes of
// SHA-256("kiln seal key id\x00" || key), in hex. It is what version-2
// values carry and what rotation reports and audits.
type KeyID [idSize]byte

func (id KeyID) String() string { return hex.EncodeToString(id[:]) }

// IDOf returns the id of a key.
func IDOf(key []byte) KeyID {
	h := sha256.New()
	h.Write([]byte("kiln seal key id\x00"))
	h.Write(key)
	var id KeyID
	copy(id[:], h.Sum(nil))
	return id
}

// ring is a set of keys: one seals, all open.
type ring struct {
	current KeyID
	aeads   map[KeyID]cipher.AEAD
	order   []KeyID // current first, for version-1 values
}

func newRing(current []byte, others ...[]byte) (*ring, error) {
	r := &ring{aeads: map[KeyID]cipher.AEAD{}}
	digests := map[KeyID][sha256.Size]byte{}
	for i, key := range append([][]byte{current}, others...) {
		if len(key) != KeySize {
			return nil, errdefs.InvalidArgument("sealing key is %d bytes, want %d", len(key), KeySize)
		}
		id, digest := IDOf(key), sha256.Sum256(key)
		if d, dup := digests[id]; dup {
			if d != digest {
				return nil, errdefs.FailedPrecondition("two sealing keys share the id %s: finish or undo the rotation with one of them", id)
			}
			continue // The same key twice (a retried rotation step).
		}
		digests[id] = digest
		block, err := aes.NewCipher(key)
		if err != nil {
			return nil, fmt.Errorf("sealing key: %w", err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, fmt.Errorf("sealing key: %w", err)
		}
		if i == 0 {
			r.current = id
		}
		r.aeads[id] = aead
		r.order = append(r.order, id)
	}
	return r, nil
}

// Sealer seals values under its current key and opens values sealed under
// any key of its ring. It is safe for concurrent use.
//
// A Sealer made by LoadOrCreateKey follows its key files: before each Seal
// it re-reads them (so a rotation switched on disk is sealed under at once)
// and an Open of a value under a key it does not hold re-reads them before
// it gives up (so a new key another controller already seals with opens).
type Sealer struct {
	mu   sync.RWMutex
	ring *ring
	// path is the key file a LoadOrCreateKey Sealer follows; "" for a
	// fixed ring.
	path string
}

// New returns a Sealer for a 32-byte key. It returns InvalidArgument for a
// key of another size.
func New(key []byte) (*Sealer, error) { return NewRing(key) }

// NewRing returns a Sealer that seals under current and opens values
// sealed under current or any of others. It returns InvalidArgument for a
// key that is not 32 bytes.
func NewRing(current []byte, others ...[]byte) (*Sealer, error) {
	r, err := newRing(current, others...)
	if err != nil {
		return nil, err
	}
	return &Sealer{ring: r}, nil
}

// CurrentID returns the id of the key Seal uses.
func (s *Sealer) CurrentID() KeyID {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.ring.current
}

// SealedWith returns the id of the key a version-2 value was sealed under;
// ok is false for a version-1 value (which names no key). It returns
// InvalidArgument for a value that is not sealed.
func SealedWith(sealed []byte) (id KeyID, ok bool, err error) {
	if len(sealed) == 0 {
		return id, false, errdefs.InvalidArgument("sealed value: empty")
	}
	switch sealed[0] {
	case version1:
		return id, false, nil
	case version2:
		if len(sealed) < 1+idSize {
			return id, false, errdefs.InvalidArgument("sealed value: %d bytes is too short", len(sealed))
		}
		copy(id[:], sealed[1:1+idSize])
		return id, true, nil
	}
	return id, false, errdefs.InvalidArgument("sealed value: unknown format version %d", sealed[0])
}

// LoadOrCreateKey reads the sealing key at path, or creates it (32 random
// bytes, mode 0600, parent directories 0700) when the file does not exist.
// The key ring also holds the keys of a rotation under way, path+".next"
// and path+".prev" (see Rotation), and the Sealer follows the three files
// (Sealer).
//
// It refuses, with a FailedPrecondition error, a key file that is not a
// regular file, that is readable or writable by group or others, or whose
// size is not 32 bytes: a truncated or foreign file must not silently become
// a new key, which would make every stored secret unreadable.
func LoadOrCreateKey(path string) (*Sealer, error) {
	_, err := readKey(path)
	if errors.Is(err, fs.ErrNotExist) {
		_, err = createKey(path)
		if errors.Is(err, fs.ErrExist) { // Lost a race with another creator.
			_, err = readKey(path)
		}
	}
	if err != nil {
		return nil, err
	}
	s := &Sealer{path: path}
	if err := s.reload(); err != nil {
		return nil, err
	}
	return s, nil
}

// LoadKeyRing returns a Sealer over the key file at path and the keys of a
// rotation under way next to it, like LoadOrCreateKey, but it never creates
// a key: a missing key file is a FailedPrecondition error.
func LoadKeyRing(path string) (*Sealer, error) {
	if _, err := readKey(path); errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.FailedPrecondition("sealing key %s does not exist (check --secret-key-file; start the controller once first)", path)
	} else if err != nil {
		return nil, err
	}
	s := &Sealer{path: path}
	if err := s.reload(); err != nil {
		return nil, err
	}
	return s, nil
}

// reload reads the key files again and replaces the ring when they
// changed.
func (s *Sealer) reload() error {
	current, err := readKey(s.path)
	if err != nil {
		return err
	}
	var others [][]byte
	for _, p := range []string{NextPath(s.path), PrevPath(s.path)} {
		k, err := readKey(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		others = append(others, k)
	}
	want := []KeyID{IDOf(current)}
	for _, k := range others {
		want = append(want, IDOf(k))
	}
	s.mu.RLock()
	same := s.ring != nil && sameIDs(s.ring, want)
	s.mu.RUnlock()
	if same {
		return nil
	}
	r, err := newRing(current, others...)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.ring = r
	s.mu.Unlock()
	return nil
}

func sameIDs(r *ring, ids []KeyID) bool {
	if r.current != ids[0] {
		return false
	}
	seen := map[KeyID]bool{}
	for _, id := range ids {
		if _, ok := r.aeads[id]; !ok {
			return false
		}
		seen[id] = true
	}
	return len(seen) == len(r.aeads)
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

func createKey(path string, avoid ...KeyID) ([]byte, error) {
	key := make([]byte, KeySize)
	for {
		if _, err := rand.Read(key); err != nil {
			return nil, fmt.Errorf("sealing key %s: random: %w", path, err)
		}
		// A key whose id is another's would be taken for it.
		if id := IDOf(key); !slices.Contains(avoid, id) {
			break
		}
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

// Seal encrypts plaintext under the current key, binding it to aad (which
// is not stored). A Sealer that follows key files re-reads them first and
// returns their error (a damaged or unreadable key file) rather than seal
// under a key the files no longer name.
func (s *Sealer) Seal(plaintext, aad []byte) ([]byte, error) {
	if s.path != "" {
		if err := s.reload(); err != nil {
			return nil, fmt.Errorf("seal: %w", err)
		}
	}
	s.mu.RLock()
	r := s.ring
	s.mu.RUnlock()
	aead := r.aeads[r.current]
	ns := aead.NonceSize()
	hdr := 1 + idSize
	out := make([]byte, hdr+ns, hdr+ns+len(plaintext)+aead.Overhead())
	out[0] = version2
	copy(out[1:hdr], r.current[:])
	if _, err := rand.Read(out[hdr : hdr+ns]); err != nil {
		return nil, fmt.Errorf("seal: nonce: %w", err)
	}
	return aead.Seal(out, out[hdr:hdr+ns], plaintext, additional(out[:hdr], aad)), nil
}

// Open decrypts a value made by Seal under a key of the ring with the same
// aad. It returns an InvalidArgument error for an unknown format and a
// PermissionDenied error when the value does not authenticate: it was
// altered, sealed under a key the ring does not hold, or sealed with
// another aad (moved to another path).
func (s *Sealer) Open(sealed, aad []byte) ([]byte, error) {
	pt, err := s.open(sealed, aad)
	if errdefs.IsPermissionDenied(err) && s.path != "" {
		// A key another controller added since: re-read the files once.
		if s.reload() == nil {
			return s.open(sealed, aad)
		}
	}
	return pt, err
}

func (s *Sealer) open(sealed, aad []byte) ([]byte, error) {
	s.mu.RLock()
	r := s.ring
	s.mu.RUnlock()
	id, named, err := SealedWith(sealed)
	if err != nil {
		return nil, fmt.Errorf("open %w", err)
	}
	const ns, overhead = 12, 16
	if !named {
		if len(sealed) < 1+ns+overhead {
			return nil, errdefs.InvalidArgument("open sealed value: %d bytes is too short", len(sealed))
		}
		for _, k := range r.order {
			if pt, err := r.aeads[k].Open(nil, sealed[1:1+ns], sealed[1+ns:], additional(sealed[:1], aad)); err == nil {
				return pt, nil
			}
		}
		return nil, errdefs.PermissionDenied("open sealed value: does not authenticate (tampered, wrong key, or moved from another path)")
	}
	hdr := 1 + idSize
	if len(sealed) < hdr+ns+overhead {
		return nil, errdefs.InvalidArgument("open sealed value: %d bytes is too short", len(sealed))
	}
	aead, ok := r.aeads[id]
	if !ok {
		return nil, errdefs.PermissionDenied("open sealed value: sealed under key %s, which this controller's key files do not hold (a key retired too early, or another controller's key file)", id)
	}
	pt, err := aead.Open(nil, sealed[hdr:hdr+ns], sealed[hdr+ns:], additional(sealed[:hdr], aad))
	if err != nil {
		return nil, errdefs.PermissionDenied("open sealed value: does not authenticate (tampered, wrong key, or moved from another path)")
	}
	return pt, nil
}

// additional authenticates the value's header (version byte, and key id
// for version 2) together with the caller's aad.
func additional(hdr, aad []byte) []byte {
	return append(bytes.Clone(hdr), aad...)
}
