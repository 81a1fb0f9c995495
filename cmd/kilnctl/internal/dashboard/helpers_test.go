package dashboard_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/cmd/kilnctl/internal/cli"
	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/limits"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/testenv"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// syncBuffer is a bytes.Buffer safe for the command's goroutine and the
// test's.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
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

var urlRE = regexp.MustCompile(`http://127\.0\.0\.1:\d+/login\?token=\S+`)

// startDashboard runs the real `kilnctl dashboard` with kilnconfig until
// the test ends and returns its base URL ("http://127.0.0.1:PORT") and
// the login URL it printed.
func startDashboard(t testing.TB, kilnconfig string) (base, login string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out, errOut := &syncBuffer{}, &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- cli.Run(ctx, cli.Options{Stdout: out, Stderr: errOut, Getenv: func(string) string { return "" }},
			[]string{"--kilnconfig", kilnconfig, "dashboard"})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("kilnctl dashboard: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("kilnctl dashboard did not stop within 10s")
		}
	})
	require.Eventually(t, func() bool { return urlRE.MatchString(out.String()) }, 30*time.Second, 20*time.Millisecond,
		"kilnctl dashboard printed no URL; stdout %q stderr %q", out.String(), errOut.String())
	login = urlRE.FindString(out.String())
	u, err := url.Parse(login)
	require.NoError(t, err)
	return "http://" + u.Host, login
}

// newBrowser starts Debian's headless Chromium with a fresh profile,
// closed when the test ends; a test without chromium skips.
func newBrowser(t testing.TB) context.Context {
	t.Helper()
	path := testenv.RequireTool(t, "chromium", "chromium")
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(path),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.WindowSize(1400, 1100),
	}
	actx, cancelA := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelB := chromedp.NewContext(actx)
	t.Cleanup(func() { cancelB(); cancelA() })
	require.NoError(t, chromedp.Do(ctx), "start chromium")
	return ctx
}

// open navigates to u and returns the HTTP status of the document.
func open(t testing.TB, ctx context.Context, u string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := chromedp.Run(ctx, chromedp.NavigateResponse(u))
	require.NoError(t, err, "navigate %s", u)
	return resp.Status
}

// openRefused navigates to u, which must fail to load, and returns the
// HTTP status and Content-Length of the document's response: Chromium
// shows its own error page for an error status with an empty body.
func openRefused(t testing.TB, ctx context.Context, u string) (status int64, length string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resps := chromedp.Events(ctx, network.ResponseReceived)
	_, err := chromedp.Run(ctx, chromedp.Navigate(u))
	require.Error(t, err, "navigate %s: the page loaded", u)
	for ev, err := range resps {
		require.NoError(t, err, "navigate %s", u)
		if ev.Type != network.ResourceTypeDocument || ev.Response.URL != u {
			continue
		}
		for k, v := range ev.Response.Headers {
			if strings.EqualFold(k, "Content-Length") {
				length = fmt.Sprint(v)
			}
		}
		return ev.Response.Status, length
	}
	t.Fatalf("navigate %s: no response", u)
	return 0, ""
}

// login opens the printed URL and checks the browser lands on the
// overview with the session cookie.
func login(t testing.TB, ctx context.Context, loginURL, base string) {
	t.Helper()
	require.Equal(t, int64(200), open(t, ctx, loginURL), "open the printed URL")
	loc, err := chromedp.Run(ctx, chromedp.Location())
	require.NoError(t, err)
	require.Equal(t, base+"/", loc, "after login the address bar holds no token")
	res, err := chromedp.Call(ctx, network.GetCookies, network.GetCookiesParams{URLs: []string{base}})
	require.NoError(t, err)
	cookies := res.Cookies
	require.Len(t, cookies, 1)
	require.True(t, cookies[0].HTTPOnly, "cookie HttpOnly")
	require.Equal(t, network.CookieSameSiteStrict, cookies[0].SameSite, "cookie SameSite")
}

