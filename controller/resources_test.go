package controller_test

import (
	"context"
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestListSelectorAndPaging(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "admin")
	var objs []*controllerv1.Resource
	for i := range 25 {
		h := host(fmt.Sprintf("page-%02d", i), "")
		rack := "r1"
		if i%3 == 0 {
			rack = "r2"
		}
		h.GetHost().Metadata.Labels = map[string]string{"rack": rack}
		objs = append(objs, h)
	}
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: objs})
	require.NoError(t, err)

	tests := []struct {
		name     string
		selector map[string]string
		limit    int64
		want     int
	}{
		{"all in one page", nil, 0, 25},
		{"all in pages of 10", nil, 10, 25},
		{"all in pages of 1", nil, 1, 25},
		{"rack r2 in pages of 4", map[string]string{"rack": "r2"}, 4, 9},
		{"rack r1 unpaged", map[string]string{"rack": "r1"}, 0, 16},
		{"no match", map[string]string{"rack": "r9"}, 5, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var names []string
			cont := ""
			for pages := 0; ; pages++ {
				require.Less(t, pages, 100, "paging does not end")
				resp, err := rc.List(ctx, &controllerv1.ListRequest{Kind: "hosts", LabelSelector: tt.selector, Limit: tt.limit, Continue: cont})
				require.NoError(t, err)
				if tt.limit > 0 && int64(len(resp.GetItems())) > tt.limit {
					t.Errorf("List(limit %d) returned %d items", tt.limit, len(resp.GetItems()))
				}
				for _, it := range resp.GetItems() {
					if v, ok := tt.selector["rack"]; ok && it.GetHost().GetMetadata().GetLabels()["rack"] != v {
						t.Errorf("List(%v) returned %s with labels %v", tt.selector, it.GetHost().GetMetadata().GetName(), it.GetHost().GetMetadata().GetLabels())
					}
					names = append(names, it.GetHost().GetMetadata().GetName())
				}
				if cont = resp.GetContinue(); cont == "" {
					break
				}
			}
			if len(names) != tt.want {
				t.Errorf("List(%v, limit %d) = %d items, want %d", tt.selector, tt.limit, len(names), tt.want)
			}
			if !sort.StringsAreSorted(names) {
				t.Errorf("List(%v, limit %d) not in name order: %v", tt.selector, tt.limit, names)
			}
			seen := map[string]bool{}
			for _, n := range names {
				if seen[n] {
					t.Errorf("List(%v, limit %d) returned %s twice", tt.selector, tt.limit, n)
				}
				seen[n] = true
			}
		})
	}

	_, err = rc.List(ctx, &controllerv1.ListRequest{Kind: "gadgets"})
	if code(err) != codes.InvalidArgument {
		t.Errorf("List(gadgets) = %v, want InvalidArgument", err)
	}
}

// TestListOfLargeObjectsIsPaged is the attack of issue 12 (hole 6): a few
// hosts, each within every field bound but large (1,024 long labels, about
// 290 kB), made a page of `kilnctl get hosts` larger than the 4 MiB a gRPC
// client accepts, so listing hosts failed for everyone. A List response now
// ends at 2 MiB with a continue token, whatever limit the caller asked for.
func TestListOfLargeObjectsIsPaged(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "admin")
	prefix := strings.Repeat("a", 60) + "." + strings.Repeat("b", 60) + "." + strings.Repeat("c", 60) + ".example.com/"
	const hosts = 16
	for i := range hosts {
		h := host(fmt.Sprintf("big-%02d", i), "")
		labels := map[string]string{}
		for j := range 1024 {
			labels[fmt.Sprintf("%sk%04d", prefix, j)] = strings.Repeat("v", 63)
		}
		h.GetHost().Metadata.Labels = labels
		_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{h}})
		require.NoError(t, err, "apply host %d", i)
	}

	// kilnctl get hosts asks for pages of 500.
	var names []string
	cont := ""
	pages := 0
	for ; ; pages++ {
		require.Less(t, pages, 100, "paging does not end")
		resp, err := rc.List(ctx, &controllerv1.ListRequest{Kind: "hosts", Limit: 500, Continue: cont})
		require.NoError(t, err, "List(hosts, limit 500) page %d of %d hosts of about 290 kB each", pages, hosts)
		for _, it := range resp.GetItems() {
			names = append(names, it.GetHost().GetMetadata().GetName())
		}
		if cont = resp.GetContinue(); cont == "" {
			break
		}
	}
	if len(names) != hosts || !sort.StringsAreSorted(names) {
		t.Errorf("paged List = %d hosts %v, want %d in name order", len(names), names, hosts)
	}
	if pages < 1 {
		t.Errorf("List of %d hosts of about 290 kB in %d page(s), want the response cut at 2 MiB", hosts, pages+1)
	}
	t.Logf("%d hosts of about 290 kB listed in %d pages", hosts, pages+1)
}

