// Package sealtest writes sealed values the way older controllers did, for
// tests of what a newer one must still open.
package sealtest

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"testing"
)

// SealV1 seals pt under key with aad in format version 1, the format of
// controllers before key ids: one version byte, a 12-byte nonce, then the
// AES-256-GCM ciphertext and tag, with the version byte authenticated
// before aad.
func SealV1(t testing.TB, key, pt, aad []byte) []byte {
	t.Helper()
	block, err := aes.NewCipher(key)
	if err != nil {
		t.Fatalf("SealV1: %v", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		t.Fatalf("SealV1: %v", err)
	}
	out := make([]byte, 13)
	out[0] = 1
	if _, err := rand.Read(out[1:]); err != nil {
		t.Fatalf("SealV1: %v", err)
	}
	return aead.Seal(out, out[1:13], pt, append([]byte{1}, aad...))
}
