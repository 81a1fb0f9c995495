// Package enroll turns a one-time enrollment token into the agent's
// identity. The agent makes its own key, connects to the controller over
// TLS trusting nothing but the CA whose hash the operator gave it
// (--ca-hash, like kubeadm's discovery hash), sends a CSR with the token and
// stores the certificate it receives (package identity).
//
// The pin is checked inside the TLS handshake: when the controller's chain
// holds no CA with the pinned hash, the handshake fails and the token is
// never sent.
package enroll

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"github.com/kilnhq/kiln/internal/atomicfile"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// DefaultTimeout bounds an enrollment when the context has no deadline.
const DefaultTimeout = 30 * time.Second

// Options describe one enrollment.
type Options struct {
	// ControllerAddr is host:port of the controller API; an https:// or
	// grpcs:// prefix is accepted and dropped.
	ControllerAddr string
	// Token is the one-time enrollment token "<id>.<secret>". It is never
	// logged and never sent before the controller is authenticated.
	Token string
	// CAHash pins the controller CA: "sha256:<hex of its SPKI sha256>".
	CAHash string
	// Host is the host name asked for; empty lets the controller choose
	// (the token's host, or Facts.Hostname).
	Host string
	// DataDir is where the identity is stored.
	DataDir string
	// Facts are sent with the enrollment, so the Host appears with them.
	Facts *typesv1.Facts
	Log   *slog.Logger
}

// Enroll enrolls the agent and stores its identity under o.DataDir.
//
// Errors: InvalidArgument for missing or malformed options, AlreadyExists
// when DataDir already holds an identity, PermissionDenied when the
// controller's CA does not match the pin ("CA hash mismatch ...") or the
// controller refuses the token (unknown, used, expired, bound to another
// host), Unavailable when the controller cannot be reached. Enroll blocks
// until the controller answers or ctx (DefaultTimeout without deadline)
// ends.
func Enroll(ctx context.Context, o Options) (*identity.Identity, error) {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "enroll")
	addr := Address(o.ControllerAddr)
	switch {
	case addr == "":
		return nil, errdefs.InvalidArgument("enroll: the controller address is required (--controller)")
	case o.Token == "":
		return nil, errdefs.InvalidArgument("enroll: an enrollment token is required (--token)")
	case o.DataDir == "":
		return nil, errdefs.InvalidArgument("enroll: a data directory is required (--data-dir)")
	}
	if _, err := pki.ParseHash(o.CAHash); err != nil {
		return nil, fmt.Errorf("enroll: %w (check --ca-hash)", err)
	}
	if identity.Exists(o.DataDir) {
		return nil, errdefs.AlreadyExists("enroll: %s already holds an agent identity; remove it to enroll again", o.DataDir)
	}

	keyPEM, csr, err := pendingKey(o.DataDir, o.Host)
	if err != nil {
		return nil, fmt.Errorf("enroll: %w", err)
	}

	pin := &pinner{pin: o.CAHash}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(pin.config())))
	if err != nil {
		return nil, errdefs.InvalidArgument("enroll: controller address %q: %v", addr, err)
	}
	defer conn.Close()

	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultTimeout)
		defer cancel()
	}
	log.Info("enrolling", "controller", addr, "host", o.Host, "ca_hash", o.CAHash)
	resp, err := controllerv1.NewEnrollmentClient(conn).Enroll(ctx, &controllerv1.EnrollRequest{
		Token:  o.Token,
		CsrDer: csr,
		Host:   o.Host,
		Facts:  o.Facts,
	})
	if err != nil {
		if perr := pin.failure(); perr != nil {
			return nil, fmt.Errorf("enroll: %w", perr)
		}
		return nil, describe(addr, err)
	}

	// The controller's CAs: one, or the old and the new one during a CA
	// rotation; the pinned one must be among them.
	cas, err := pki.ParseCertificatesPEM(resp.GetCaPem())
	if err != nil {
		return nil, fmt.Errorf("enroll: controller returned an unusable CA: %w", err)
	}
	pinned := false
	for _, ca := range cas {
		pinned = pinned || pki.Hash(ca) == o.CAHash
	}
	if !pinned {
		return nil, errdefs.PermissionDenied("enroll: controller returned CA %s, not the pinned %s", pki.Hash(cas[0]), o.CAHash)
	}
	id, err := identity.Save(o.DataDir, identity.Files{
		KeyPEM:     keyPEM,
		CertPEM:    resp.GetCertificatePem(),
		CAPEM:      resp.GetCaPem(),
		Controller: identity.Controller{Address: addr, CAHash: o.CAHash, Host: resp.GetHost()},
	})
	if err != nil {
		return nil, fmt.Errorf("enroll: store identity: %w", err)
	}
	_ = os.Remove(filepath.Join(o.DataDir, PendingKeyFile))
	log.Info("enrolled", "host", id.Host(), "serial", id.Certificate().Leaf.SerialNumber.Text(16), "data_dir", o.DataDir)
	return id, nil
}

// PendingKeyFile keeps the key of an enrollment that has not been answered
// yet, in the data directory: a retry (after a lost answer, or a restart
// of the agent) asks with the same key, which the controller recognises as
// the token's user. It is removed once the identity is stored.
const PendingKeyFile = "enroll-key.pem"

