package controller

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

// OperatorCertRequest asks for a kilnconfig for an operator.
type OperatorCertRequest struct {
	// Role is "reader", "operator" or "admin".
	Role string
	// Name is the operator's identity (certificate CommonName).
	Name string
	// Server is the API address written into the file; empty takes it
	// from the admin kilnconfig in DataDir, else from ListenAddr.
	Server string
	// Out is the file to write (mode 0600).
	Out string
}

// WriteOperatorConfig issues an operator certificate from the CA stored in
// the controller's etcd and writes a kilnconfig for it. It works while the
// controller runs (through its embedded etcd's client URL, or the external
// etcd) and while it is stopped (it then starts the embedded etcd itself).
//
// It returns InvalidArgument for a bad role or name, FailedPrecondition
// when the data directory holds no CA yet (start the controller once) and
// PermissionDenied when the CA key does not open with cfg's secret key.
func WriteOperatorConfig(ctx context.Context, cfg Config, req OperatorCertRequest, log *slog.Logger) error {
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
	keyFile := cfg.SecretKeyFile
	if keyFile == "" {
		keyFile = filepath.Join(cfg.DataDir, "secret.key")
	}
	if _, err := os.Stat(keyFile); err != nil {
		return errdefs.FailedPrecondition("secret key %s: %v (start the controller once first)", keyFile, err)
	}
	sealer, err := seal.LoadOrCreateKey(keyFile)
	if err != nil {
		return err
	}
	client, closeFn, err := datadir.Open(ctx, cfg.dataDir(), log)
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
			listen := cfg.ListenAddr
			if listen == "" {
				listen = DefaultListenAddr
			}
			server = clientAddr(listen)
		}
	}
	clock := cfg.Clock
	if clock == nil {
		clock = time.Now
	}
	kc, err := clientConfig(ca, role, req.Name, server, clock())
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
