package backup_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"io"
	"os"
	"testing"

	"filippo.io/age"

	"github.com/kilnhq/kiln/controller/backup"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

// FuzzOpen reads any bytes as a backup file, the way `kiln-controller
// restore` does (backup.Open, then the store backup reader), in three
// modes: as the file itself (mode 0: the age layer parses it), as the
// plaintext inside an age encryption to the test identity (mode 1: the
// Kiln header, the sealing key record and the store backup are reached),
// and as a store backup body whose checksum the harness appends, behind a
// good header (mode 2: the record parser under the checksum is reached).
// Properties:
//
//   - a refusal is a clean error of class InvalidArgument (or
//     PermissionDenied when the file is for other recipients), never a
//     panic;
//   - nothing decrypts without the identity: with an identity the file was
//     not encrypted to, Open returns no key and no reader;
//   - an accepted file's key is the 32 bytes its header holds, and an
//     accepted store backup has a non-negative revision and as many keys
//     as it says.
//
// Seeds: a real backup of a controller with a host (sealed BMC password)
// and an enrolled agent (testdata/backup.age, its identity in
// testdata/identity.txt), and its decrypted plaintext.
func FuzzOpen(f *testing.F) {
	ids, err := backup.ReadIdentities("testdata/identity.txt")
	if err != nil {
		f.Fatal(err)
	}
	recipient := ids[0].(*age.X25519Identity).Recipient()
	stranger, err := age.GenerateX25519Identity()
	if err != nil {
		f.Fatal(err)
	}
	real, err := os.ReadFile("testdata/backup.age")
	if err != nil {
		f.Fatal(err)
	}
	key, rest, err := backup.Open(bytes.NewReader(real), ids)
	if err != nil {
		f.Fatalf("Open(testdata/backup.age) = %v", err)
	}
	body, err := io.ReadAll(rest)
	if err != nil {
		f.Fatal(err)
	}
	plain := append([]byte("KILNCTL1\n"), binary.AppendUvarint(nil, uint64(len(key)))...)
	plain = append(append(plain, key...), body...)
	f.Add(real, uint8(0))
	f.Add(plain, uint8(1))
	f.Add(real[:len(real)/2], uint8(0))
	f.Add(plain[:len(plain)-1], uint8(1))
	f.Add([]byte("KILNCTL1\n"), uint8(1))
	f.Add([]byte("age-encryption.org/v1\n-> X25519 \n"), uint8(0))
	f.Add(body[:len(body)-sha256.Size], uint8(2))
	f.Add([]byte("KILNBAK1\n\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01\x00\x00"), uint8(2))

	f.Fuzz(func(t *testing.T, data []byte, mode uint8) {
		file := data
		encrypted := mode%3 != 0
		if mode%3 == 2 {
			sum := sha256.Sum256(data)
			p := append([]byte("KILNCTL1\n"), binary.AppendUvarint(nil, seal.KeySize)...)
			p = append(p, bytes.Repeat([]byte{7}, seal.KeySize)...)
			data = append(append(p, data...), sum[:]...)
		}
		if encrypted {
			var buf bytes.Buffer
			w, err := age.Encrypt(&buf, recipient)
			if err != nil {
				t.Fatal(err)
			}
			w.Write(data)
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			file = buf.Bytes()
		}

		// Nothing opens without the identity.
		if k, r, err := backup.Open(bytes.NewReader(file), []age.Identity{stranger}); err == nil || k != nil || r != nil {
			t.Fatalf("Open(with an identity it is not for) = key %d bytes, reader %v, err %v; want nothing and an error", len(k), r != nil, err)
		} else if !errdefs.IsInvalidArgument(err) && !errdefs.IsPermissionDenied(err) {
			t.Fatalf("Open(with another identity) = %v, want InvalidArgument or PermissionDenied", err)
		}

		k, r, err := backup.Open(bytes.NewReader(file), ids)
		if err != nil {
			if !errdefs.IsInvalidArgument(err) && !errdefs.IsPermissionDenied(err) {
				t.Fatalf("Open = %v, want InvalidArgument or PermissionDenied", err)
			}
			if encrypted && errdefs.IsPermissionDenied(err) {
				t.Fatalf("Open(a file encrypted to the identity) = %v, want it to decrypt", err)
			}
			return
		}
		if len(k) != seal.KeySize {
			t.Fatalf("Open accepted a %d-byte sealing key, want %d", len(k), seal.KeySize)
		}
		if encrypted {
			want := data[len("KILNCTL1\n")+1 : len("KILNCTL1\n")+1+seal.KeySize]
			if !bytes.Equal(k, want) {
				t.Fatalf("Open returned a key other than the header's")
			}
		}
		info, err := store.ReadBackupInfo(r)
		if err != nil {
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("ReadBackupInfo = %v, want InvalidArgument", err)
			}
			return
		}
		if info.Revision < 0 || info.Keys < 0 {
			t.Fatalf("ReadBackupInfo accepted revision %d, %d keys", info.Revision, info.Keys)
		}
	})
}
