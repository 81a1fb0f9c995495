package controller_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/pem"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/operatorcert"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func host(name, password string) *controllerv1.Resource {
	return &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
		ApiVersion: "kiln.dev/v1",
		Kind:       "Host",
		Metadata:   &typesv1.ObjectMeta{Name: name, Labels: map[string]string{"rack": "r1"}},
		Spec: &typesv1.HostSpec{
			Bmc: &typesv1.BMCSpec{
				Protocol: "ipmi",
				Address:  "127.0.0.1:9001",
				Username: "admin",
				Password: password,
			},
			BootMac: "52:54:00:12:34:56",
			Online:  true,
		},
	}}}
}

func resourcesClient(t *testing.T, env *controllertest.Env, role string) controllerv1.ResourcesClient {
	t.Helper()
	path := env.AdminConfigPath
	if role != "admin" {
		path = env.ConfigFor(t, role, "test-"+role)
	}
	return controllerv1.NewResourcesClient(env.Dial(t, path))
}

func code(err error) codes.Code { return status.Code(err) }

// agent is an enrolled agent identity.
type agent struct {
	host    string
	certPEM []byte
	keyPEM  []byte
}

func enroll(ctx context.Context, t testing.TB, env *controllertest.Env, token, hostName string) (*agent, error) {
	t.Helper()
	keyPEM, csr, err := pki.NewKeyAndCSR(hostName)
	require.NoError(t, err)
	enr := controllerv1.NewEnrollmentClient(env.DialAnonymous(t))
	resp, err := enr.Enroll(ctx, &controllerv1.EnrollRequest{
		Token:  token,
		CsrDer: csr,
		Host:   hostName,
		Facts:  &typesv1.Facts{Hostname: hostName, AgentMode: "boot", BootSource: "pxe"},
	})
	if err != nil {
		return nil, err
	}
	return &agent{host: resp.GetHost(), certPEM: resp.GetCertificatePem(), keyPEM: keyPEM}, nil
}

func TestFirstStartWritesAdminConfigAndSecondStartReusesIt(t *testing.T) {
	dir := t.TempDir()
	start := func(t *testing.T) (string, *kilnconfig.Config) {
		env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.DataDir = dir }))
		cfg, err := kilnconfig.Load(env.AdminConfigPath)
		require.NoError(t, err)
		require.True(t, strings.HasPrefix(env.CAHash, "sha256:"), "CA hash %q", env.CAHash)
		_, err = resourcesClient(t, env, "admin").List(context.Background(), &controllerv1.ListRequest{Kind: "hosts"})
		require.NoError(t, err)
		return env.CAHash, cfg
	}
	// Each Start stops its controller at cleanup; run them in subtests so
	// the first is stopped before the second opens the same data dir.
	var hash1, hash2 string
	var cfg1, cfg2, cfg3 *kilnconfig.Config
	require.True(t, t.Run("first", func(t *testing.T) { hash1, cfg1 = start(t) }))
	require.True(t, t.Run("second", func(t *testing.T) { hash2, cfg2 = start(t) }))
	// A start within 30 days of the admin certificate's expiry replaces it.
	require.True(t, t.Run("near expiry", func(t *testing.T) {
		late := time.Now().Add(340 * 24 * time.Hour)
		env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
			c.DataDir = dir
			c.Clock = func() time.Time { return late }
		}))
		var err error
		cfg3, err = kilnconfig.Load(env.AdminConfigPath)
		require.NoError(t, err)
	}))
	if cfg3.Cert == cfg2.Cert || cfg3.CA != cfg2.CA {
		t.Errorf("start 25 days before the admin certificate expires: certificate kept (or CA changed), want a new certificate from the same CA")
	}
	if hash1 != hash2 {
		t.Errorf("CA hash after restart = %s, want %s", hash2, hash1)
	}
	if cfg1.Cert != cfg2.Cert || cfg1.Key != cfg2.Key {
		t.Errorf("admin certificate changed on restart, want it reused")
	}
	for _, f := range []string{operatorcert.AdminConfigName, "admin/admin.key", "admin/admin.crt", "admin/ca.crt"} {
		st, err := os.Stat(filepath.Join(dir, f))
		require.NoError(t, err)
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s mode = %v, want 0600", f, st.Mode().Perm())
		}
	}
	key, err := os.ReadFile(filepath.Join(dir, "admin/admin.key"))
	require.NoError(t, err)
	if string(key) != cfg3.Key {
		t.Errorf("admin/admin.key differs from the admin kilnconfig's key")
	}
}

