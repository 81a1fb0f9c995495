package controller

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

// The CAs of a rotation (kiln-controller rotate-ca, rotateca.go) sit next
// to the signing CA (caCertKey, caKeySecret): a prepared next CA, and after
// the switch the previous one, each a certificate in the clear and a
// sealed key.
const (
	caNextCertKey   = store.Prefix + "pki/ca.next.crt"
	caNextKeySecret = "ca/next-key"
	caPrevCertKey   = store.Prefix + "pki/ca.prev.crt"
	caPrevKeySecret = "ca/prev-key"
	caPrefix        = store.Prefix + "pki/"
)

// caSet is the controller's CAs at one point of a rotation.
//
//	idle:     signer                      (trusted: signer)
//	prepared: signer (old), next (new)    (trusted: both; nothing signed by next)
//	switched: signer (new), prev (old)    (trusted: both; the controller's own
//	                                       certificate still from prev)
//
// Retiring deletes prev: idle again, with the new CA.
type caSet struct {
	// signer issues agent and operator certificates.
	signer *pki.CA
	// next and prev are nil outside a rotation.
	next, prev *pki.CA
}

// serving is the CA that issues the controller's own certificate: the one
// every client trusts, the old one until it is retired.
func (s *caSet) serving() *pki.CA {
	if s.prev != nil {
		return s.prev
	}
	return s.signer
}

// trusted are the CAs whose certificates are accepted, serving first.
func (s *caSet) trusted() []*pki.CA {
	out := []*pki.CA{s.serving()}
	for _, ca := range []*pki.CA{s.signer, s.next} {
		if ca != nil && ca != out[0] {
			out = append(out, ca)
		}
	}
	return out
}

// bundlePEM is the trusted CAs in PEM, serving first: what agents and
// kilnconfigs are given.
func (s *caSet) bundlePEM() []byte {
	var b bytes.Buffer
	for _, ca := range s.trusted() {
		b.Write(ca.CertPEM())
	}
	return b.Bytes()
}

// pool holds the trusted CAs.
func (s *caSet) pool() *x509.CertPool {
	p := x509.NewCertPool()
	for _, ca := range s.trusted() {
		p.AddCert(ca.Cert())
	}
	return p
}

// phase names where the set is in a rotation.
func (s *caSet) phase() string {
	switch {
	case s.next != nil:
		return "prepared"
	case s.prev != nil:
		return "switched"
	}
	return "idle"
}

// loadCASet reads the signing CA and the CAs of a rotation under way. It
// returns NotFound when there is no CA yet and the errors of loadCA.
func loadCASet(ctx context.Context, st *store.Store) (*caSet, error) {
	signer, err := loadCA(ctx, st)
	if err != nil {
		return nil, err
	}
	set := &caSet{signer: signer}
	if set.next, err = loadCAAt(ctx, st, caNextCertKey, caNextKeySecret); err != nil {
		return nil, err
	}
	if set.prev, err = loadCAAt(ctx, st, caPrevCertKey, caPrevKeySecret); err != nil {
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

// rotatingCA is the controller's CA as it follows rotations: every
// replica swaps in the set etcd holds whenever it changes (follow), so
// that a rotation run from any machine reaches all of them. It is the
// enrollment service's Signer: agents are signed by the signing CA, given
// every trusted CA, and pin the serving one.
type rotatingCA struct {
	cur atomic.Pointer[caSet]
}

var (
	_ enrollment.Signer   = (*rotatingCA)(nil)
	_ enrollment.Rotation = (*rotatingCA)(nil)
)

func newRotatingCA(set *caSet) *rotatingCA {
	r := &rotatingCA{}
	r.cur.Store(set)
	return r
}

func (r *rotatingCA) set() *caSet { return r.cur.Load() }

// SignCSR signs with the signing CA.
func (r *rotatingCA) SignCSR(csrDER []byte, role pki.Role, name string, ttl time.Duration, now time.Time, opts ...pki.SignOption) ([]byte, error) {
	return r.set().signer.SignCSR(csrDER, role, name, ttl, now, opts...)
}

// Issue issues a key and certificate from the signing CA.
func (r *rotatingCA) Issue(role pki.Role, name string, hosts []string, ttl time.Duration, now time.Time) ([]byte, []byte, error) {
	return r.set().signer.Issue(role, name, hosts, ttl, now)
}

// CertPEM is every trusted CA (the trust bundle).
func (r *rotatingCA) CertPEM() []byte { return r.set().bundlePEM() }

// Hash is the pin of the serving CA, the one in the controller's chain.
func (r *rotatingCA) Hash() string { return r.set().serving().Hash() }

// Pool holds the trusted CAs.
func (r *rotatingCA) Pool() *x509.CertPool { return r.set().pool() }

// WantsRenewal is true for a certificate not issued by the signing CA
// while an old CA waits to be retired.
func (r *rotatingCA) WantsRenewal(issuer string) bool {
	s := r.set()
	return s.prev != nil && issuer != s.signer.KeyID()
}

// follow reloads the CA set whenever etcd's pki/ keys change, until ctx
// ends, calling changed after each new set is in use. A set that does not
// load (a damaged record) is logged and the one in use is kept.
func (r *rotatingCA) follow(ctx context.Context, st *store.Store, log *slog.Logger, changed func(*caSet)) {
	for ctx.Err() == nil {
		wch := st.Client().Watch(clientv3.WithRequireLeader(ctx), caPrefix, clientv3.WithPrefix())
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

func (r *rotatingCA) reload(ctx context.Context, st *store.Store, log *slog.Logger, changed func(*caSet)) {
	set, err := loadCASet(ctx, st)
	if err != nil {
		if ctx.Err() == nil {
			log.Error("CA set not reloaded; keeping the one in use", "err", err)
		}
		return
	}
	old := r.set()
	if bytes.Equal(old.bundlePEM(), set.bundlePEM()) && old.signer.KeyID() == set.signer.KeyID() {
		return
	}
	r.cur.Store(set)
	log.Info("controller CAs changed", "phase", set.phase(), "signer", set.signer.KeyID(), "serving_ca_hash", set.serving().Hash(), "trusted", len(set.trusted()))
	if changed != nil {
		changed(set)
	}
}
