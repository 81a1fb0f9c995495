package controller_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestBootServerMintsNoTokenForHEADOrALiveAgent is the attack of issue 12,
// hole 4: anyone on the boot network asks the boot server for a host's
// boot token, with HEAD (which should mint nothing) or while the host's
// enrolled agent is alive, and enrolls with it, replacing the live
// agent's identity. Neither request may mint a token.
func TestBootServerMintsNoTokenForHEADOrALiveAgent(t *testing.T) {
	env := startBoot(t)
	ctx := context.Background()
	st := env.Store()
	tokens := func() int {
		items, _, err := st.List(ctx, enrollment.TokensKind, func() proto.Message { return &typesv1.EnrollmentToken{} }, store.ListOptions{})
		require.NoError(t, err)
		return len(items)
	}
	head := func(path string) int {
		req, err := http.NewRequest(http.MethodHead, env.BootURL+path, nil)
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp.StatusCode
	}

	before := tokens()
	for _, p := range []string{"/boot/ipxe/rack1-01", "/boot/iso/rack1-01.iso"} {
		code := head(p)
		t.Logf("HEAD %s = %d", p, code)
		if code == http.StatusOK {
			t.Errorf("HEAD %s = 200, want a refusal (405, or 404 while no ISO is built)", p)
		}
	}
	if n := tokens(); n != before {
		t.Errorf("HEAD requests minted %d boot tokens, want none", n-before)
	}

	// rack1-02's agent enrolled and heartbeats: the host is live.
	a, err := enroll(ctx, t, env.Env, env.Token(t, "rack1-02", time.Hour), "rack1-02")
	require.NoError(t, err)
	h := &typesv1.Host{}
	rev, err := st.Get(ctx, enrollment.HostsKind, "rack1-02", h)
	require.NoError(t, err)
	h.Status.Agent.LastHeartbeat = timestamppb.Now()
	h.Status.Conditions, _ = conditions.Set(h.Status.Conditions, conditions.New(enrollment.ConditionAgentReachable, conditions.True, "HeartbeatReceived", "test"), time.Now())
	_, err = st.Update(ctx, enrollment.HostsKind, "rack1-02", h, rev)
	require.NoError(t, err)
	_ = a

	before = tokens()
	resp, body := env.get(t, "/boot/ipxe/rack1-02", nil)
	t.Logf("GET /boot/ipxe/rack1-02 with a live agent = %d %s", resp.StatusCode, body)
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("GET /boot/ipxe/rack1-02 with a live agent = %d, want 403", resp.StatusCode)
	}
	if tok := params(string(body))["token"]; tok != "" {
		t.Errorf("the boot server handed out token %s for a host with a live agent", tok[:8])
	}
	if n := tokens(); n != before {
		t.Errorf("GET for a host with a live agent minted %d boot tokens, want none", n-before)
	}

	// Reprovisioning: while the controller boots the host into the agent,
	// its boot media carry a token again.
	rev, err = st.Get(ctx, enrollment.HostsKind, "rack1-02", h)
	require.NoError(t, err)
	h.Status.State = typesv1.HostState_HOST_STATE_PROVISIONING
	h.Status.ProvisioningStep = string(hostlife.StepWaitBootAgent)
	_, err = st.Update(ctx, enrollment.HostsKind, "rack1-02", h, rev)
	require.NoError(t, err)
	resp, body = env.get(t, "/boot/ipxe/rack1-02", nil)
	if resp.StatusCode != http.StatusOK || params(string(body))["token"] == "" {
		t.Errorf("GET /boot/ipxe/rack1-02 while the controller boots it into the agent = %d %s, want 200 with a token", resp.StatusCode, body)
	}
}