func TestApplyIsIdempotent(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "operator")

	resp, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("rack1-01", "s3cret-pw")}})
	require.NoError(t, err)
	require.Len(t, resp.GetResults(), 1)
	if got := resp.GetResults()[0].GetAction(); got != "created" {
		t.Errorf("first Apply action = %q, want created", got)
	}
	first, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "rack1-01"})
	require.NoError(t, err)

	resp, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("rack1-01", "s3cret-pw")}})
	require.NoError(t, err)
	if got := resp.GetResults()[0].GetAction(); got != "unchanged" {
		t.Errorf("second Apply action = %q, want unchanged", got)
	}
	second, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "host", Name: "rack1-01"})
	require.NoError(t, err)
	if a, b := first.GetHost().GetMetadata().GetResourceVersion(), second.GetHost().GetMetadata().GetResourceVersion(); a != b {
		t.Errorf("resource_version after unchanged apply = %s, want %s", b, a)
	}

	changed := host("rack1-01", "")
	changed.GetHost().Spec.RootDiskHint = "/dev/sdb"
	resp, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{changed}})
	require.NoError(t, err)
	if got := resp.GetResults()[0].GetAction(); got != "configured" {
		t.Errorf("Apply of changed spec action = %q, want configured", got)
	}
	third, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "Host", Name: "rack1-01"})
	require.NoError(t, err)
	h := third.GetHost()
	if h.GetMetadata().GetGeneration() != 2 {
		t.Errorf("generation after spec change = %d, want 2", h.GetMetadata().GetGeneration())
	}
	if h.GetSpec().GetBmc().GetPassword() != "" || !h.GetSpec().GetBmc().GetPasswordSet() {
		t.Errorf("Get returned password %q, password_set %v; want \"\" and true (kept from the first apply)",
			h.GetSpec().GetBmc().GetPassword(), h.GetSpec().GetBmc().GetPasswordSet())
	}
	if h.GetApiVersion() != "kiln.dev/v1" || h.GetKind() != "Host" {
		t.Errorf("apiVersion, kind = %q, %q; want kiln.dev/v1, Host", h.GetApiVersion(), h.GetKind())
	}

	// Status sent by a user is ignored.
	withStatus := host("rack1-01", "")
	withStatus.GetHost().Spec.RootDiskHint = "/dev/sdb"
	withStatus.GetHost().Status = &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_PROVISIONED}
	resp, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{withStatus}})
	require.NoError(t, err)
	if got := resp.GetResults()[0].GetAction(); got != "unchanged" {
		t.Errorf("Apply with only a user status action = %q, want unchanged", got)
	}
	fourth, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "rack1-01"})
	require.NoError(t, err)
	if s := fourth.GetHost().GetStatus().GetState(); s == typesv1.HostState_HOST_STATE_PROVISIONED {
		t.Errorf("status.state = %v after applying a user status, want it ignored", s)
	}

	events, err := rc.ListEvents(ctx, &controllerv1.ListEventsRequest{ObjectKind: "hosts", ObjectName: "rack1-01"})
	require.NoError(t, err)
	if len(events.GetEvents()) != 2 {
		t.Errorf("ListEvents(hosts/rack1-01) = %d events, want 2 (created, configured)", len(events.GetEvents()))
	}
}

func TestBMCPasswordIsNeverStoredInTheClear(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "admin")
	const pw = "Pl41nT3xt-BMC-Passw0rd"
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("rack1-02", pw)}})
	require.NoError(t, err)

	resp, err := env.Store().Client().Get(ctx, "/kiln/", clientv3.WithPrefix())
	require.NoError(t, err)
	require.NotEmpty(t, resp.Kvs)
	var sawSecret bool
	for _, kv := range resp.Kvs {
		if strings.Contains(string(kv.Value), pw) || strings.Contains(string(kv.Key), pw) {
			t.Errorf("etcd key %s holds the BMC password in the clear", kv.Key)
		}
		if string(kv.Key) == "/kiln/v1/secrets/bmc/rack1-02" {
			sawSecret = true
		}
	}
	if !sawSecret {
		t.Errorf("no sealed secret at /kiln/v1/secrets/bmc/rack1-02")
	}
	got, err := env.Store().GetSecret(ctx, "bmc/rack1-02")
	require.NoError(t, err)
	if string(got) != pw {
		t.Errorf("GetSecret(bmc/rack1-02) did not return the applied password")
	}
	// Nor does any API read return it.
	r, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "rack1-02"})
	require.NoError(t, err)
	if strings.Contains(r.String(), pw) {
		t.Errorf("Get returned the BMC password")
	}
}

