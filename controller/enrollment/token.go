package enrollment

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"regexp"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// Token is a parsed enrollment token "<id>.<secret>", in the format of
// kubeadm bootstrap tokens: a public id of 6 and a secret of 16 characters
// from [a-z0-9].
type Token struct {
	ID     string
	Secret string
}

var tokenRE = regexp.MustCompile(`^([a-z0-9]{6})\.([a-z0-9]{16})$`)

const tokenAlphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

// NewToken returns a fresh random token.
func NewToken() (Token, error) {
	id, err := randomString(6)
	if err != nil {
		return Token{}, err
	}
	secret, err := randomString(16)
	if err != nil {
		return Token{}, err
	}
	return Token{ID: id, Secret: secret}, nil
}

// ParseToken parses "<id>.<secret>". It returns an InvalidArgument error
// that never contains the secret.
func ParseToken(s string) (Token, error) {
	m := tokenRE.FindStringSubmatch(s)
	if m == nil {
		return Token{}, errdefs.InvalidArgument("enrollment token is malformed: want <id>.<secret> matching [a-z0-9]{6}.[a-z0-9]{16}")
	}
	return Token{ID: m[1], Secret: m[2]}, nil
}

// String returns "<id>.<secret>". Do not log it.
func (t Token) String() string { return t.ID + "." + t.Secret }

// SecretHash is the hex sha256 of the secret: the only form of it that is
// stored.
func (t Token) SecretHash() string {
	sum := sha256.Sum256([]byte(t.Secret))
	return hex.EncodeToString(sum[:])
}

// matches reports in constant time whether the token's secret hashes to h.
func (t Token) matches(h string) bool {
	return subtle.ConstantTimeCompare([]byte(t.SecretHash()), []byte(h)) == 1
}

func randomString(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	for i := range b {
		// 256 % 36 != 0 gives a slight bias; reject to keep it uniform.
		for b[i] >= 252 {
			var one [1]byte
			if _, err := rand.Read(one[:]); err != nil {
				return "", err
			}
			b[i] = one[0]
		}
		b[i] = tokenAlphabet[int(b[i])%len(tokenAlphabet)]
	}
	return string(b), nil
}

func newUID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}