// TestFailedApplySaysWhatItStored is the attack of issue 12 (hole 6): a
// parallel apply of 200 hosts with one failing host stored 199 of them
// while the error said nothing of it (and the docs promised the rest was
// not stored). Now no write starts after the failure, and the error names
// how many were stored, which the store confirms.
func TestFailedApplySaysWhatItStored(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "admin")
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("fleet-100", "")}})
	require.NoError(t, err)

	const n = 200
	var objs []*controllerv1.Resource
	for i := range n {
		h := host(fmt.Sprintf("fleet-%03d", i), "")
		if i == 100 {
			h.GetHost().Metadata.ResourceVersion = "1" // stale: fails with Conflict
		}
		objs = append(objs, h)
	}
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: objs})
	require.Error(t, err, "apply of 200 hosts, one with a stale resourceVersion")
	if code(err) != codes.Aborted {
		t.Errorf("apply error code = %v, want Aborted (the stale host's Conflict, kept through the wrapping)", code(err))
	}
	msg := err.Error()
	t.Logf("apply: %s", msg)

	stored := 0
	cont := ""
	for {
		resp, err := rc.List(ctx, &controllerv1.ListRequest{Kind: "hosts", Limit: 500, Continue: cont})
		require.NoError(t, err)
		stored += len(resp.GetItems())
		if cont = resp.GetContinue(); cont == "" {
			break
		}
	}
	created := stored - 1 // fleet-100 existed before
	want := fmt.Sprintf("%d of %d resources of this request stored before it stopped", created, n)
	if !strings.Contains(msg, want) {
		t.Errorf("apply error = %q, want it to say %q (the store holds %d new hosts)", msg, want, created)
	}
	if !strings.Contains(msg, "resource 101 of the request failed") || !strings.Contains(msg, `Host "fleet-100"`) {
		t.Errorf("apply error = %q, want it to name host fleet-100, resource 101, as the failure", msg)
	}
	// Writes after the failure: at most the ones already in flight.
	if created > 100+8 {
		t.Errorf("%d hosts stored after a failure at resource 101, want no write started after it (at most 8 in flight)", created)
	}
	// The same request with the failure fixed stores the rest; the stored
	// ones are unchanged.
	objs[100].GetHost().Metadata.ResourceVersion = ""
	resp, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: objs})
	require.NoError(t, err)
	unchanged := 0
	for _, r := range resp.GetResults() {
		if r.GetAction() == "unchanged" {
			unchanged++
		}
	}
	if unchanged != created+1 {
		t.Errorf("apply again: %d unchanged, want %d (the ones stored before, and fleet-100)", unchanged, created+1)
	}
}