func TestReaderCannotMutate(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "reader")
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("rack1-03", "")}})
	if code(err) != codes.PermissionDenied {
		t.Errorf("reader Apply = %v, want PermissionDenied", err)
	}
	_, err = rc.Delete(ctx, &controllerv1.DeleteRequest{Kind: "hosts", Name: "rack1-03"})
	if code(err) != codes.PermissionDenied {
		t.Errorf("reader Delete = %v, want PermissionDenied", err)
	}
	_, err = rc.CreateToken(ctx, &controllerv1.CreateTokenRequest{})
	if code(err) != codes.PermissionDenied {
		t.Errorf("reader CreateToken = %v, want PermissionDenied", err)
	}
	_, err = rc.List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
	if err != nil {
		t.Errorf("reader List = %v, want nil", err)
	}
	// Nothing without a certificate but enrollment.
	anon := controllerv1.NewResourcesClient(env.DialAnonymous(t))
	_, err = anon.List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
	if code(err) != codes.PermissionDenied {
		t.Errorf("anonymous List = %v, want PermissionDenied", err)
	}
}

func TestEnrollmentTokens(t *testing.T) {
	ctx := context.Background()
	var now atomic.Pointer[time.Time]
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	now.Store(&t0)
	env := controllertest.Start(t, controllertest.WithClock(func() time.Time { return *now.Load() }))

	t.Run("token via API", func(t *testing.T) {
		rc := resourcesClient(t, env, "operator")
		resp, err := rc.CreateToken(ctx, &controllerv1.CreateTokenRequest{Ttl: "10m", Host: "api-01"})
		require.NoError(t, err)
		if resp.GetCaHash() != env.CAHash {
			t.Errorf("CreateToken ca_hash = %q, want %q", resp.GetCaHash(), env.CAHash)
		}
		a, err := enroll(ctx, t, env, resp.GetToken(), "api-01")
		require.NoError(t, err)
		cert := parseCert(t, a.certPEM)
		role, name, err := pki.Identity(cert)
		require.NoError(t, err)
		if role != pki.RoleAgent || name != "api-01" {
			t.Errorf("enrolled certificate identity = %s/%s, want agent/api-01", role, name)
		}
		h, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "api-01"})
		require.NoError(t, err)
		if s := h.GetHost().GetStatus().GetState(); s != typesv1.HostState_HOST_STATE_REGISTERING {
			t.Errorf("host state after enroll = %v, want REGISTERING", s)
		}
		if h.GetHost().GetStatus().GetFacts().GetBootSource() != "pxe" {
			t.Errorf("host facts not recorded: %v", h.GetHost().GetStatus().GetFacts())
		}
	})

	t.Run("reuse refused", func(t *testing.T) {
		tok := env.Token(t, "", time.Hour)
		_, err := enroll(ctx, t, env, tok, "reuse-01")
		require.NoError(t, err)
		_, err = enroll(ctx, t, env, tok, "reuse-02")
		if code(err) != codes.PermissionDenied {
			t.Errorf("second Enroll with one token = %v, want PermissionDenied", err)
		}
	})

	t.Run("an unbound token cannot take over an enrolled host", func(t *testing.T) {
		// Hole 6: a token for no host in particular re-enrolled a working
		// host, handing its identity to whoever held the token.
		victim, err := enroll(ctx, t, env, env.Token(t, "", time.Hour), "taken-01")
		require.NoError(t, err)
		_, err = enroll(ctx, t, env, env.Token(t, "", time.Hour), "taken-01")
		require.Equal(t, codes.PermissionDenied, code(err), "an unbound token re-enrolled an enrolled host: %v", err)
		require.ErrorContains(t, err, "kilnctl token create --host taken-01")
		t.Logf("refused: %v", err)
		// The victim's certificate still works.
		_, err = controllerv1.NewAgentsClient(env.DialCert(t, victim.certPEM, victim.keyPEM)).Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444", Version: "test"})
		require.NoError(t, err)
		// A token bound to the host may enroll it again.
		_, err = enroll(ctx, t, env, env.Token(t, "taken-01", time.Hour), "taken-01")
		require.NoError(t, err)
	})

	t.Run("the same key retrying gets its certificate again", func(t *testing.T) {
		// An agent whose answer was lost (the controller died after using
		// the token) asks again with the same CSR: same winner, same host.
		tok := env.Token(t, "", time.Hour)
		_, csr, err := pki.NewKeyAndCSR("retry-01")
		require.NoError(t, err)
		enr := controllerv1.NewEnrollmentClient(env.DialAnonymous(t))
		req := &controllerv1.EnrollRequest{Token: tok, CsrDer: csr, Host: "retry-01"}
		first, err := enr.Enroll(ctx, req)
		require.NoError(t, err)
		again, err := enr.Enroll(ctx, req)
		require.NoError(t, err, "Enroll retried with the same CSR")
		c1, c2 := parseCert(t, first.GetCertificatePem()), parseCert(t, again.GetCertificatePem())
		if again.GetHost() != "retry-01" || !bytes.Equal(c1.RawSubjectPublicKeyInfo, c2.RawSubjectPublicKeyInfo) {
			t.Errorf("retried Enroll = host %q, same key %v; want retry-01 and the same key", again.GetHost(), bytes.Equal(c1.RawSubjectPublicKeyInfo, c2.RawSubjectPublicKeyInfo))
		}
		// Another key, or the same key for another host, is refused.
		if _, err := enroll(ctx, t, env, tok, "retry-01"); code(err) != codes.PermissionDenied {
			t.Errorf("Enroll with a used token and another key = %v, want PermissionDenied", err)
		}
		if _, err := enr.Enroll(ctx, &controllerv1.EnrollRequest{Token: tok, CsrDer: csr, Host: "retry-02"}); code(err) != codes.PermissionDenied {
			t.Errorf("Enroll with a used token, same key, another host = %v, want PermissionDenied", err)
		}
	})

	t.Run("concurrent use has one winner", func(t *testing.T) {
		tok := env.Token(t, "", time.Hour)
		const n = 8
		var wins atomic.Int32
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := enroll(ctx, t, env, tok, "race-0"+string(rune('0'+i))); err == nil {
					wins.Add(1)
				} else if code(err) != codes.PermissionDenied {
					t.Errorf("concurrent Enroll = %v, want success or PermissionDenied", err)
				}
			}()
		}
		wg.Wait()
		if got := wins.Load(); got != 1 {
			t.Errorf("%d concurrent Enrolls with one token: %d succeeded, want 1", n, got)
		}
	})

	t.Run("expired refused", func(t *testing.T) {
		tok := env.Token(t, "", 10*time.Minute)
		later := t0.Add(11 * time.Minute)
		now.Store(&later)
		defer now.Store(&t0)
		_, err := enroll(ctx, t, env, tok, "late-01")
		if code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "expired") {
			t.Errorf("Enroll with expired token = %v, want PermissionDenied ... expired", err)
		}
	})

	t.Run("bound token refuses another host", func(t *testing.T) {
		tok := env.Token(t, "host-a", time.Hour)
		_, err := enroll(ctx, t, env, tok, "host-b")
		if code(err) != codes.PermissionDenied {
			t.Errorf("Enroll host-b with token bound to host-a = %v, want PermissionDenied", err)
		}
		a, err := enroll(ctx, t, env, tok, "host-a")
		require.NoError(t, err, "the refused attempt must not burn the token")
		if a.host != "host-a" {
			t.Errorf("Enroll host = %q, want host-a", a.host)
		}
	})

	t.Run("wrong secret and garbage refused", func(t *testing.T) {
		tok := env.Token(t, "", time.Hour)
		id, _, _ := strings.Cut(tok, ".")
		for _, bad := range []string{id + ".0000000000000000", "not-a-token", ""} {
			_, err := enroll(ctx, t, env, bad, "bad-01")
			if c := code(err); c != codes.PermissionDenied && c != codes.InvalidArgument {
				t.Errorf("Enroll(%q) = %v, want PermissionDenied or InvalidArgument", bad, err)
			}
			if err != nil && strings.Contains(err.Error(), tok[7:]) {
				t.Errorf("Enroll error contains the token secret: %v", err)
			}
		}
	})

	t.Run("token secret is stored only as a hash", func(t *testing.T) {
		tok := env.Token(t, "", time.Hour)
		_, secret, _ := strings.Cut(tok, ".")
		resp, err := env.Store().Client().Get(ctx, "/kiln/", clientv3.WithPrefix())
		require.NoError(t, err)
		for _, kv := range resp.Kvs {
			if strings.Contains(string(kv.Value), secret) {
				t.Errorf("etcd key %s holds a token secret in the clear", kv.Key)
			}
		}
	})
}