// eval evaluates a JavaScript expression (awaited when a promise) in
// the page.
func eval[T any](t testing.TB, ctx context.Context, js string) T {
	t.Helper()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](js, chromedp.EvalAwaitPromise))
	require.NoError(t, err, "evaluate %s", js)
	return v
}

// waitJS waits until the expression is true in the page.
func waitJS(t testing.TB, ctx context.Context, js string, timeout time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	_, err := chromedp.Run(ctx, chromedp.Poll[chromedp.Void](js, chromedp.WithPollingInterval(50*time.Millisecond), chromedp.WithPollingTimeout(timeout)))
	require.NoError(t, err, "wait for %s", js)
}

// kilnctl runs kilnctl args in process and returns its output.
func kilnctl(t testing.TB, kilnconfig string, args ...string) string {
	t.Helper()
	var out, errOut bytes.Buffer
	err := cli.Run(context.Background(), cli.Options{Stdout: &out, Stderr: &errOut, Getenv: func(string) string { return "" }},
		append([]string{"--kilnconfig", kilnconfig}, args...))
	require.NoError(t, err, "kilnctl %s: %s", strings.Join(args, " "), errOut.String())
	return out.String()
}

// columns parses a kilnctl table: one map per row, header to cell.
func columns(table string) []map[string]string {
	lines := strings.Split(strings.TrimRight(table, "\n"), "\n")
	if len(lines) == 0 {
		return nil
	}
	header := strings.Fields(lines[0])
	var rows []map[string]string
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		row := map[string]string{}
		for i, h := range header {
			if i < len(f) {
				row[h] = f[i]
			}
		}
		rows = append(rows, row)
	}
	return rows
}

// fixture is a fleet stored directly in the controller's store, as the
// lifecycle and the cluster planners would leave it.
type fixture struct {
	hosts, clusters int
}

var (
	versions = []string{"v1.33.8", "v1.34.4", "v1.34.4", "v1.35.0"}
	images   = map[string]string{"v1.33.8": "debian12-k8s1.33.8-20261101", "v1.34.4": "debian12-k8s1.34.4-20261201", "v1.35.0": "debian12-k8s1.35.0-20261203"}
	phases   = []string{"Ready", "Ready", "Ready", "Provisioning", "NotReady"}
)

func cond(typ, status, reason, msg string, at time.Time) *typesv1.Condition {
	return &typesv1.Condition{Type: typ, Status: status, Reason: reason, Message: msg, LastTransitionTime: timestamppb.New(at)}
}

func clusterReady(phase string, now time.Time) *typesv1.Condition {
	switch phase {
	case "Ready":
		return cond("Ready", "True", "AsExpected", "control plane and workers ready", now.Add(-time.Hour))
	case "Provisioning":
		return cond("Ready", "False", "Provisioning", "2 of 3 control-plane machines ready", now.Add(-3*time.Minute))
	}
	return cond("Ready", "False", "ControlPlaneNotReady", "API server not answering on the endpoint", now.Add(-9*time.Minute))
}

