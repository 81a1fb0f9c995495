package controller_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/limits"
	"github.com/kilnhq/kiln/internal/testenv"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// slow is a rate that does not refill within a test: a flood's refusals
// do not depend on how fast the machine is.
func slow(burst int) limits.Rate { return limits.Rate{PerSecond: 0.001, Burst: burst} }

// TestAPIRateLimitRefusesAFloodingCaller: a reader floods List, an
// unauthenticated caller floods Enroll with made-up tokens; past their
// bursts each is refused with ResourceExhausted and a retry-after, while
// another reader and an operator are still served.
func TestAPIRateLimitRefusesAFloodingCaller(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	ctx := context.Background()
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
		c.Limits = limits.GRPCConfig{People: slow(10), Anonymous: slow(5)}
	}))
	mallory := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "reader", "mallory")))
	rita := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "reader", "rita")))

	var served, refused int
	var last error
	var trailer metadata.MD
	for range 100 {
		_, err := mallory.List(ctx, &controllerv1.ListRequest{Kind: "hosts"}, grpc.Trailer(&trailer))
		switch status.Code(err) {
		case codes.OK:
			served++
		case codes.ResourceExhausted:
			refused++
			last = err
		default:
			t.Fatalf("List as mallory = %v, want OK or ResourceExhausted", err)
		}
	}
	t.Logf("mallory's flood of 100 Lists: %d served, %d refused; last refusal: %v (trailer retry-after %v)", served, refused, last, trailer.Get("retry-after"))
	if served != 10 || refused != 90 {
		t.Errorf("flood of 100 Lists: %d served, %d refused, want 10 and 90 (burst 10)", served, refused)
	}
	if msg := status.Convert(last).Message(); !strings.Contains(msg, "rate limit: reader mallory") || !strings.Contains(msg, "retry after") {
		t.Errorf("refusal = %q, want it to name the caller and say when to retry", msg)
	}
	if len(trailer.Get("retry-after")) != 1 {
		t.Errorf("refusal trailer = %v, want a retry-after", trailer)
	}
	if _, err := rita.List(ctx, &controllerv1.ListRequest{Kind: "hosts"}); err != nil {
		t.Errorf("List as rita during mallory's flood = %v, want served", err)
	}

	// Enrollment without a certificate: by address.
	enr := controllerv1.NewEnrollmentClient(env.DialAnonymous(t))
	refused = 0
	for range 20 {
		_, err := enr.Enroll(ctx, &controllerv1.EnrollRequest{Token: "aaaaaa.bbbbbbbbbbbbbbbb", Host: "rack9-01"})
		if status.Code(err) == codes.ResourceExhausted {
			refused++
			last = err
		}
	}
	t.Logf("anonymous Enroll flood of 20: %d refused; last: %v", refused, last)
	if refused != 15 || !strings.Contains(status.Convert(last).Message(), "unauthenticated caller at 127.0.0.1") {
		t.Errorf("anonymous Enroll flood: %d refused (last %v), want 15 refusals naming the address", refused, last)
	}
	op := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "operator", "olga")))
	if _, err := op.CreateToken(ctx, &controllerv1.CreateTokenRequest{Ttl: "1h"}); err != nil {
		t.Errorf("CreateToken as operator olga during the floods = %v, want served", err)
	}
}

// TestAPIBoundsStreamsPerCaller: a caller opening watch after watch is
// refused past its bound while another caller still opens one.
func TestAPIBoundsStreamsPerCaller(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
		c.Limits = limits.GRPCConfig{StreamsPerCaller: 3}
	}))
	mallory := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "reader", "mallory")))
	rita := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "reader", "rita")))
	opened := 0
	for range 3 {
		w, err := mallory.Watch(ctx, &controllerv1.WatchRequest{Kind: "hosts"})
		require.NoError(t, err)
		_, err = w.Header()
		require.NoError(t, err, "watch %d of 3", opened+1)
		opened++
	}
	err := func() error {
		w, err := mallory.Watch(ctx, &controllerv1.WatchRequest{Kind: "hosts"})
		if err != nil {
			return err
		}
		_, err = w.Recv()
		return err
	}()
	t.Logf("mallory's 4th watch: %v", err)
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "holds 3 open streams") {
		t.Errorf("4th watch of mallory = %v, want ResourceExhausted saying she holds 3", err)
	}
	// rita's watch is accepted (headers arrive); it then waits for
	// changes, so it is not read further.
	w, err := rita.Watch(ctx, &controllerv1.WatchRequest{Kind: "hosts"})
	require.NoError(t, err)
	if _, err := w.Header(); err != nil {
		t.Errorf("rita's watch while mallory holds hers = %v, want accepted", err)
	}
}

