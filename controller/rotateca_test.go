package controller_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/trust"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// caAgent is an enrolled agent as the controller sees it: its pair, and
// the CAs it trusts.
type caAgent struct {
	host            string
	certPEM, keyPEM []byte
	trust           []byte
}

// dialTrusting connects to the controller trusting only the CAs in
// trustPEM, presenting certPEM/keyPEM when given.
func dialTrusting(t *testing.T, env *controllertest.Env, trustPEM, certPEM, keyPEM []byte) *grpc.ClientConn {
	t.Helper()
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(trustPEM))
	tc := &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: pool, ServerName: "127.0.0.1"}
	if certPEM != nil {
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		require.NoError(t, err)
		tc.Certificates = []tls.Certificate{pair}
	}
	conn, err := grpc.NewClient(env.Addr, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

func (a *caAgent) heartbeat(ctx context.Context, t *testing.T, env *controllertest.Env) (*controllerv1.HeartbeatResponse, error) {
	resp, err := controllerv1.NewAgentsClient(dialTrusting(t, env, a.trust, a.certPEM, a.keyPEM)).Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444"})
	if err == nil && len(resp.GetCaBundlePem()) > 0 {
		a.trust = resp.GetCaBundlePem()
	}
	return resp, err
}

func (a *caAgent) renew(ctx context.Context, t *testing.T, env *controllertest.Env) error {
	keyPEM, csr, err := pki.NewKeyAndCSR(a.host)
	require.NoError(t, err)
	resp, err := controllerv1.NewAgentsClient(dialTrusting(t, env, a.trust, a.certPEM, a.keyPEM)).Renew(ctx, &controllerv1.RenewRequest{CsrDer: csr})
	if err != nil {
		return err
	}
	a.certPEM, a.keyPEM, a.trust = resp.GetCertificatePem(), keyPEM, resp.GetCaBundlePem()
	return nil
}

func issuer(t *testing.T, certPEM []byte) string {
	t.Helper()
	c, err := pki.ParseCertificatePEM(certPEM)
	require.NoError(t, err)
	return pki.IssuerKeyID(c)
}

func countCerts(pemData []byte) int { return strings.Count(string(pemData), "BEGIN CERTIFICATE") }

// TestRotateCA walks a rotation of the controller CA on a running
// controller with agents: each phase, the refusals between them, and what
// old certificates and kilnconfigs can do after each.
func TestRotateCA(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	env := controllertest.Start(t)
	cfg := datadir.Config{DataDir: env.DataDir}
	rotate := func(p trust.Phase, allowOffline bool) (trust.RotateResult, error) {
		return trust.Rotate(ctx, cfg, trust.RotateRequest{Phase: p, AllowOffline: allowOffline}, nil)
	}
	var agents []*caAgent
	for _, name := range []string{"rot-01", "rot-02", "rot-03"} {
		a, err := enroll(ctx, t, env, env.Token(t, name, time.Hour), name)
		require.NoError(t, err)
		ag := &caAgent{host: a.host, certPEM: a.certPEM, keyPEM: a.keyPEM, trust: env.CAPEM}
		agents = append(agents, ag)
	}
	live := agents[:2] // rot-03 never sends a heartbeat: offline
	for _, a := range live {
		_, err := a.heartbeat(ctx, t, env)
		require.NoError(t, err)
	}
	oldAdmin, err := os.ReadFile(env.AdminConfigPath)
	require.NoError(t, err)
	oldAdminPath := filepath.Join(t.TempDir(), "old-admin.yaml")
	require.NoError(t, os.WriteFile(oldAdminPath, oldAdmin, 0o600))
	oldOp := env.ConfigFor(t, "operator", "olga")
	listHosts := func(path string) error {
		_, err := controllerv1.NewResourcesClient(env.Dial(t, path)).List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
		return err
	}
	oldCA := env.Controller.CA().KeyID()

	// Out of order: refused, nothing changed.
	_, err = rotate(trust.Switch, false)
	require.True(t, errdefs.IsFailedPrecondition(err), "switch before prepare: %v", err)
	require.ErrorContains(t, err, "--phase prepare first")

	// prepare: a new CA, trusted next to the old one; the old one signs.
	res, err := rotate(trust.Prepare, false)
	require.NoError(t, err)
	require.Equal(t, "prepared", res.State)
	require.Equal(t, oldCA, res.Old)
	newCA := res.New
	require.NotEqual(t, oldCA, newCA)
	require.Eventually(t, func() bool { return countCerts(env.Controller.TrustedCAs()) == 2 }, 10*time.Second, 20*time.Millisecond, "the running controller trusts the prepared CA")
	again, err := rotate(trust.Prepare, false)
	require.NoError(t, err)
	require.True(t, again.Resumed, "prepare twice: a second new CA")
	require.Equal(t, newCA, again.New)
	hb, err := live[0].heartbeat(ctx, t, env)
	require.NoError(t, err)
	if countCerts(hb.GetCaBundlePem()) != 2 || hb.GetRenewCertificate() {
		t.Errorf("heartbeat after prepare: %d CAs, renew %v; want both CAs and no renewal (the old CA still signs)", countCerts(hb.GetCaBundlePem()), hb.GetRenewCertificate())
	}
	_, err = rotate(trust.Retire, false)
	require.True(t, errdefs.IsFailedPrecondition(err), "retire while prepared: %v", err)

	// switch: the new CA signs; agents are asked to renew.
	res, err = rotate(trust.Switch, false)
	require.NoError(t, err)
	require.Equal(t, "switched", res.State)
	require.Equal(t, newCA, res.New)
	require.Eventually(t, func() bool { return env.Controller.CA().KeyID() == newCA }, 10*time.Second, 20*time.Millisecond, "the running controller signs with the new CA")
	again, err = rotate(trust.Switch, false)
	require.NoError(t, err)
	require.True(t, again.Resumed)
	_, err = rotate(trust.Prepare, false)
	require.True(t, errdefs.IsFailedPrecondition(err), "prepare while switched: %v", err)
	for _, path := range []string{oldAdminPath, oldOp} {
		require.NoError(t, listHosts(path), "old kilnconfig %s during the overlap", filepath.Base(path))
	}
	hb, err = live[0].heartbeat(ctx, t, env)
	require.NoError(t, err)
	require.True(t, hb.GetRenewCertificate(), "heartbeat with an old-CA certificate after switch: no renewal asked")

	// retire refuses while a live agent is on the old CA, naming it.
	require.NoError(t, live[0].renew(ctx, t, env))
	require.Equal(t, newCA, issuer(t, live[0].certPEM), "renewed certificate's issuer")
	require.Equal(t, 2, countCerts(live[0].trust), "CAs in the renew answer")
	_, err = rotate(trust.Retire, false)
	require.True(t, errdefs.IsFailedPrecondition(err), "retire with live agents on the old CA: %v", err)
	for _, want := range []string{"rot-01", "rot-02"} { // rot-01 renewed but has not used it yet
		require.ErrorContains(t, err, want)
	}
	t.Logf("retire refused: %v", err)
	hb, err = live[0].heartbeat(ctx, t, env)
	require.NoError(t, err)
	require.False(t, hb.GetRenewCertificate(), "heartbeat with the new certificate: renewal asked again")
	require.NoError(t, live[1].renew(ctx, t, env))
	_, err = live[1].heartbeat(ctx, t, env)
	require.NoError(t, err)

	// Only the offline host is left: refused without --allow-offline.
	_, err = rotate(trust.Retire, false)
	require.True(t, errdefs.IsFailedPrecondition(err), "retire with an offline agent on the old CA: %v", err)
	require.ErrorContains(t, err, "rot-03")
	require.ErrorContains(t, err, "--allow-offline")
	st, err := rotate(trust.Status, false)
	require.NoError(t, err)
	l, off := st.Pending()
	require.Empty(t, l)
	require.Equal(t, []string{"rot-03"}, off)

	res, err = rotate(trust.Retire, true)
	require.NoError(t, err)
	require.Equal(t, "idle", res.State)
	require.Eventually(t, func() bool { return countCerts(env.Controller.TrustedCAs()) == 1 }, 10*time.Second, 20*time.Millisecond, "the running controller still trusts the retired CA")
	again, err = rotate(trust.Retire, false)
	require.NoError(t, err)
	require.True(t, again.Resumed)

	// After retire: the old CA's certificates and kilnconfigs are refused;
	// the renewed agents and the renewed admin kilnconfig work.
	for _, a := range live {
		hb, err := a.heartbeat(ctx, t, env)
		require.NoError(t, err, "%s after retire", a.host)
		require.Equal(t, 1, countCerts(hb.GetCaBundlePem()), "CAs after retire")
	}
	_, err = agents[2].heartbeat(ctx, t, env)
	require.Error(t, err, "an old-CA agent after retire")
	t.Logf("old-CA agent after retire: %v", err)
	// Even a client that trusts the new CA is refused with a certificate
	// of the old one: the controller no longer accepts it.
	newTrust := env.Controller.TrustedCAs()
	_, err = controllerv1.NewAgentsClient(dialTrusting(t, env, newTrust, agents[2].certPEM, agents[2].keyPEM)).Heartbeat(ctx, &controllerv1.HeartbeatRequest{})
	require.Equal(t, codes.PermissionDenied, code(err), "an old-CA agent certificate after retire, trusting the new CA: %v", err)
	t.Logf("old-CA agent certificate after retire, trusting the new CA: %v", err)
	opCfg, err := kilnconfig.Load(oldOp)
	require.NoError(t, err)
	_, err = controllerv1.NewResourcesClient(dialTrusting(t, env, newTrust, []byte(opCfg.Cert), []byte(opCfg.Key))).List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
	require.Equal(t, codes.PermissionDenied, code(err), "an old-CA operator certificate after retire, trusting the new CA: %v", err)
	t.Logf("old-CA operator certificate after retire, trusting the new CA: %v", err)
	for _, path := range []string{oldAdminPath, oldOp} {
		err := listHosts(path)
		require.Error(t, err, "old kilnconfig %s after retire", filepath.Base(path))
		t.Logf("old kilnconfig %s after retire: %v", filepath.Base(path), err)
	}
	require.Eventually(t, func() bool {
		kc, err := kilnconfig.Load(env.AdminConfigPath)
		return err == nil && countCerts([]byte(kc.CA)) == 1 && issuer(t, []byte(kc.Cert)) == newCA
	}, 10*time.Second, 20*time.Millisecond, "admin kilnconfig renewed onto the new CA")
	require.NoError(t, listHosts(env.AdminConfigPath), "renewed admin kilnconfig")
	require.NoError(t, listHosts(env.ConfigFor(t, "reader", "rita")), "new kilnconfig")

	// Every applied phase is in the audit log, no run that changed nothing.
	entries, err := controllerv1.NewResourcesClient(env.Dial(t, env.AdminConfigPath)).ListAudit(ctx, &controllerv1.ListAuditRequest{})
	require.NoError(t, err)
	var phases []string
	for _, e := range entries.GetEntries() {
		if e.GetVerb() == "rotate-ca" {
			phases = append(phases, strings.SplitN(e.GetMessage(), ":", 2)[0])
		}
	}
	require.Equal(t, []string{"prepare", "switch", "retire"}, phases, "rotate-ca audit entries")
}

// Two rotations started at once apply once: the phase is one etcd
// transaction compared against what each read.
func TestRotateCAConcurrentPrepare(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	env := controllertest.Start(t)
	cfg := datadir.Config{DataDir: env.DataDir}
	var wg sync.WaitGroup
	results := make([]trust.RotateResult, 4)
	errs := make([]error, 4)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = trust.Rotate(ctx, cfg, trust.RotateRequest{Phase: trust.Prepare}, nil)
		}()
	}
	wg.Wait()
	made := map[string]bool{}
	for i, err := range errs {
		if err != nil {
			require.True(t, errdefs.IsUnavailable(err), "concurrent prepare: %v", err)
			continue
		}
		if !results[i].Resumed {
			made[results[i].New] = true
		}
	}
	require.Len(t, made, 1, "new CAs made by 4 concurrent prepares")
	st, err := trust.Rotate(ctx, cfg, trust.RotateRequest{Phase: trust.Status}, nil)
	require.NoError(t, err)
	require.Equal(t, "prepared", st.State)
	require.True(t, made[st.New], "the stored next CA %s is not the one a run reported", st.New)
}

