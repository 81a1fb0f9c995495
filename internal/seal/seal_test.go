package seal

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
)

func TestLoadOrCreateKeyCreatesThenReloads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys", "seal.key")
	s1, err := LoadOrCreateKey(path)
	require.NoError(t, err)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	if fi.Mode().Perm() != 0o600 || fi.Size() != KeySize {
		t.Errorf("key file mode %04o size %d, want 0600 and %d", fi.Mode().Perm(), fi.Size(), KeySize)
	}
	sealed, err := s1.Seal([]byte("hunter2"), []byte("/kiln/v1/secrets/bmc/rack1-01"))
	require.NoError(t, err)

	// A restart reads the same key and opens what the first run sealed.
	s2, err := LoadOrCreateKey(path)
	require.NoError(t, err)
	pt, err := s2.Open(sealed, []byte("/kiln/v1/secrets/bmc/rack1-01"))
	require.NoError(t, err)
	if string(pt) != "hunter2" {
		t.Errorf("Open(Seal(%q)) = %q, want %q", "hunter2", pt, "hunter2")
	}
	entries, err := os.ReadDir(filepath.Dir(path))
	require.NoError(t, err)
	if len(entries) != 1 {
		t.Errorf("key directory holds %d entries, want only the key (temporary file left behind?)", len(entries))
	}
}

func TestLoadOrCreateKeyRefuses(t *testing.T) {
	tests := []struct {
		name    string
		content []byte
		mode    os.FileMode
	}{
		{"group readable", bytes.Repeat([]byte{1}, KeySize), 0o640},
		{"world readable", bytes.Repeat([]byte{1}, KeySize), 0o604},
		{"short", bytes.Repeat([]byte{1}, 16), 0o600},
		{"long", bytes.Repeat([]byte{1}, 33), 0o600},
		{"empty", nil, 0o600},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "seal.key")
			require.NoError(t, os.WriteFile(path, tt.content, tt.mode))
			require.NoError(t, os.Chmod(path, tt.mode))
			_, err := LoadOrCreateKey(path)
			if !errdefs.IsFailedPrecondition(err) {
				t.Errorf("LoadOrCreateKey(%s) = %v, want FailedPrecondition", tt.name, err)
			}
			// The refused file is left as it was: no silent new key.
			got, err := os.ReadFile(path)
			require.NoError(t, err)
			if !bytes.Equal(got, tt.content) {
				t.Errorf("LoadOrCreateKey(%s) changed the key file", tt.name)
			}
		})
	}
	t.Run("directory", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "seal.key")
		require.NoError(t, os.Mkdir(path, 0o700))
		if _, err := LoadOrCreateKey(path); !errdefs.IsFailedPrecondition(err) {
			t.Errorf("LoadOrCreateKey(directory) = %v, want FailedPrecondition", err)
		}
	})
}

func TestOpenRefusesTamperingAndMoves(t *testing.T) {
	s, err := LoadOrCreateKey(filepath.Join(t.TempDir(), "a.key"))
	require.NoError(t, err)
	other, err := LoadOrCreateKey(filepath.Join(t.TempDir(), "b.key"))
	require.NoError(t, err)
	aad := []byte("/kiln/v1/secrets/bmc/rack1-01")
	secret := []byte("correct horse battery staple")
	sealed, err := s.Seal(secret, aad)
	require.NoError(t, err)
	if bytes.Contains(sealed, secret) {
		t.Fatal("sealed value contains the plaintext")
	}
	again, err := s.Seal(secret, aad)
	require.NoError(t, err)
	if bytes.Equal(sealed, again) {
		t.Error("two seals of the same value are identical: nonce reused")
	}

	for i := range sealed {
		b := bytes.Clone(sealed)
		b[i] ^= 0x01
		if _, err := s.Open(b, aad); err == nil {
			t.Fatalf("Open(value with byte %d flipped) = nil error, want an error", i)
		}
	}
	tests := []struct {
		name   string
		sealer *Sealer
		value  []byte
		aad    []byte
		class  func(error) bool
	}{
		{"moved to another path", s, sealed, []byte("/kiln/v1/secrets/bmc/rack1-02"), errdefs.IsPermissionDenied},
		{"another key", other, sealed, aad, errdefs.IsPermissionDenied},
		{"truncated", s, sealed[:10], aad, errdefs.IsInvalidArgument},
		{"empty", s, nil, aad, errdefs.IsInvalidArgument},
		{"unknown version", s, append([]byte{9}, sealed[1:]...), aad, errdefs.IsInvalidArgument},
	}
	for _, tt := range tests {
		if _, err := tt.sealer.Open(tt.value, tt.aad); !tt.class(err) {
			t.Errorf("Open(%s) = %v, want error of the expected class", tt.name, err)
		}
	}
	pt, err := s.Open(sealed, aad)
	require.NoError(t, err)
	if !bytes.Equal(pt, secret) {
		t.Errorf("Open() = %q, want %q", pt, secret)
	}
}

func TestNewRejectsWrongKeySize(t *testing.T) {
	for _, n := range []int{0, 16, 31, 33} {
		if _, err := New(make([]byte, n)); !errdefs.IsInvalidArgument(err) {
			t.Errorf("New(%d-byte key) = %v, want InvalidArgument", n, err)
		}
	}
}

func BenchmarkSeal1KiB(b *testing.B) {
	s, err := New(bytes.Repeat([]byte{7}, KeySize))
	require.NoError(b, err)
	pt := make([]byte, 1024)
	aad := []byte("/kiln/v1/secrets/bmc/rack1-01")
	b.SetBytes(int64(len(pt)))
	for b.Loop() {
		if _, err := s.Seal(pt, aad); err != nil {
			b.Fatal(err)
		}
	}
}

// TestLoadOrCreateKeyConcurrentStarts checks that two processes starting
// at once on an empty directory end up with one and the same key.
func TestLoadOrCreateKeyConcurrentStarts(t *testing.T) {
	path := filepath.Join(t.TempDir(), "seal.key")
	const n = 8
	sealers := make([]*Sealer, n)
	errs := make([]error, n)
	done := make(chan int)
	for i := range n {
		go func() {
			sealers[i], errs[i] = LoadOrCreateKey(path)
			done <- i
		}()
	}
	for range n {
		<-done
	}
	for i := range n {
		require.NoError(t, errs[i], "starter %d", i)
	}
	sealed, err := sealers[0].Seal([]byte("x"), nil)
	require.NoError(t, err)
	for i := 1; i < n; i++ {
		if _, err := sealers[i].Open(sealed, nil); err != nil {
			t.Errorf("starter %d has a different key: Open() = %v", i, err)
		}
	}
}