// TestAPIRefusesAnOversizedApply: an apply larger than the message limit
// is refused with ResourceExhausted before anything is decoded or stored;
// a normal apply still goes through.
func TestAPIRefusesAnOversizedApply(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	ctx := context.Background()
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.MaxMessageBytes = 64 << 10 }))
	op := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "operator", "olga")))
	hostOf := func(name, hint string) *controllerv1.Resource {
		return &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
			Metadata: &typesv1.ObjectMeta{Name: name},
			Spec:     &typesv1.HostSpec{BootMac: "52:54:00:00:07:01", RootDiskHint: hint, Bmc: &typesv1.BMCSpec{Protocol: "none"}},
		}}}
	}
	_, err := op.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{hostOf("big", strings.Repeat("x", 100<<10))}})
	t.Logf("oversized apply: %v", err)
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "larger than max") {
		t.Errorf("Apply of a 100 KiB host with a 64 KiB limit = %v, want ResourceExhausted (larger than max)", err)
	}
	if _, err := op.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "big"}); status.Code(err) != codes.NotFound {
		t.Errorf("Get(big) after the refused apply = %v, want NotFound", err)
	}
	_, err = op.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{hostOf("small", "")}})
	require.NoError(t, err, "a normal apply after the refusal")
}

// TestBootServerRateLimitsTokenMinting: one address asking the boot
// server for iPXE scripts of made-up hosts gets 429 with Retry-After past
// its burst; another address is still answered.
func TestBootServerRateLimitsTokenMinting(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := startBoot(t, controllertest.WithConfig(func(c *controller.Config) { c.BootRate = slow(5) }))
	client := func(src string) *http.Client {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 10 * time.Second}
		return &http.Client{Transport: &http.Transport{DialContext: d.DialContext}}
	}
	get := func(c *http.Client, path string) *http.Response {
		resp, err := c.Get(env.BootURL + path)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	attacker := client("127.0.0.1")
	codes := map[int]int{}
	var last *http.Response
	for i := range 50 {
		resp := get(attacker, fmt.Sprintf("/boot/ipxe/made-up-%d", i))
		codes[resp.StatusCode]++
		if resp.StatusCode == http.StatusTooManyRequests {
			last = resp
		}
	}
	t.Logf("boot server flood of 50 iPXE requests from 127.0.0.1: status counts %v", codes)
	if codes[http.StatusTooManyRequests] != 45 || last == nil || last.Header.Get("Retry-After") == "" {
		t.Fatalf("flood of 50: %v, want 45 answered 429 with Retry-After", codes)
	}
	// Files that mint nothing are not limited.
	if resp := get(attacker, "/boot/files/vmlinuz"); resp.StatusCode != http.StatusOK {
		t.Errorf("GET /boot/files/vmlinuz from the flooding address = %d, want 200", resp.StatusCode)
	}
	// Another address: loopback is 127.0.0.0/8 on Linux.
	other, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		testenv.Skipf(t, "no 127.0.0.2 on this host (%v): cannot show a second address is served", err)
	}
	other.Close()
	if resp := get(client("127.0.0.2"), "/boot/ipxe/rack1-01"); resp.StatusCode == http.StatusTooManyRequests {
		t.Errorf("iPXE script for rack1-01 from 127.0.0.2 = 429, want it answered (another address)")
	}
}
