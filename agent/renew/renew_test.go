package renew_test

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kilnhq/kiln/agent/agenttest"
	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/agent/renew"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// agents signs renewals with a real CA after failing the first failN.
type agents struct {
	controllerv1.UnimplementedAgentsServer
	ca    *pki.CA
	mu    sync.Mutex
	calls int
	failN int
}

func (a *agents) Renew(ctx context.Context, req *controllerv1.RenewRequest) (*controllerv1.RenewResponse, error) {
	a.mu.Lock()
	a.calls++
	fail := a.calls <= a.failN
	a.mu.Unlock()
	if fail {
		return nil, errgrpc.ToGRPC(errdefs.Unavailable("controller: not the leader"))
	}
	cert, err := a.ca.SignCSR(req.GetCsrDer(), pki.RoleAgent, "host-a", time.Hour, time.Now())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.RenewResponse{CertificatePem: cert}, nil
}

func TestLoopRenewsDueCertificate(t *testing.T) {
	ca := agenttest.NewCA(t)
	dir := t.TempDir()
	// A certificate with one minute left of 6 (pki backdates 5 minutes): due.
	key, csr, err := pki.NewKeyAndCSR("host-a")
	require.NoError(t, err)
	cert, err := ca.SignCSR(csr, pki.RoleAgent, "host-a", time.Minute, time.Now())
	require.NoError(t, err)
	id, err := identity.Save(dir, identity.Files{KeyPEM: key, CertPEM: cert, CAPEM: ca.CertPEM(),
		Controller: identity.Controller{Address: "127.0.0.1:1", CAHash: ca.Hash(), Host: "host-a"}})
	require.NoError(t, err)
	require.True(t, id.RenewDue(time.Now()))
	oldSerial := id.Certificate().Leaf.SerialNumber

	srv := &agents{ca: ca, failN: 1}
	s := grpc.NewServer()
	controllerv1.RegisterAgentsServer(s, srv)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })

	ctx, cancel := context.WithCancel(context.Background())
	results := make(chan error, 10)
	done := make(chan error)
	l := &renew.Loop{
		Client: controllerv1.NewAgentsClient(conn), Identity: id, Dir: dir,
		Interval: time.Millisecond,
		Backoff:  backoff.Policy{Base: time.Millisecond, Max: time.Millisecond, Factor: 2},
		Observe:  func(err error) { results <- err },
	}
	go func() { done <- l.Run(ctx) }()
	if err := <-results; !errdefs.IsUnavailable(err) {
		t.Errorf("first renewal = %v, want the controller's Unavailable", err)
	}
	require.NoError(t, <-results, "the retry succeeds")
	cancel()
	require.NoError(t, <-done)

	require.False(t, id.RenewDue(time.Now()), "the renewed certificate is not due")
	require.NotEqual(t, oldSerial, id.Certificate().Leaf.SerialNumber)
	loaded, err := identity.Load(dir)
	require.NoError(t, err)
	require.Equal(t, id.Certificate().Leaf.Raw, loaded.Certificate().Leaf.Raw, "the renewed pair is stored")
	srv.mu.Lock()
	require.Equal(t, 2, srv.calls, "no renewal once the certificate is fresh")
	srv.mu.Unlock()
}

// rotatingAgents signs renewals with a new CA and answers with both CAs,
// as a controller does after kiln-controller rotate-ca --phase switch.
type rotatingAgents struct {
	controllerv1.UnimplementedAgentsServer
	oldCA, newCA *pki.CA
}

func (a *rotatingAgents) Renew(ctx context.Context, req *controllerv1.RenewRequest) (*controllerv1.RenewResponse, error) {
	cert, err := a.newCA.SignCSR(req.GetCsrDer(), pki.RoleAgent, "host-a", time.Hour, time.Now())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.RenewResponse{CertificatePem: cert, CaBundlePem: append(a.oldCA.CertPEM(), a.newCA.CertPEM()...)}, nil
}

// RenewNow renews a certificate that is not due, at once, onto a CA the
// agent did not trust before: the answer's CAs are taken first.
func TestRenewNowOntoANewCA(t *testing.T) {
	oldCA, newCA := agenttest.NewCA(t), agenttest.NewCA(t)
	dir := t.TempDir()
	key, csr, err := pki.NewKeyAndCSR("host-a")
	require.NoError(t, err)
	cert, err := oldCA.SignCSR(csr, pki.RoleAgent, "host-a", 24*time.Hour, time.Now())
	require.NoError(t, err)
	id, err := identity.Save(dir, identity.Files{KeyPEM: key, CertPEM: cert, CAPEM: oldCA.CertPEM(),
		Controller: identity.Controller{Address: "127.0.0.1:1", CAHash: oldCA.Hash(), Host: "host-a"}})
	require.NoError(t, err)
	require.False(t, id.RenewDue(time.Now()))

	s := grpc.NewServer()
	controllerv1.RegisterAgentsServer(s, &rotatingAgents{oldCA: oldCA, newCA: newCA})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })

	ctx, cancel := context.WithCancel(context.Background())
	results := make(chan error, 10)
	done := make(chan error)
	l := &renew.Loop{Client: controllerv1.NewAgentsClient(conn), Identity: id, Dir: dir, Interval: time.Hour,
		Observe: func(err error) { results <- err }}
	go func() { done <- l.Run(ctx) }()
	l.RenewNow()
	select {
	case err := <-results:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("RenewNow: no renewal within 30s (the loop waits for its 1h interval)")
	}
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, newCA.KeyID(), pki.IssuerKeyID(id.Certificate().Leaf), "issuer after RenewNow")
	loaded, err := identity.Load(dir)
	require.NoError(t, err)
	require.Len(t, loaded.CAs(), 2, "CAs stored after the renewal")
}