func TestApplyRefusesInvalidAndStale(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "admin")

	bad := host("Not_A_Name", "")
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{bad}})
	if code(err) != codes.InvalidArgument {
		t.Errorf("Apply(invalid name) = %v, want InvalidArgument", err)
	}
	// One bad resource refuses the whole request before anything is stored.
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("good-01", ""), bad}})
	if code(err) != codes.InvalidArgument {
		t.Errorf("Apply(good, invalid) = %v, want InvalidArgument", err)
	}
	_, err = rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "good-01"})
	if code(err) != codes.NotFound {
		t.Errorf("Get(good-01) after a refused Apply = %v, want NotFound", err)
	}
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{{}}})
	if code(err) != codes.InvalidArgument {
		t.Errorf("Apply(empty resource) = %v, want InvalidArgument", err)
	}

	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("stale-01", "")}})
	require.NoError(t, err)
	stale := host("stale-01", "")
	stale.GetHost().Metadata.ResourceVersion = "1"
	stale.GetHost().Spec.RootDiskHint = "/dev/sdc"
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{stale}})
	if code(err) != codes.Aborted {
		t.Errorf("Apply with stale resourceVersion = %v, want Aborted (conflict)", err)
	}

	dry := host("dry-01", "pw")
	resp, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{dry}, DryRun: true})
	require.NoError(t, err)
	if resp.GetResults()[0].GetAction() != "created" {
		t.Errorf("dry-run Apply action = %q, want created", resp.GetResults()[0].GetAction())
	}
	_, err = rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "dry-01"})
	if code(err) != codes.NotFound {
		t.Errorf("Get after dry-run Apply = %v, want NotFound", err)
	}
	_, err = env.Store().GetSecret(ctx, "bmc/dry-01")
	if err == nil {
		t.Errorf("dry-run Apply stored a BMC secret")
	}
}

func TestDeleteRemovesHostAndSecret(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "operator")
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("del-01", "pw")}})
	require.NoError(t, err)
	_, err = rc.Delete(ctx, &controllerv1.DeleteRequest{Kind: "hosts", Name: "del-01"})
	require.NoError(t, err)
	_, err = rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "del-01"})
	if code(err) != codes.NotFound {
		t.Errorf("Get after Delete = %v, want NotFound", err)
	}
	if _, err := env.Store().GetSecret(ctx, "bmc/del-01"); err == nil {
		t.Errorf("BMC secret of deleted host still stored")
	}
	_, err = rc.Delete(ctx, &controllerv1.DeleteRequest{Kind: "hosts", Name: "del-01"})
	if code(err) != codes.NotFound {
		t.Errorf("second Delete = %v, want NotFound", err)
	}
}

func TestWatch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "reader")
	admin := resourcesClient(t, env, "admin")

	stream, err := rc.Watch(ctx, &controllerv1.WatchRequest{Kind: "hosts"})
	require.NoError(t, err)
	// The stream is established once the server has sent headers.
	_, err = stream.Header()
	require.NoError(t, err)
	// Give the server's etcd watch a moment to be created: the store
	// watch starts from "now", so a write racing its creation could be
	// missed. Retry the write until the watch sees it instead of sleeping.
	got := make(chan *controllerv1.WatchEvent, 16)
	go func() {
		for {
			ev, err := stream.Recv()
			if err != nil {
				close(got)
				return
			}
			got <- ev
		}
	}()
	// Once any event arrives the watch is live. The event may be a
	// MODIFIED of an earlier host (the controller's lifecycle writes its
	// status), so the ADDED check is on a host applied after that.
	for i, live := 0, false; !live; i++ {
		require.Less(t, i, 50, "watch saw nothing")
		_, err = admin.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host(fmt.Sprintf("watch-%02d", i), "pw")}})
		require.NoError(t, err)
		select {
		case <-got:
			live = true
		case <-time.After(500 * time.Millisecond):
		}
	}
	const name = "watch-live"
	_, err = admin.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host(name, "pw")}})
	require.NoError(t, err)
	var first *controllerv1.WatchEvent
	for first == nil {
		select {
		case ev := <-got:
			if ev.GetResource().GetHost().GetMetadata().GetName() == name {
				first = ev
			}
		case <-ctx.Done():
			t.Fatal("no watch event for a host applied while the watch was live")
		}
	}
	if first.GetType() != "ADDED" {
		t.Errorf("first watch event type = %q, want ADDED", first.GetType())
	}
	if first.GetResource().GetHost().GetSpec().GetBmc().GetPassword() != "" {
		t.Errorf("watch event carries a BMC password")
	}
	changed := host(name, "")
	changed.GetHost().Spec.RootDiskHint = "/dev/nvme0n1"
	_, err = admin.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{changed}})
	require.NoError(t, err)
	_, err = admin.Delete(ctx, &controllerv1.DeleteRequest{Kind: "hosts", Name: name})
	require.NoError(t, err)
	// The lifecycle may write the host's status in between: what must
	// show is the spec change as MODIFIED, then DELETED, last.
	var types []string
	sawChange := false
	for len(types) == 0 || types[len(types)-1] != "DELETED" {
		select {
		case ev := <-got:
			h := ev.GetResource().GetHost()
			if h.GetMetadata().GetName() != name {
				continue
			}
			types = append(types, ev.GetType())
			if ev.GetType() == "MODIFIED" && h.GetSpec().GetRootDiskHint() == "/dev/nvme0n1" {
				sawChange = true
			}
		case <-ctx.Done():
			t.Fatalf("watch events for %s: got %v before timeout", name, types)
		}
	}
	if !sawChange {
		t.Errorf("watch events after apply and delete = %v, want the changed spec as MODIFIED before DELETED", types)
	}
}