func parseCert(t testing.TB, certPEM []byte) *x509.Certificate {
	t.Helper()
	b, _ := pem.Decode(certPEM)
	require.NotNil(t, b)
	c, err := x509.ParseCertificate(b.Bytes)
	require.NoError(t, err)
	return c
}

func TestAgentIdentity(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	a, err := enroll(ctx, t, env, env.Token(t, "agent-a", time.Hour), "agent-a")
	require.NoError(t, err)
	b, err := enroll(ctx, t, env, env.Token(t, "agent-b", time.Hour), "agent-b")
	require.NoError(t, err)
	connA := env.DialCert(t, a.certPEM, a.keyPEM)

	// The agent cannot use Resources at all.
	_, err = controllerv1.NewResourcesClient(connA).List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
	if code(err) != codes.PermissionDenied {
		t.Errorf("agent List = %v, want PermissionDenied", err)
	}

	// A heartbeat always lands on the caller's own host, whatever it says.
	facts := &typesv1.Facts{Hostname: "agent-b", Kernel: "6.1.0-evil"}
	resp, err := controllerv1.NewAgentsClient(connA).Heartbeat(ctx, &controllerv1.HeartbeatRequest{
		AgentAddress: "127.0.0.1:7444", Facts: facts, Version: "test",
	})
	require.NoError(t, err)
	if resp.GetHost() != "agent-a" {
		t.Errorf("Heartbeat host = %q, want agent-a (from the certificate)", resp.GetHost())
	}
	rc := resourcesClient(t, env, "reader")
	hb, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "agent-b"})
	require.NoError(t, err)
	if hb.GetHost().GetStatus().GetFacts().GetKernel() == "6.1.0-evil" {
		t.Errorf("agent-a's heartbeat changed agent-b's facts")
	}
	ha, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "agent-a"})
	require.NoError(t, err)
	st := ha.GetHost().GetStatus()
	if st.GetAgent().GetAddress() != "127.0.0.1:7444" || st.GetAgent().GetLastHeartbeat() == nil {
		t.Errorf("agent-a status.agent = %v, want address 127.0.0.1:7444 and a last heartbeat", st.GetAgent())
	}
	if !conditions.IsTrue(st.GetConditions(), "AgentReachable") {
		t.Errorf("agent-a AgentReachable not True after heartbeat: %v", st.GetConditions())
	}

	// The controller's own client identity may not call the API either.
	own := env.Controller.Certificate()
	require.NotNil(t, own.Leaf)
	if role, name, err := pki.Identity(own.Leaf); err != nil || role != pki.RoleController || name != pki.ControllerName {
		t.Errorf("controller certificate identity = %s/%s (%v), want controller/%s", role, name, err, pki.ControllerName)
	}
	ctrlCert, ctrlKey, err := env.Controller.CA().Issue(pki.RoleController, pki.ControllerName, nil, time.Hour, time.Now())
	require.NoError(t, err)
	connC := env.DialCert(t, ctrlCert, ctrlKey)
	_, err = controllerv1.NewAgentsClient(connC).Heartbeat(ctx, &controllerv1.HeartbeatRequest{})
	if code(err) != codes.PermissionDenied {
		t.Errorf("controller-role Heartbeat = %v, want PermissionDenied", err)
	}
	_, err = controllerv1.NewResourcesClient(connC).Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "agent-a"})
	if code(err) != codes.PermissionDenied {
		t.Errorf("controller-role Get = %v, want PermissionDenied", err)
	}
	_ = b
}

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestStartWaitsForEtcd(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for etcd retries: skipped with -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	url, err := store.FreeLoopbackURL()
	require.NoError(t, err)
	var logs syncBuffer
	c, err := controller.New(controller.Config{
		DataDir:       t.TempDir(),
		ListenAddr:    "127.0.0.1:0",
		EtcdEndpoints: []string{url},
	}, slog.New(slog.NewTextHandler(&logs, nil)))
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()

	// The controller retries while nothing answers at url...
	for !strings.Contains(logs.String(), "etcd unavailable, retrying") {
		select {
		case err := <-done:
			t.Fatalf("controller exited while etcd was down: %v", err)
		case <-ctx.Done():
			t.Fatalf("controller never reported waiting for etcd; log:\n%s", logs.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
	// ...and serves once etcd comes up there.
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: t.TempDir(), ClientURL: url})
	require.NoError(t, err)
	defer emb.Close()
	select {
	case <-c.Ready():
	case err := <-done:
		t.Fatalf("controller exited: %v; log:\n%s", err, logs.String())
	case <-ctx.Done():
		t.Fatalf("controller not ready after etcd came up; log:\n%s", logs.String())
	}
	// Stop the controller while its etcd still runs.
	cancel()
	require.NoError(t, <-done)
	done <- nil
}

func TestShutdownEndsWatchesWithUnavailable(t *testing.T) {
	ctx, cancelTest := context.WithTimeout(context.Background(), time.Minute)
	defer cancelTest()
	c, err := controller.New(controller.Config{DataDir: t.TempDir(), ListenAddr: "127.0.0.1:0"}, nil)
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	defer func() { stop(); <-done }()
	select {
	case <-c.Ready():
	case err := <-done:
		t.Fatalf("controller: %v", err)
	}
	cfg, err := kilnconfig.Load(c.AdminConfigPath())
	require.NoError(t, err)
	tc, err := cfg.TLS()
	require.NoError(t, err)
	conn, err := grpc.NewClient(cfg.Server, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	require.NoError(t, err)
	defer conn.Close()
	stream, err := controllerv1.NewResourcesClient(conn).Watch(ctx, &controllerv1.WatchRequest{Kind: "hosts"})
	require.NoError(t, err)
	_, err = stream.Header()
	require.NoError(t, err)

	stop()
	_, err = stream.Recv()
	// The watch is ended by the controller, not cut by a forced stop.
	if code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), "shutting down") {
		t.Errorf("Watch Recv after shutdown = %v, want Unavailable: controller is shutting down", err)
	}
	require.NoError(t, <-done)
	done <- nil
}

