package store

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"math"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

// TestBackupRestoreIntoNewEtcd backs up a store, restores it into a fresh
// etcd and reads everything back, secrets included (same key file).
func TestBackupRestoreIntoNewEtcd(t *testing.T) {
	ctx := testCtx(t)
	keyFile := filepath.Join(t.TempDir(), "seal.key")
	sealer, err := seal.LoadOrCreateKey(keyFile)
	require.NoError(t, err)
	_, c1 := startEtcd(t)
	src := New(c1, WithSealer(sealer), WithLogger(testLogger(t)))

	want := map[string]*typesv1.Host{}
	for i := range 250 { // Several restore batches.
		name := "rack1-" + string(rune('a'+i%26)) + string(rune('a'+i/26))
		h := host(name, "52:54:00:00:00:01")
		want[name] = h
		_, err := src.Create(ctx, "hosts", name, h)
		require.NoError(t, err)
	}
	require.NoError(t, src.PutSecret(ctx, "bmc/rack1-aa", []byte("pw-aa")))
	require.NoError(t, src.PutSecret(ctx, "ca/key", []byte("-----BEGIN EC PRIVATE KEY-----...")))
	_, err = c1.Put(ctx, "/kiln/v1/election/controller/694d7a1b", "controller-a")
	require.NoError(t, err)

	var buf bytes.Buffer
	info, err := src.Backup(ctx, &buf)
	require.NoError(t, err)
	if info.Keys != 252 {
		t.Errorf("Backup() keys = %d, want 252 (250 hosts + 2 secrets, no election key)", info.Keys)
	}
	if bytes.Contains(buf.Bytes(), []byte("pw-aa")) {
		t.Error("backup holds a plaintext secret")
	}
	backup := buf.Bytes()
	got, err := ReadBackupInfo(bytes.NewReader(backup))
	require.NoError(t, err)
	if got != info {
		t.Errorf("ReadBackupInfo() = %+v, want %+v", got, info)
	}

	// Restore into a new, empty etcd, as after losing the controller host.
	_, c2 := startEtcd(t)
	dst := New(c2, WithSealer(sealer), WithLogger(testLogger(t)))
	_, err = dst.Restore(ctx, bytes.NewReader(backup), RestoreOptions{})
	require.NoError(t, err)

	items, _, err := dst.List(ctx, "hosts", func() proto.Message { return &typesv1.Host{} }, ListOptions{})
	require.NoError(t, err)
	if len(items) != len(want) {
		t.Fatalf("after restore List(hosts) = %d items, want %d", len(items), len(want))
	}
	for _, it := range items {
		if !proto.Equal(it.Msg, want[it.Name]) {
			t.Errorf("restored %q = %v, want %v", it.Name, it.Msg, want[it.Name])
		}
	}
	pw, err := dst.GetSecret(ctx, "bmc/rack1-aa")
	require.NoError(t, err)
	if string(pw) != "pw-aa" {
		t.Errorf("restored GetSecret(bmc/rack1-aa) = %q, want %q", pw, "pw-aa")
	}
	// The restored store works: optimistic concurrency on restored keys.
	var h typesv1.Host
	rev, err := dst.Get(ctx, "hosts", "rack1-aa", &h)
	require.NoError(t, err)
	_, err = dst.Update(ctx, "hosts", "rack1-aa", &h, rev)
	require.NoError(t, err)

	// Without the key file, secrets do not open.
	other, err := seal.LoadOrCreateKey(filepath.Join(t.TempDir(), "other.key"))
	require.NoError(t, err)
	if _, err := New(c2, WithSealer(other)).GetSecret(ctx, "bmc/rack1-aa"); !errdefs.IsPermissionDenied(err) {
		t.Errorf("GetSecret(restored, other key) = %v, want PermissionDenied", err)
	}

	// A second restore into the now full store is refused unless Replace.
	if _, err := dst.Restore(ctx, bytes.NewReader(backup), RestoreOptions{}); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Restore(into non-empty store) = %v, want FailedPrecondition", err)
	}
	_, err = dst.Create(ctx, "hosts", "added-later", host("added-later", ""))
	require.NoError(t, err)
	_, err = dst.Restore(ctx, bytes.NewReader(backup), RestoreOptions{Replace: true})
	require.NoError(t, err)
	if _, err := dst.Get(ctx, "hosts", "added-later", &h); !errdefs.IsNotFound(err) {
		t.Errorf("after Restore(Replace) Get(added-later) = %v, want NotFound", err)
	}
}

func TestRestoreRefusesDamagedBackups(t *testing.T) {
	ctx := testCtx(t)
	s, _ := newStore(t)
	_, err := s.Create(ctx, "hosts", "rack1-01", host("rack1-01", ""))
	require.NoError(t, err)
	var buf bytes.Buffer
	_, err = s.Backup(ctx, &buf)
	require.NoError(t, err)
	good := buf.Bytes()

	flipped := bytes.Clone(good)
	flipped[len(flipped)/2] ^= 0x01
	tests := []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"not a backup", []byte("hello, this is not a backup at all, not even close to one")},
		{"truncated", good[:len(good)-1]},
		{"bit flip", flipped},
		{"revision past int64, checksum right", func() []byte {
			// Found by FuzzOpen's seeds (controller/backup): read as -1.
			b := append([]byte(backupMagic), binary.AppendUvarint(nil, math.MaxUint64)...)
			b = append(b, 0, 0) // no keys, count 0
			sum := sha256.Sum256(b)
			return append(b, sum[:]...)
		}()},
	}
	_, fresh := startEtcd(t)
	for _, tt := range tests {
		dst := New(fresh)
		if _, err := dst.Restore(ctx, bytes.NewReader(tt.data), RestoreOptions{}); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Restore(%s) = %v, want InvalidArgument", tt.name, err)
		}
	}
	// Nothing was written by the refused restores.
	resp, err := fresh.Get(ctx, Prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	if resp.Count != 0 {
		t.Errorf("after refused restores the store holds %d keys, want 0", resp.Count)
	}
}