func TestSilentAgentMarkedUnreachable(t *testing.T) {
	ctx := context.Background()
	var now atomic.Pointer[time.Time]
	t0 := time.Now()
	now.Store(&t0)
	env := controllertest.Start(t,
		controllertest.WithClock(func() time.Time { return *now.Load() }),
		controllertest.WithConfig(func(c *controller.Config) {
			c.ReconcileInterval = 100 * time.Millisecond
			c.HeartbeatInterval = 10 * time.Second
		}))
	a, err := enroll(ctx, t, env, env.Token(t, "quiet-01", time.Hour), "quiet-01")
	require.NoError(t, err)
	agents := controllerv1.NewAgentsClient(env.DialCert(t, a.certPEM, a.keyPEM))
	hb, err := agents.Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444"})
	require.NoError(t, err)
	if hb.GetIntervalSeconds() != 10 {
		t.Errorf("Heartbeat interval = %d, want 10", hb.GetIntervalSeconds())
	}
	rc := resourcesClient(t, env, "reader")
	get := func() *typesv1.Host {
		r, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "quiet-01"})
		require.NoError(t, err)
		return r.GetHost()
	}
	require.True(t, conditions.IsTrue(get().GetStatus().GetConditions(), "AgentReachable"))

	// 31 s of silence with an allowed silence of 3 heartbeats (30 s).
	later := t0.Add(31 * time.Second)
	now.Store(&later)
	deadline := time.Now().Add(30 * time.Second)
	for {
		c := conditions.Get(get().GetStatus().GetConditions(), "AgentReachable")
		if c.GetStatus() == conditions.False {
			if c.GetReason() != "HeartbeatMissed" {
				t.Errorf("AgentReachable reason = %q, want HeartbeatMissed", c.GetReason())
			}
			break
		}
		require.True(t, time.Now().Before(deadline), "host never marked AgentReachable=False")
		time.Sleep(50 * time.Millisecond)
	}
	// A heartbeat brings it back.
	_, err = agents.Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444"})
	require.NoError(t, err)
	if !conditions.IsTrue(get().GetStatus().GetConditions(), "AgentReachable") {
		t.Errorf("AgentReachable not True after a new heartbeat")
	}
	evs, err := rc.ListEvents(ctx, &controllerv1.ListEventsRequest{ObjectKind: "Host", ObjectName: "quiet-01"})
	require.NoError(t, err)
	var reasons []string
	for _, e := range evs.GetEvents() {
		reasons = append(reasons, e.GetReason())
	}
	require.Contains(t, reasons, "HeartbeatMissed")
	require.Contains(t, reasons, "Enrolled")
}

func TestRenew(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	a, err := enroll(ctx, t, env, env.Token(t, "renew-01", time.Hour), "renew-01")
	require.NoError(t, err)
	_, csr, err := pki.NewKeyAndCSR("renew-01")
	require.NoError(t, err)
	resp, err := controllerv1.NewAgentsClient(env.DialCert(t, a.certPEM, a.keyPEM)).Renew(ctx, &controllerv1.RenewRequest{CsrDer: csr})
	require.NoError(t, err)
	cert := parseCert(t, resp.GetCertificatePem())
	role, name, err := pki.Identity(cert)
	require.NoError(t, err)
	if role != pki.RoleAgent || name != "renew-01" {
		t.Errorf("renewed certificate identity = %s/%s, want agent/renew-01", role, name)
	}
	if cert.SerialNumber.Cmp(parseCert(t, a.certPEM).SerialNumber) == 0 {
		t.Errorf("renewed certificate has the old serial")
	}
}