func TestServerCertificateRenewedBeforeExpiry(t *testing.T) {
	var now atomic.Pointer[time.Time]
	t0 := time.Now()
	now.Store(&t0)
	env := controllertest.Start(t, controllertest.WithClock(func() time.Time { return *now.Load() }))
	first := env.Controller.Certificate().Leaf
	require.NotNil(t, first)

	// Eight months later the year-long certificate has a third left: the
	// next handshake gets a new one.
	later := t0.Add(250 * 24 * time.Hour)
	now.Store(&later)
	second := env.Controller.Certificate().Leaf
	if second.SerialNumber.Cmp(first.SerialNumber) == 0 {
		t.Errorf("controller certificate not renewed with %v left", first.NotAfter.Sub(later).Round(time.Hour))
	}
	if !second.NotAfter.After(first.NotAfter) {
		t.Errorf("renewed certificate expires %v, not after the old %v", second.NotAfter, first.NotAfter)
	}
}

// TestStepTimeoutsChecked: New refuses a step timeout for a step that does
// not exist (naming the steps) or one that is not positive, and takes a
// step name in any case.
func TestStepTimeoutsChecked(t *testing.T) {
	_, err := controller.New(controller.Config{DataDir: t.TempDir(), StepTimeouts: map[hostlife.Step]time.Duration{"Lay": time.Minute}}, nil)
	require.True(t, errdefs.IsInvalidArgument(err), "%v", err)
	require.ErrorContains(t, err, "LayImage")
	_, err = controller.New(controller.Config{DataDir: t.TempDir(), StepTimeouts: map[hostlife.Step]time.Duration{hostlife.StepLayImage: 0}}, nil)
	require.True(t, errdefs.IsInvalidArgument(err), "%v", err)
	_, err = controller.New(controller.Config{DataDir: t.TempDir(), StepTimeouts: map[hostlife.Step]time.Duration{"layimage": time.Minute}}, nil)
	require.NoError(t, err)
}