// pendingKey returns the pending enrollment key and a CSR for it, making
// and storing (0600) a new key when there is none.
func pendingKey(dataDir, host string) (keyPEM, csr []byte, err error) {
	p := filepath.Join(dataDir, PendingKeyFile)
	if keyPEM, err = os.ReadFile(p); err == nil {
		if csr, err = pki.CSRForKey(keyPEM, host); err == nil {
			return keyPEM, csr, nil
		}
	}
	if keyPEM, csr, err = pki.NewKeyAndCSR(host); err != nil {
		return nil, nil, err
	}
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return nil, nil, err
	}
	if err := atomicfile.Write(p, keyPEM, 0o600); err != nil {
		return nil, nil, fmt.Errorf("store pending key: %w", err)
	}
	return keyPEM, csr, nil
}

// Address normalises a controller address: it drops an https:// or
// grpcs:// prefix and a trailing slash.
func Address(s string) string {
	s = strings.TrimSpace(s)
	for _, p := range []string{"https://", "grpcs://"} {
		s = strings.TrimPrefix(s, p)
	}
	return strings.TrimSuffix(s, "/")
}

// describe turns an Enroll RPC error into an error a user can act on.
func describe(addr string, err error) error {
	st := status.Convert(err)
	switch st.Code() {
	case codes.PermissionDenied, codes.Unauthenticated:
		return errdefs.PermissionDenied("enroll: controller %s refused the enrollment: %s", addr, st.Message())
	case codes.InvalidArgument:
		return errdefs.InvalidArgument("enroll: controller %s rejected the request: %s", addr, st.Message())
	case codes.Unavailable:
		return errdefs.Unavailable("enroll: controller %s unreachable: %s", addr, st.Message())
	case codes.DeadlineExceeded:
		return errdefs.Unavailable("enroll: controller %s did not answer in time: %s", addr, st.Message())
	}
	return fmt.Errorf("enroll: controller %s: %w", addr, errgrpc.FromGRPC(err))
}

// pinner verifies the controller's chain against the pinned CA hash in
// the TLS handshake and remembers why it refused.
type pinner struct {
	pin string
	mu  sync.Mutex
	err error
}

func (p *pinner) config() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		// The usual verification needs roots the agent does not have yet;
		// VerifyConnection below trusts exactly the pinned CA.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			err := p.verify(cs.PeerCertificates)
			if err != nil {
				p.mu.Lock()
				p.err = err
				p.mu.Unlock()
			}
			return err
		},
	}
}

func (p *pinner) failure() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// verify accepts chain when a CA in it has the pinned hash, the leaf is
// issued by that CA, and the leaf has the controller role (an agent's
// certificate from the same CA must not collect tokens).
func (p *pinner) verify(chain []*x509.Certificate) error {
	if len(chain) == 0 {
		return errdefs.PermissionDenied("the controller presented no certificate")
	}
	ca, err := pki.VerifyPinned(chain, p.pin)
	if err != nil {
		if !anyMatches(chain, p.pin) {
			return errdefs.PermissionDenied("CA hash mismatch: controller presented %s, expected %s (check --ca-hash)", presented(chain), p.pin)
		}
		return errdefs.PermissionDenied("controller certificate does not verify against the pinned CA: %v", err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	if err := identity.VerifyController(chain, roots); err != nil {
		return err
	}
	return nil
}

func anyMatches(chain []*x509.Certificate, pin string) bool {
	for _, c := range chain {
		if pki.Hash(c) == pin {
			return true
		}
	}
	return false
}

// presented names the CA hash(es) the controller's chain offers: the hash
// of each CA certificate in it, or of the leaf when it sent no CA.
func presented(chain []*x509.Certificate) string {
	var hashes []string
	for _, c := range chain {
		if c.IsCA {
			hashes = append(hashes, pki.Hash(c))
		}
	}
	if len(hashes) == 0 {
		return "no CA certificate (leaf " + pki.Hash(chain[0]) + "; the controller must serve its CA in the chain)"
	}
	return strings.Join(hashes, ", ")
}

// IsPinMismatch reports whether err is Enroll's CA hash mismatch.
func IsPinMismatch(err error) bool {
	return errdefs.IsPermissionDenied(err) && strings.Contains(err.Error(), "CA hash mismatch")
}

// Kernel command line keys of boot media (PXE, ISO): the controller, the
// per-boot token, the CA pin and the host name.
const (
	CmdlineController = "kiln.controller"
	CmdlineToken      = "kiln.token"
	CmdlineCAHash     = "kiln.ca_hash"
	CmdlineHost       = "kiln.host"
)

// FromCmdline fills the controller address, token, CA hash and host of o
// from a kernel command line (kiln.controller=... kiln.token=...
// kiln.ca_hash=... kiln.host=...); fields already set in o are kept.
func FromCmdline(o Options, cmdline string) Options {
	for _, f := range strings.Fields(cmdline) {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			continue
		}
		var dst *string
		switch k {
		case CmdlineController:
			dst = &o.ControllerAddr
		case CmdlineToken:
			dst = &o.Token
		case CmdlineCAHash:
			dst = &o.CAHash
		case CmdlineHost:
			dst = &o.Host
		default:
			continue
		}
		if *dst == "" {
			*dst = v
		}
	}
	return o
}