func TestExpiredTokensAreDeleted(t *testing.T) {
	ctx := context.Background()
	var now atomic.Pointer[time.Time]
	t0 := time.Now()
	now.Store(&t0)
	env := controllertest.Start(t,
		controllertest.WithClock(func() time.Time { return *now.Load() }),
		controllertest.WithConfig(func(c *controller.Config) { c.ReconcileInterval = 100 * time.Millisecond }))
	tok := env.Token(t, "", time.Hour)
	id, _, _ := strings.Cut(tok, ".")
	keep := env.Token(t, "", 48*time.Hour)
	keepID, _, _ := strings.Cut(keep, ".")

	later := t0.Add(26 * time.Hour)
	now.Store(&later)
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := env.Store().Get(ctx, "tokens", id, &typesv1.EnrollmentToken{})
		if errdefs.IsNotFound(err) {
			break
		}
		require.NoError(t, err)
		require.True(t, time.Now().Before(deadline), "token expired 25h ago never deleted")
		time.Sleep(50 * time.Millisecond)
	}
	_, err := env.Store().Get(ctx, "tokens", keepID, &typesv1.EnrollmentToken{})
	if err != nil {
		t.Errorf("Get(unexpired token) = %v, want it kept", err)
	}
}

func TestApplyKeepsControllerStatus(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	_, err := enroll(ctx, t, env, env.Token(t, "byoh-01", time.Hour), "byoh-01")
	require.NoError(t, err)
	rc := resourcesClient(t, env, "operator")
	before, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "byoh-01"})
	require.NoError(t, err)

	resp, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("byoh-01", "pw")}})
	require.NoError(t, err)
	if got := resp.GetResults()[0].GetAction(); got != "configured" {
		t.Errorf("Apply over an enrolled host: action %q, want configured", got)
	}
	after, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "byoh-01"})
	require.NoError(t, err)
	h := after.GetHost()
	if h.GetStatus().GetState() != typesv1.HostState_HOST_STATE_REGISTERING || h.GetStatus().GetAgent().GetCertificateSerial() == "" {
		t.Errorf("status after Apply = %v, want the enrolled status kept", h.GetStatus())
	}
	if h.GetMetadata().GetUid() != before.GetHost().GetMetadata().GetUid() {
		t.Errorf("uid changed by Apply: %s -> %s", before.GetHost().GetMetadata().GetUid(), h.GetMetadata().GetUid())
	}
	if h.GetMetadata().GetGeneration() != 2 || h.GetSpec().GetBmc().GetProtocol() != "ipmi" {
		t.Errorf("generation %d, bmc protocol %q; want 2 and ipmi", h.GetMetadata().GetGeneration(), h.GetSpec().GetBmc().GetProtocol())
	}
}

