// Package backup reads and writes a Kiln controller backup file: the
// sealing key and a store backup (every resource and sealed secret, read at
// one etcd revision; store.Backup), encrypted with age
// (filippo.io/age, X25519 recipients) so that the file is safe at rest and
// the key never leaves the controller in the clear.
//
// Inside the age encryption:
//
//	"KILNCTL1\n"  uvarint(len(key)) key   store backup ("KILNBAK1\n"...)
//
// age authenticates every 64 KiB chunk and the end of the stream, so a
// truncated or altered file fails to open; the store backup carries its own
// checksum besides.
package backup

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"filippo.io/age"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

const magic = "KILNCTL1\n"

// ParseRecipients parses age X25519 public keys ("age1...").
func ParseRecipients(keys []string) ([]age.Recipient, error) {
	if len(keys) == 0 {
		return nil, errdefs.InvalidArgument("backup: no recipient: give the age public key (age1...) of whoever may restore it (kilnctl backup keygen makes a key pair)")
	}
	var rs []age.Recipient
	for _, k := range keys {
		r, err := age.ParseX25519Recipient(strings.TrimSpace(k))
		if err != nil {
			return nil, errdefs.InvalidArgument("backup: recipient %q is not an age X25519 public key (age1...): %v", short(k), err)
		}
		rs = append(rs, r)
	}
	return rs, nil
}

// ReadIdentities reads age identities (AGE-SECRET-KEY-1...) from a file,
// as written by `kilnctl backup keygen`.
func ReadIdentities(path string) ([]age.Identity, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("backup identity: %w", err)
	}
	defer f.Close()
	ids, err := age.ParseIdentities(f)
	if err != nil {
		return nil, errdefs.InvalidArgument("backup identity %s: not an age identity file (AGE-SECRET-KEY-1...): %v", path, err)
	}
	return ids, nil
}

// Writer encrypts a backup to w. Write the store backup to it after
// NewWriter, then Close it.
type Writer struct {
	enc io.WriteCloser
}

// NewWriter starts a backup for recipients, holding the sealing key.
func NewWriter(w io.Writer, recipients []age.Recipient, sealKey []byte) (*Writer, error) {
	if len(sealKey) != seal.KeySize {
		return nil, errdefs.InvalidArgument("backup: sealing key is %d bytes, want %d", len(sealKey), seal.KeySize)
	}
	enc, err := age.Encrypt(w, recipients...)
	if err != nil {
		return nil, fmt.Errorf("backup: encrypt: %w", err)
	}
	var hdr bytes.Buffer
	hdr.WriteString(magic)
	hdr.Write(binary.AppendUvarint(nil, uint64(len(sealKey))))
	hdr.Write(sealKey)
	if _, err := enc.Write(hdr.Bytes()); err != nil {
		return nil, fmt.Errorf("backup: write: %w", err)
	}
	return &Writer{enc: enc}, nil
}

// Write writes store backup bytes.
func (w *Writer) Write(p []byte) (int, error) { return w.enc.Write(p) }

// Close ends the encryption; the file is incomplete without it.
func (w *Writer) Close() error { return w.enc.Close() }

// Open decrypts a backup with identities and returns the sealing key and
// a reader of the store backup. It returns InvalidArgument for a file that
// is not a Kiln backup, PermissionDenied when none of the identities opens
// it.
func Open(r io.Reader, identities []age.Identity) ([]byte, io.Reader, error) {
	dec, err := age.Decrypt(r, identities...)
	if err != nil {
		var noMatch *age.NoIdentityMatchError
		if errors.As(err, &noMatch) {
			return nil, nil, errdefs.PermissionDenied("backup: none of the identities opens this backup (it was encrypted to other age recipients)")
		}
		return nil, nil, errdefs.InvalidArgument("backup: not an encrypted Kiln backup: %v", err)
	}
	br := bufio.NewReader(dec)
	head := make([]byte, len(magic))
	if _, err := io.ReadFull(br, head); err != nil {
		return nil, nil, errdefs.InvalidArgument("backup: damaged or truncated (it does not decrypt: %v)", err)
	}
	if string(head) != magic {
		return nil, nil, errdefs.InvalidArgument("backup: not a Kiln controller backup (no %q header)", strings.TrimSpace(magic))
	}
	n, err := binary.ReadUvarint(br)
	if err != nil || n != seal.KeySize {
		return nil, nil, errdefs.InvalidArgument("backup: damaged sealing key record")
	}
	key := make([]byte, n)
	if _, err := io.ReadFull(br, key); err != nil {
		return nil, nil, errdefs.InvalidArgument("backup: truncated sealing key record")
	}
	return key, br, nil
}

func short(s string) string {
	if len(s) > 24 {
		return s[:24] + "..."
	}
	return s
}