// populate stores f: clusters with a control plane of 3 and a
// deployment of the rest of their share of the hosts, each machine on a
// host; hosts left over are Available, Registering or in Error; one host
// in 25 has an unreachable BMC; one cluster in 7 is mid-rollout.
func (f fixture) populate(t testing.TB, st *store.Store) {
	t.Helper()
	ctx := context.Background()
	now := time.Now()
	put := func(kind, name string, m proto.Message) {
		_, err := st.Create(ctx, kind, name, m)
		require.NoError(t, err, "create %s/%s", kind, name)
	}
	meta := func(name string, labels map[string]string) *typesv1.ObjectMeta {
		return &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: timestamppb.New(now.Add(-48 * time.Hour)), Labels: labels}
	}
	for v, img := range images {
		put("images", img, &typesv1.Image{Metadata: meta(img, nil), Spec: &typesv1.ImageSpec{Url: "http://images.lab/" + img + ".raw.zst", Format: "raw.zst", KubernetesVersion: v,
			Sha256: strings.Repeat("ab", 32), Size: 900 << 20}})
	}
	perCluster := 0
	if f.clusters > 0 {
		perCluster = max(f.hosts*9/10/f.clusters, 4)
	}
	host := 0
	hostName := func(i int) string { return fmt.Sprintf("rack%02d-%03d", i/40+1, i%40+1) }
	storeHost := func(i int, state typesv1.HostState, machine, image string) {
		name := hostName(i)
		protocol := "redfish"
		if i%4 == 3 {
			protocol = "ipmi"
		}
		s := &typesv1.HostStatus{State: state, Power: "on", Machine: machine, Image: image,
			Conditions: []*typesv1.Condition{cond("BMCReachable", "True", "Answered", "", now.Add(-time.Hour))},
			Facts: &typesv1.Facts{Hostname: name, OsPrettyName: "Debian GNU/Linux 12 (bookworm)", Kernel: "6.1.0-28-amd64", Architecture: "x86_64", CpuModel: "AMD EPYC 7313P", CpuCount: 32, MemoryBytes: 256 << 30, BootSource: "disk",
				Disks: []*typesv1.Disk{{Name: "nvme0n1", Path: "/dev/nvme0n1", SizeBytes: 960 << 30, Model: "SAMSUNG MZQL2960HCJR", Serial: fmt.Sprintf("S64FNE0R%05d", i)}},
				Nics:  []*typesv1.NIC{{Name: "eno1", Mac: fmt.Sprintf("0c:c4:7a:00:%02x:%02x", i/256, i%256), Up: true, Addresses: []string{fmt.Sprintf("10.20.%d.%d/16", i/250, i%250+1)}}}},
		}
		if state == typesv1.HostState_HOST_STATE_PROVISIONED {
			s.LastOperation = &typesv1.OperationStatus{Id: name + "-lay-0", Kind: "LayImage", State: "Succeeded", Started: timestamppb.New(now.Add(-47 * time.Hour)), Finished: timestamppb.New(now.Add(-47*time.Hour + 95*time.Second))}
			s.ImageLays = 1
		}
		if state == typesv1.HostState_HOST_STATE_ERROR {
			s.ErrorReason = "ProvisioningFailed"
			s.LastError = "LayImage: sha256 mismatch: image truncated at 512 MiB"
		}
		if i%25 == 24 {
			s.Conditions = []*typesv1.Condition{cond("BMCReachable", "False", "Unreachable", "redfish: dial tcp 10.30.0.9:443: i/o timeout (breaker open)", now.Add(-12*time.Minute))}
		}
		put("hosts", name, &typesv1.Host{Metadata: meta(name, map[string]string{"rack": fmt.Sprintf("rack%02d", i/40+1)}),
			Spec:   &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: protocol, Address: fmt.Sprintf("10.30.%d.%d", i/250, i%250+1)}, Online: true},
			Status: s})
	}
	for c := 0; c < f.clusters; c++ {
		name := fmt.Sprintf("prod-%03d", c+1)
		v := versions[c%len(versions)]
		wave := fmt.Sprintf("%d", c%3+1)
		put("clusters", name, &typesv1.Cluster{Metadata: meta(name, map[string]string{"env": "prod", "upgrade-wave": wave}),
			Spec:   &typesv1.ClusterSpec{KubernetesVersion: v, PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12", ControlPlaneEndpoint: fmt.Sprintf("10.40.%d.10:6443", c)},
			Status: &typesv1.ClusterStatus{Phase: phases[c%len(phases)], Conditions: []*typesv1.Condition{clusterReady(phases[c%len(phases)], now)}}})
		rolling := c%7 == 3
		workers := perCluster - 3
		cpConds := []*typesv1.Condition{cond("Ready", "True", "AsExpected", "3 of 3 ready", now.Add(-time.Hour)), cond("UpToDate", "True", "AsExpected", "3 machines at "+v, now.Add(-time.Hour))}
		mdConds := []*typesv1.Condition{cond("Available", "True", "AsExpected", "", now.Add(-time.Hour)), cond("UpToDate", "True", "AsExpected", "", now.Add(-time.Hour))}
		updated := int32(workers)
		if rolling {
			updated = int32(workers / 2)
			mdConds[1] = cond("UpToDate", "False", "RollingOut", fmt.Sprintf("%d of %d machines at %s", updated, workers, v), now.Add(-4*time.Minute))
		}
		put("controlplanes", name+"-cp", &typesv1.ControlPlane{Metadata: meta(name+"-cp", nil),
			Spec:   &typesv1.ControlPlaneSpec{Cluster: name, Replicas: 3, Version: v, Image: images[v], RolloutMaxSurge: 1},
			Status: &typesv1.ControlPlaneStatus{Replicas: 3, ReadyReplicas: 3, UpdatedReplicas: 3, EtcdMembers: 3, Conditions: cpConds}})
		put("machinedeployments", name+"-workers", &typesv1.MachineDeployment{Metadata: meta(name+"-workers", nil),
			Spec:   &typesv1.MachineDeploymentSpec{Cluster: name, Replicas: int32(workers), Version: v, Image: images[v]},
			Status: &typesv1.MachineDeploymentStatus{Replicas: int32(workers), ReadyReplicas: int32(workers), UpdatedReplicas: updated, Conditions: mdConds}})
		for m := 0; m < perCluster && host < f.hosts; m++ {
			role, owner := "control-plane", "ControlPlane/"+name+"-cp"
			if m >= 3 {
				role, owner = "worker", "MachineDeployment/"+name+"-workers"
			}
			mv := v
			if rolling && m >= 3 && m-3 >= int(updated) {
				mv = versions[(c+len(versions)-1)%len(versions)] // not yet rolled
			}
			mname := fmt.Sprintf("%s-%s-%d", name, role, m)
			hn := hostName(host)
			put("machines", mname, &typesv1.Machine{Metadata: meta(mname, nil),
				Spec:   &typesv1.MachineSpec{Cluster: name, Role: role, Host: hn, Version: mv, Image: images[mv], Owner: owner},
				Status: &typesv1.MachineStatus{Phase: "Running", NodeName: hn, Conditions: []*typesv1.Condition{cond("NodeReady", "True", "KubeletReady", "", now.Add(-time.Hour))}}})
			storeHost(host, typesv1.HostState_HOST_STATE_PROVISIONED, mname, images[mv])
			host++
		}
	}
	spare := []typesv1.HostState{typesv1.HostState_HOST_STATE_AVAILABLE, typesv1.HostState_HOST_STATE_AVAILABLE, typesv1.HostState_HOST_STATE_REGISTERING, typesv1.HostState_HOST_STATE_ERROR, typesv1.HostState_HOST_STATE_WIPING}
	for i := 0; host < f.hosts; i++ {
		storeHost(host, spare[i%len(spare)], "", "")
		host++
	}
}

// startFleet starts a controller holding fixture f.
func startFleet(t testing.TB, f fixture) *controllertest.Env {
	t.Helper()
	// The tests compare the pages with a `kilnctl describe host` of every
	// host, far more requests than a person's rate limit lets through
	// (50/s, bursts of 200): people are not limited here.
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
		c.Limits.People = limits.Rate{PerSecond: -1}
	}))
	f.populate(t, env.Store())
	return env
}

func requireChromium(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("chromium"); err != nil {
		testenv.Skipf(t, "chromium not installed (apt-get install chromium)")
	}
}

func mustURL(t testing.TB, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	require.NoError(t, err)
	return u
}

// chromedpSetCookie gives the browser the session cookie c of base.
func chromedpSetCookie(ctx context.Context, base string, c *http.Cookie) (cdp.Empty, error) {
	httpOnly := true
	return chromedp.Call(ctx, network.SetCookie, network.SetCookieParams{Name: c.Name, Value: c.Value, URL: base + "/", HTTPOnly: &httpOnly, SameSite: network.CookieSameSiteStrict})
}