func TestClusterCIDROverlappingAHostNetworkWarns(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	_, csr, err := pki.NewKeyAndCSR("net-01")
	require.NoError(t, err)
	_, err = controllerv1.NewEnrollmentClient(env.DialAnonymous(t)).Enroll(ctx, &controllerv1.EnrollRequest{
		Token: env.Token(t, "net-01", time.Hour), CsrDer: csr, Host: "net-01",
		Facts: &typesv1.Facts{
			Nics:   []*typesv1.NIC{{Name: "eth0", Addresses: []string{"10.244.1.5/24", "fe80::1/64"}}},
			Routes: []*typesv1.Route{{Destination: "0.0.0.0/0", Gateway: "10.244.1.1"}},
		},
	})
	require.NoError(t, err)
	rc := resourcesClient(t, env, "admin")
	cluster := func(pod string) *controllerv1.Resource {
		return &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: &typesv1.Cluster{
			Metadata: &typesv1.ObjectMeta{Name: "prod"},
			Spec:     &typesv1.ClusterSpec{KubernetesVersion: "v1.34.4", PodCidr: pod, ServiceCidr: "10.96.0.0/12"},
		}}}
	}
	resp, err := rc.Apply(ctx, &controllerv1.ApplyRequest{DryRun: true, Resources: []*controllerv1.Resource{cluster("10.244.0.0/16")}})
	require.NoError(t, err)
	if w := strings.Join(resp.GetResults()[0].GetWarnings(), "\n"); !strings.Contains(w, `10.244.1.0/24 (host "net-01")`) {
		t.Errorf("Apply(cluster podCidr 10.244.0.0/16 over host 10.244.1.5/24) warnings = %q, want one naming 10.244.1.0/24 of net-01", w)
	}
	// The default route and link-local addresses are not host networks.
	resp, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{cluster("172.20.0.0/16")}})
	require.NoError(t, err)
	if w := resp.GetResults()[0].GetWarnings(); len(w) != 0 {
		t.Errorf("Apply(cluster podCidr 172.20.0.0/16) warnings = %q, want none (default route, link-local)", w)
	}
}

// A node of a running cluster reports its CNI bridge and routes to the
// other nodes' pod subnets (inside the cluster's podCidr): those are the
// cluster's network, not the host's, and a second cluster may use the same
// conventional range. Before, the first cluster's nodes made every later
// Cluster with podCidr 10.244.0.0/16 fail to apply.
func TestClusterPodNetworksAreNotHostNetworks(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "admin")
	cluster := func(name, pod string) *controllerv1.Resource {
		return &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: &typesv1.Cluster{
			Metadata: &typesv1.ObjectMeta{Name: name},
			Spec:     &typesv1.ClusterSpec{KubernetesVersion: "v1.34.4", PodCidr: pod, ServiceCidr: "10.96.0.0/12"},
		}}}
	}
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{cluster("first", "10.244.0.0/16")}})
	require.NoError(t, err)
	_, csr, err := pki.NewKeyAndCSR("node-01")
	require.NoError(t, err)
	_, err = controllerv1.NewEnrollmentClient(env.DialAnonymous(t)).Enroll(ctx, &controllerv1.EnrollRequest{
		Token: env.Token(t, "node-01", time.Hour), CsrDer: csr, Host: "node-01",
		Facts: &typesv1.Facts{
			Nics: []*typesv1.NIC{
				{Name: "eth0", Addresses: []string{"192.168.77.5/24"}},
				{Name: "cni0", Addresses: []string{"10.244.0.1/24"}},
			},
			Routes: []*typesv1.Route{{Destination: "10.244.1.0/24", Gateway: "192.168.77.6", Device: "eth0"}},
		},
	})
	require.NoError(t, err)
	resp, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{cluster("second", "10.244.0.0/16")}})
	require.NoError(t, err, "a second cluster reusing the first one's pod range")
	if w := resp.GetResults()[0].GetWarnings(); len(w) != 0 {
		t.Errorf("Apply(second cluster, the first one's pod range) warnings = %q, want none", w)
	}
	// The host's own network still counts (as a warning: an agent reports it).
	resp, err = rc.Apply(ctx, &controllerv1.ApplyRequest{DryRun: true, Resources: []*controllerv1.Resource{cluster("third", "192.168.0.0/16")}})
	require.NoError(t, err)
	if w := strings.Join(resp.GetResults()[0].GetWarnings(), "\n"); !strings.Contains(w, "192.168.77.0/24") {
		t.Errorf("Apply(cluster podCidr 192.168.0.0/16 over host 192.168.77.5/24) warnings = %q, want one naming 192.168.77.0/24", w)
	}
}

