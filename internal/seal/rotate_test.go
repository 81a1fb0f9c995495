package seal

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/seal/sealtest"

	"github.com/kilnhq/kiln/internal/errdefs"
)

func TestVersion1ValuesStillOpen(t *testing.T) {
	oldKey := bytes.Repeat([]byte{1}, KeySize)
	newKey := bytes.Repeat([]byte{2}, KeySize)
	aad := []byte("/kiln/v1/secrets/bmc/rack1-01")
	v1 := sealtest.SealV1(t, oldKey, []byte("hunter2"), aad)

	for _, tt := range []struct {
		name string
		keys [][]byte
		ok   bool
	}{
		{"the key alone", [][]byte{oldKey}, true},
		{"as the previous key of a ring", [][]byte{newKey, oldKey}, true},
		{"another key", [][]byte{newKey}, false},
	} {
		s, err := NewRing(tt.keys[0], tt.keys[1:]...)
		require.NoError(t, err)
		pt, err := s.Open(v1, aad)
		if tt.ok && (err != nil || string(pt) != "hunter2") {
			t.Errorf("Open(version 1, %s) = %q, %v, want hunter2", tt.name, pt, err)
		}
		if !tt.ok && !errdefs.IsPermissionDenied(err) {
			t.Errorf("Open(version 1, %s) = %v, want PermissionDenied", tt.name, err)
		}
	}
	if _, named, err := SealedWith(v1); err != nil || named {
		t.Errorf("SealedWith(version 1) = named %v, %v; want unnamed", named, err)
	}
}

func TestRingSealsUnderCurrentOpensAll(t *testing.T) {
	a := bytes.Repeat([]byte{1}, KeySize)
	b := bytes.Repeat([]byte{2}, KeySize)
	aad := []byte("/kiln/v1/secrets/ca/key")
	onlyA, err := New(a)
	require.NoError(t, err)
	underA, err := onlyA.Seal([]byte("x"), aad)
	require.NoError(t, err)
	ring, err := NewRing(b, a)
	require.NoError(t, err)
	underB, err := ring.Seal([]byte("y"), aad)
	require.NoError(t, err)

	if id, named, err := SealedWith(underB); err != nil || !named || id != IDOf(b) || ring.CurrentID() != IDOf(b) {
		t.Errorf("SealedWith(ring.Seal()) = %v, %v, %v; want the current key %v", id, named, err, IDOf(b))
	}
	if pt, err := ring.Open(underA, aad); err != nil || string(pt) != "x" {
		t.Errorf("ring.Open(sealed under the previous key) = %q, %v; want x", pt, err)
	}
	_, err = onlyA.Open(underB, aad)
	if !errdefs.IsPermissionDenied(err) {
		t.Errorf("Open(sealed under a key not held) = %v, want PermissionDenied", err)
	}
	// The error names the key by id, never by value.
	if bytes.Contains([]byte(err.Error()), b) || !bytes.Contains([]byte(err.Error()), []byte(IDOf(b).String())) {
		t.Errorf("Open error %q: want the key id %s and not the key", err, IDOf(b))
	}
	// The key id is authenticated: relabelled, the value does not open.
	relabel := bytes.Clone(underB)
	copy(relabel[1:5], IDOf(a).String())
	if _, err := ring.Open(relabel, aad); err == nil {
		t.Error("Open(value with its key id changed) = nil error, want an error")
	}
}