// Two replicas on one etcd, each with its own data directory and a copy of
// the secret key: a rotation run once (here against the etcd, as from a
// third machine) reaches both, and an agent renewed through one is served
// by the other throughout.
func TestRotateCAReachesEveryReplica(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	url, err := store.FreeLoopbackURL()
	require.NoError(t, err)
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: t.TempDir(), ClientURL: url})
	require.NoError(t, err)
	t.Cleanup(emb.Close) // after the replicas stop (cleanups run last first)
	keyFile := filepath.Join(t.TempDir(), "secret.key")
	replica := func() *controllertest.Env {
		return controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
			c.EtcdEndpoints = []string{url}
			c.SecretKeyFile = keyFile
		}))
	}
	a, b := replica(), replica()
	require.Equal(t, a.CAHash, b.CAHash, "replicas share the CA")
	cfg := datadir.Config{EtcdEndpoints: []string{url}, SecretKeyFile: keyFile}
	rotate := func(p trust.Phase) trust.RotateResult {
		res, err := trust.Rotate(ctx, cfg, trust.RotateRequest{Phase: p}, nil)
		require.NoError(t, err, "rotate-ca --phase %s", p)
		return res
	}
	en, err := enroll(ctx, t, a, a.Token(t, "ha-01", time.Hour), "ha-01")
	require.NoError(t, err)
	ag := &caAgent{host: en.host, certPEM: en.certPEM, keyPEM: en.keyPEM, trust: a.CAPEM}
	_, err = ag.heartbeat(ctx, t, b)
	require.NoError(t, err)

	res := rotate(trust.Prepare)
	for name, env := range map[string]*controllertest.Env{"a": a, "b": b} {
		require.Eventually(t, func() bool { return countCerts(env.Controller.TrustedCAs()) == 2 }, 10*time.Second, 20*time.Millisecond, "replica %s trusts the prepared CA", name)
	}
	rotate(trust.Switch)
	for name, env := range map[string]*controllertest.Env{"a": a, "b": b} {
		require.Eventually(t, func() bool { return env.Controller.CA().KeyID() == res.New }, 10*time.Second, 20*time.Millisecond, "replica %s signs with the new CA", name)
	}
	// Renewed through a, heard by b with the new certificate.
	require.NoError(t, ag.renew(ctx, t, a))
	require.Equal(t, res.New, issuer(t, ag.certPEM))
	_, err = ag.heartbeat(ctx, t, b)
	require.NoError(t, err)
	rotate(trust.Retire)
	for name, env := range map[string]*controllertest.Env{"a": a, "b": b} {
		require.Eventually(t, func() bool {
			_, err := ag.heartbeat(ctx, t, env)
			return err == nil && countCerts(env.Controller.TrustedCAs()) == 1
		}, 10*time.Second, 50*time.Millisecond, "replica %s after retire", name)
	}
}
