// Package trust holds the controller's certificate authorities: the CA
// stored in etcd (its key sealed) and created on the first start, the CAs
// of a rotation next to it, the set every replica uses and follows as a
// rotation changes it (Rotating, the enrollment service's signer), and
// the rotation's phases (Rotate, kiln-controller rotate-ca;
// docs/controller.md, "Rotating the CA").
package trust

import (
	"bytes"
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
)

// The CAs of a rotation (kiln-controller rotate-ca, rotate.go) sit next
// to the signing CA (CertKey, KeySecret): a prepared next CA, and after
// the switch the previous one, each a certificate in the clear and a
// sealed key.
const (
	nextCertKey   = store.Prefix + "pki/ca.next.crt"
	nextKeySecret = "ca/next-key"
	prevCertKey   = store.Prefix + "pki/ca.prev.crt"
	prevKeySecret = "ca/prev-key"
	prefix        = store.Prefix + "pki/"
)

// Set is the controller's CAs at one point of a rotation.
//
//	idle:     signer                      (trusted: signer)
//	prepared: signer (old), next (new)    (trusted: both; nothing signed by next)
//	switched: signer (new), prev (old)    (trusted: both; the controller's own
//	                                       certificate still from prev)
//
// Retiring deletes prev: idle again, with the new CA.
type Set struct {
	// Signer issues agent and operator certificates.
	Signer *pki.CA
	// Next and Prev are nil outside a rotation.
	Next, Prev *pki.CA
}

// Serving is the CA that issues the controller's own certificate: the one
// every client trusts, the old one until it is retired.
func (s *Set) Serving() *pki.CA {
	if s.Prev != nil {
		return s.Prev
	}
	return s.Signer
}

// Trusted are the CAs whose certificates are accepted, serving first.
func (s *Set) Trusted() []*pki.CA {
	out := []*pki.CA{s.Serving()}
	for _, ca := range []*pki.CA{s.Signer, s.Next} {
		if ca != nil && ca != out[0] {
			out = append(out, ca)
		}
	}
	return out
}

// BundlePEM is the trusted CAs in PEM, serving first: what agents and
// kilnconfigs are given.
func (s *Set) BundlePEM() []byte {
	var b bytes.Buffer
	for _, ca := range s.Trusted() {
		b.Write(ca.CertPEM())
	}
	return b.Bytes()
}

// Pool holds the trusted CAs.
func (s *Set) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	for _, ca := range s.Trusted() {
		p.AddCert(ca.Cert())
	}
	return p
}

// Phase names where the set is in a rotation.
func (s *Set) Phase() string {
	switch {
	case s.Next != nil:
		return "prepared"
	case s.Prev != nil:
		return "switched"
	}
	return "idle"
}

// LoadSet reads the signing CA and the CAs of a rotation under way. It
// returns NotFound when there is no CA yet and the errors of Load.
func LoadSet(ctx context.Context, st *store.Store) (*Set, error) {
	signer, err := Load(ctx, st)
	if err != nil {
		return nil, err
	}
	set := &Set{Signer: signer}
	if set.Next, err = loadCAAt(ctx, st, nextCertKey, nextKeySecret); err != nil {
		return nil, err
	}
	if set.Prev, err = loadCAAt(ctx, st, prevCertKey, prevKeySecret); err != nil {
		return nil, err
	}
	return set, nil
}

// loadCAAt reads a CA of a rotation, nil when there is none.
func loadCAAt(ctx context.Context, st *store.Store, certKey, keySecret string) (*pki.CA, error) {
	resp, err := st.Client().Get(ctx, certKey)
	if err != nil {
		return nil, errdefs.Unavailable("load CA %s: etcd: %w", certKey, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, nil
	}
	keyPEM, err := st.GetSecret(ctx, keySecret)
	if err != nil {
		return nil, fmt.Errorf("load CA %s key: %w", certKey, err)
	}
	return pki.LoadCA(resp.Kvs[0].Value, keyPEM)
}

// Rotating is the controller's CA as it follows rotations: every
// replica swaps in the set etcd holds whenever it changes (Follow), so
// that a rotation run from any machine reaches all of them. It is the
// enrollment service's Signer: agents are signed by the signing CA, given
// every trusted CA, and pin the serving one.
type Rotating struct {
	cur atomic.Pointer[Set]
}

var (
	_ enrollment.Signer   = (*Rotating)(nil)
	_ enrollment.Rotation = (*Rotating)(nil)
)

// NewRotating returns a Rotating that uses set until it follows another.
func NewRotating(set *Set) *Rotating {
	r := &Rotating{}
	r.cur.Store(set)
	return r
}

// Set is the CA set in use now.
func (r *Rotating) Set() *Set { return r.cur.Load() }

// SignCSR signs with the signing CA.
func (r *Rotating) SignCSR(csrDER []byte, role pki.Role, name string, ttl time.Duration, now time.Time, opts ...pki.SignOption) ([]byte, error) {
	return r.Set().Signer.SignCSR(csrDER, role, name, ttl, now, opts...)
}

// Issue issues a key and certificate from the signing CA.
func (r *Rotating) Issue(role pki.Role, name string, hosts []string, ttl time.Duration, now time.Time) ([]byte, []byte, error) {
	return r.Set().Signer.Issue(role, name, hosts, ttl, now)
}

// CertPEM is every trusted CA (the trust bundle).
func (r *Rotating) CertPEM() []byte { return r.Set().BundlePEM() }

// Hash is the pin of the serving CA, the one in the controller's chain.
func (r *Rotating) Hash() string { return r.Set().Serving().Hash() }

// Pool holds the trusted CAs.
func (r *Rotating) Pool() *x509.CertPool { return r.Set().Pool() }

// WantsRenewal is true for a certificate not issued by the signing CA
// while an old CA waits to be retired.
func (r *Rotating) WantsRenewal(issuer string) bool {
	s := r.Set()
	return s.Prev != nil && issuer != s.Signer.KeyID()
}

// Follow reloads the CA set whenever etcd's pki/ keys change, until ctx
// ends, calling changed after each new set is in use. A set that does not
// load (a damaged record) is logged and the one in use is kept.
func (r *Rotating) Follow(ctx context.Context, st *store.Store, log *slog.Logger, changed func(*Set)) {
	for ctx.Err() == nil {
		wch := st.Client().Watch(clientv3.WithRequireLeader(ctx), prefix, clientv3.WithPrefix())
		// Changes made before the watch started are read here.
		r.reload(ctx, st, log, changed)
		for resp := range wch {
			if resp.Err() != nil {
				log.Warn("CA watch failed", "err", resp.Err())
				break
			}
			r.reload(ctx, st, log, changed)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (r *Rotating) reload(ctx context.Context, st *store.Store, log *slog.Logger, changed func(*Set)) {
	set, err := LoadSet(ctx, st)
	if err != nil {
		if ctx.Err() == nil {
			log.Error("CA set not reloaded; keeping the one in use", "err", err)
		}
		return
	}
	old := r.Set()
	if bytes.Equal(old.BundlePEM(), set.BundlePEM()) && old.Signer.KeyID() == set.Signer.KeyID() {
		return
	}
	r.cur.Store(set)
	log.Info("controller CAs changed", "phase", set.Phase(), "signer", set.Signer.KeyID(), "serving_ca_hash", set.Serving().Hash(), "trusted", len(set.Trusted()))
	if changed != nil {
		changed(set)
	}
}