// TestRotationFilesStayOpenable walks the key files through a rotation,
// checking at every step (which is also where a crash would leave them)
// that a controller loading the files opens values sealed under either
// key, and that a running Sealer follows the files.
func TestRotationFilesStayOpenable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "secret.key")
	running, err := LoadOrCreateKey(path)
	require.NoError(t, err)
	oldID := running.CurrentID()
	aad := []byte("/kiln/v1/secrets/bmc/h1")
	underOld, err := running.Seal([]byte("old"), aad)
	require.NoError(t, err)

	opens := func(step string, values ...[]byte) {
		t.Helper()
		fresh, err := LoadKeyRing(path)
		require.NoError(t, err, step)
		for i, v := range values {
			if _, err := fresh.Open(v, aad); err != nil {
				t.Errorf("%s: a controller started now cannot open value %d: %v", step, i, err)
			}
			if _, err := running.Open(v, aad); err != nil {
				t.Errorf("%s: the running controller cannot open value %d: %v", step, i, err)
			}
		}
	}

	st, err := ReadRotation(path)
	require.NoError(t, err)
	require.Equal(t, Idle, st)
	require.True(t, errdefs.IsFailedPrecondition(Switch(path)), "Switch(idle)")

	newID, created, err := Prepare(path)
	require.NoError(t, err)
	require.True(t, created)
	again, created, err := Prepare(path) // A re-run keeps the key.
	require.NoError(t, err)
	if created || again != newID {
		t.Errorf("Prepare() again = %v, created %v; want %v kept", again, created, newID)
	}
	fi, err := os.Stat(NextPath(path))
	require.NoError(t, err)
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("%s mode %04o, want 0600", NextPath(path), fi.Mode().Perm())
	}
	st, _ = ReadRotation(path)
	require.Equal(t, Prepared, st)
	opens("prepared", underOld)
	if v, err := running.Seal([]byte("x"), aad); err != nil {
		t.Fatal(err)
	} else if id, _, _ := SealedWith(v); id != oldID {
		t.Errorf("prepared: Seal() under %v, want the old key %v (the new one seals only after the switch)", id, oldID)
	}

	// A crash inside Switch: KEY.prev linked, KEY.next not renamed yet.
	require.NoError(t, os.Link(path, PrevPath(path)))
	st, err = ReadRotation(path)
	require.NoError(t, err)
	require.Equal(t, Prepared, st, "interrupted switch")
	opens("interrupted switch", underOld)

	require.NoError(t, Switch(path))
	require.NoError(t, Switch(path)) // Idempotent.
	st, _ = ReadRotation(path)
	require.Equal(t, Switched, st)
	underNew, err := running.Seal([]byte("new"), aad)
	require.NoError(t, err)
	if id, _, _ := SealedWith(underNew); id != newID {
		t.Errorf("switched: the running Sealer seals under %v, want the new key %v", id, newID)
	}
	opens("switched", underOld, underNew)
	require.True(t, errdefs.IsFailedPrecondition(func() error { _, _, err := Prepare(path); return err }()), "Prepare(switched)")

	require.NoError(t, Retire(path))
	require.NoError(t, Retire(path))
	st, _ = ReadRotation(path)
	require.Equal(t, Idle, st)
	opens("retired", underNew)
	fresh, err := LoadKeyRing(path)
	require.NoError(t, err)
	if _, err := fresh.Open(underOld, aad); !errdefs.IsPermissionDenied(err) {
		t.Errorf("retired: Open(sealed under the retired key) = %v, want PermissionDenied", err)
	}
	entries, err := os.ReadDir(filepath.Dir(path))
	require.NoError(t, err)
	if len(entries) != 1 {
		t.Errorf("key directory holds %d entries after the rotation, want only the key", len(entries))
	}
}

func TestReadRotationRefusesForeignFiles(t *testing.T) {
	path := filepath.Join(t.TempDir(), "secret.key")
	_, err := LoadOrCreateKey(path)
	require.NoError(t, err)
	require.NoError(t, WriteKeyFile(NextPath(path), bytes.Repeat([]byte{3}, KeySize)))
	require.NoError(t, WriteKeyFile(PrevPath(path), bytes.Repeat([]byte{4}, KeySize)))
	if _, err := ReadRotation(path); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("ReadRotation(next and prev, key neither) = %v, want FailedPrecondition", err)
	}
	require.NoError(t, os.Chmod(NextPath(path), 0o644))
	if _, err := LoadKeyRing(path); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("LoadKeyRing(world-readable next key) = %v, want FailedPrecondition", err)
	}
}
