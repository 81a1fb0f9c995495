// Package operatorcert issues the kilnconfigs of operators: the admin
// kilnconfig and bundle a controller keeps in its data directory (renewed
// onto a new CA), and an operator's from the data directory
// (kiln-controller operator-cert, Write), each certificate with a role
// (reader, operator, admin) from the controller's signing CA.
package operatorcert

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"log/slog"
	"os"
	"os/user"
	"path/filepath"
	"time"

	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/authz"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/trust"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/seal"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Request asks for a kilnconfig for an operator.
type Request struct {
	// Role is "reader", "operator" or "admin".
	Role string
	// Name is the operator's identity (certificate CommonName).
	Name string
	// Server is the API address written into the file; empty takes it
	// from the admin kilnconfig in the data directory, else DefaultServer.
	Server string
	// Out is the file to write (mode 0600).
	Out string
	// Clock is the time source (time.Now).
	Clock func() time.Time
}

// DefaultServer is the API address of a kilnconfig written without a
// server while the data directory holds no admin kilnconfig: the
// controller's default listen address (:7443) from this machine.
const DefaultServer = "127.0.0.1:7443"

// AdminConfigName is the admin kilnconfig a controller writes into its
// data directory.
const AdminConfigName = "kilnconfig-admin.yaml"

// clientCertTTL is the validity of operator certificates.
const clientCertTTL = 365 * 24 * time.Hour

// Write issues an operator certificate from the CA stored in
// the controller's etcd and writes a kilnconfig for it. It works while the
// controller runs (through its embedded etcd's client URL, or the external
// etcd) and while it is stopped (it then starts the embedded etcd itself).
//
// It returns InvalidArgument for a bad role or name, FailedPrecondition
// when the data directory holds no CA yet (start the controller once) and
// PermissionDenied when the CA key does not open with cfg's secret key.
func Write(ctx context.Context, cfg datadir.Config, req Request, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	role, err := pki.ParseRole(req.Role)
	if err != nil {
		return err
	}
	if role != pki.RoleReader && role != pki.RoleOperator && role != pki.RoleAdmin {
		return errdefs.InvalidArgument("role %q is not an operator role: want reader, operator or admin", role)
	}
	if req.Name == "" {
		return errdefs.InvalidArgument("operator name is required")
	}
	if req.Out == "" {
		return errdefs.InvalidArgument("output file is required")
	}
	if cfg.DataDir == "" {
		return errdefs.InvalidArgument("data directory is required")
	}
	keyFile := cfg.KeyFile()
	if _, err := os.Stat(keyFile); err != nil {
		return errdefs.FailedPrecondition("secret key %s: %v (start the controller once first)", keyFile, err)
	}
	sealer, err := seal.LoadOrCreateKey(keyFile)
	if err != nil {
		return err
	}
	client, closeFn, err := datadir.Open(ctx, cfg, log)
	if err != nil {
		return err
	}
	defer closeFn()
	st := store.New(client, store.WithSealer(sealer))
	ca, err := trust.LoadSet(ctx, st)
	if errdefs.IsNotFound(err) {
		return errdefs.FailedPrecondition("no CA in the controller's etcd: start the controller once first")
	}
	if err != nil {
		return err
	}
	server := req.Server
	if server == "" {
		if admin, err := kilnconfig.Load(filepath.Join(cfg.DataDir, AdminConfigName)); err == nil {
			server = admin.Server
		} else {
			server = DefaultServer
		}
	}
	clock := req.Clock
	if clock == nil {
		clock = time.Now
	}
	kc, err := Issue(ca, role, req.Name, server, clock())
	if err != nil {
		return err
	}
	// Recorded before the certificate is handed out: a certificate nobody
	// can see in the audit log is never written. The issuer has no
	// certificate; it is whoever can read the data directory and the
	// secret key, named by the local user.
	if err := st.AppendAudit(ctx, audit.Record(operatorCertEntry(kc, role, req.Name, clock()))); err != nil {
		return fmt.Errorf("operator certificate: audit record: %w", err)
	}
	if err := kilnconfig.Write(req.Out, kc); err != nil {
		return err
	}
	log.Info("operator kilnconfig written", "role", role, "name", req.Name, "path", req.Out, "server", server)
	return nil
}