func TestEventsExpire(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t)
	_, err := resourcesClient(t, env, "admin").Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("ev-01", "")}})
	require.NoError(t, err)
	cl := env.Store().Client()
	resp, err := cl.Get(ctx, "/kiln/v1/events/hosts/ev-01/", clientv3.WithPrefix())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "events of hosts/ev-01")
	kv := resp.Kvs[0]
	if kv.Lease == 0 {
		t.Fatalf("event %s has no lease: it would never expire", kv.Key)
	}
	ttl, err := cl.TimeToLive(ctx, clientv3.LeaseID(kv.Lease))
	require.NoError(t, err)
	if ttl.TTL <= 0 || ttl.GrantedTTL > int64((time.Hour+time.Minute)/time.Second) {
		t.Errorf("event lease TTL %ds (granted %ds), want an expiring lease of about 1h", ttl.TTL, ttl.GrantedTTL)
	}
}

// Issue 12, hole 6: an agent reporting routes 0.0.0.0/1 and 128.0.0.0/1
// (together every IPv4 address, but neither a default route) made every
// IPv4 Cluster apply fail with "overlaps host network". Facts from agents
// must not deny service to operators: such an overlap is a warning naming
// the host and the network, and the Cluster is stored. The controller's
// own networks and the networks an operator declares
// (--reserved-network) still refuse.
func TestAgentReportedRoutesCannotRefuseClusters(t *testing.T) {
	ctx := context.Background()
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
		c.ReservedNetworks = []netip.Prefix{netip.MustParsePrefix("172.31.0.0/16")}
	}))
	_, csr, err := pki.NewKeyAndCSR("evil-01")
	require.NoError(t, err)
	_, err = controllerv1.NewEnrollmentClient(env.DialAnonymous(t)).Enroll(ctx, &controllerv1.EnrollRequest{
		Token: env.Token(t, "evil-01", time.Hour), CsrDer: csr, Host: "evil-01",
		Facts: &typesv1.Facts{
			Nics:   []*typesv1.NIC{{Name: "eth0", Addresses: []string{"0.0.0.0/1"}}},
			Routes: []*typesv1.Route{{Destination: "0.0.0.0/1", Device: "eth0"}, {Destination: "128.0.0.0/1", Device: "eth0"}},
		},
	})
	require.NoError(t, err)
	rc := resourcesClient(t, env, "operator")
	cluster := func(name, pod, svc string) *controllerv1.Resource {
		return &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: &typesv1.Cluster{
			Metadata: &typesv1.ObjectMeta{Name: name},
			Spec:     &typesv1.ClusterSpec{KubernetesVersion: "v1.34.4", PodCidr: pod, ServiceCidr: svc},
		}}}
	}
	resp, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{cluster("prod", "10.244.0.0/16", "10.96.0.0/12")}})
	require.NoError(t, err, "Apply(cluster) with an agent reporting 0.0.0.0/1 and 128.0.0.0/1: refused, want stored with a warning")
	res := resp.GetResults()[0]
	if res.GetAction() != "created" {
		t.Errorf("Apply(cluster prod) action %q, want created", res.GetAction())
	}
	warnings := strings.Join(res.GetWarnings(), "\n")
	for _, want := range []string{"spec.podCidr 10.244.0.0/16", "spec.serviceCidr 10.96.0.0/12", "0.0.0.0/1", `host "evil-01"`} {
		if !strings.Contains(warnings, want) {
			t.Errorf("Apply(cluster prod) warnings = %q, want them to name %q", warnings, want)
		}
	}
	t.Logf("accepted with warnings:\n%s", warnings)
	if _, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "clusters", Name: "prod"}); err != nil {
		t.Errorf("Get(cluster prod) after the warned apply = %v, want it stored", err)
	}
	// A network the operator declared still refuses, naming it.
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{cluster("rsv", "172.31.128.0/17", "10.96.0.0/12")}})
	if code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "172.31.0.0/16") {
		t.Errorf("Apply(cluster podCidr over --reserved-network 172.31.0.0/16) = %v, want InvalidArgument naming it", err)
	}
	// A dry run says the same as the apply would.
	dry, err := rc.Apply(ctx, &controllerv1.ApplyRequest{DryRun: true, Resources: []*controllerv1.Resource{cluster("dry", "10.244.0.0/16", "10.96.0.0/12")}})
	require.NoError(t, err)
	if len(dry.GetResults()[0].GetWarnings()) == 0 {
		t.Errorf("Apply(dry run) warnings empty, want the same warnings as the apply")
	}
}