// operatorCertEntry is the audit entry of an operator certificate issued
// from the data directory.
func operatorCertEntry(kc *kilnconfig.Config, role pki.Role, name string, now time.Time) *controllerv1.AuditEntry {
	issuer := "local"
	if u, err := user.Current(); err == nil {
		issuer = "local:" + u.Username
	}
	e := audit.NewCall(authz.Caller{Name: issuer, Role: "data-dir"}, "issue-operator-cert", func() time.Time { return now }).Entry("Certificate", name)
	e.Result = audit.OK
	e.Message = "role " + string(role)
	if block, _ := pem.Decode([]byte(kc.Cert)); block != nil {
		if cert, err := x509.ParseCertificate(block.Bytes); err == nil {
			e.Message += ", serial " + cert.SerialNumber.Text(16)
		}
	}
	return e
}

// The admin client bundle: the admin kilnconfig's CA, certificate and key
// as PEM files in DataDir/admin/, for tools other than kilnctl (grpcurl,
// curl).
const (
	AdminBundleDir = "admin"
	bundleCA       = "ca.crt"
	bundleCert     = "admin.crt"
	bundleKey      = "admin.key"
)

// WriteAdmin writes dataDir/kilnconfig-admin.yaml and the admin bundle
// on the first start, and again when the CAs of set changed or the
// certificate nears its end; otherwise it keeps the certificate and only
// corrects the server address. Callers serialise calls for one dataDir.
func WriteAdmin(dataDir string, set *trust.Set, server string, now time.Time, log *slog.Logger) error {
	path := filepath.Join(dataDir, AdminConfigName)
	cfg, err := kilnconfig.Load(path)
	switch {
	case err == nil && cfg.CA == string(set.BundlePEM()) && !expiring(cfg.Cert, now) && issuedBy(cfg.Cert, set.Signer):
		if cfg.Server != server {
			cfg.Server = server
			if err := kilnconfig.Write(path, cfg); err != nil {
				return err
			}
		}
	default:
		if cfg, err = Issue(set, pki.RoleAdmin, "admin", server, now); err != nil {
			return err
		}
		if err := kilnconfig.Write(path, cfg); err != nil {
			return err
		}
		log.Info("admin kilnconfig written", "path", path)
	}
	dir := filepath.Join(dataDir, AdminBundleDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("admin bundle: %w", err)
	}
	for name, content := range map[string]string{bundleCA: cfg.CA, bundleCert: cfg.Cert, bundleKey: cfg.Key} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			return fmt.Errorf("admin bundle: %w", err)
		}
	}
	return nil
}

// adminRenewal is how long before expiry a start replaces the admin
// certificate.
const adminRenewal = 30 * 24 * time.Hour

// expiring reports whether the PEM certificate expires within
// adminRenewal of now (or does not parse).
func expiring(certPEM string, now time.Time) bool {
	cert, err := pki.ParseCertificatePEM([]byte(certPEM))
	return err != nil || now.Add(adminRenewal).After(cert.NotAfter)
}

// issuedBy reports whether the PEM certificate was issued by ca.
func issuedBy(certPEM string, ca *pki.CA) bool {
	cert, err := pki.ParseCertificatePEM([]byte(certPEM))
	return err == nil && pki.IssuerKeyID(cert) == ca.KeyID()
}

// Issue issues a client certificate with role for name from the signing
// CA of set, valid for a year, and returns a kilnconfig for server that
// trusts every CA of set. It returns InvalidArgument for the agent and
// controller roles.
func Issue(set *trust.Set, role pki.Role, name, server string, now time.Time) (*kilnconfig.Config, error) {
	if role == pki.RoleAgent || role == pki.RoleController {
		return nil, errdefs.InvalidArgument("role %q is not an operator role: want reader, operator or admin", role)
	}
	certPEM, keyPEM, err := set.Signer.Issue(role, name, nil, clientCertTTL, now)
	if err != nil {
		return nil, err
	}
	return &kilnconfig.Config{Server: server, CA: string(set.BundlePEM()), Cert: string(certPEM), Key: string(keyPEM)}, nil
}
