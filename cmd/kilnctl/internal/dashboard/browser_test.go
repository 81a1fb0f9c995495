package dashboard_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/store"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// dists reads every distribution on the overview: data-dist → key → n.
func dists(t testing.TB, ctx context.Context) map[string]map[string]int {
	t.Helper()
	rows := eval[[]struct {
		Dist, Key string
		N         string
	}](t, ctx, `[...document.querySelectorAll('[data-dist]')].map(e => ({Dist: e.dataset.dist, Key: e.dataset.key, N: e.dataset.n}))`)
	out := map[string]map[string]int{}
	for _, r := range rows {
		if out[r.Dist] == nil {
			out[r.Dist] = map[string]int{}
		}
		n, err := strconv.Atoi(r.N)
		require.NoError(t, err)
		out[r.Dist][r.Key] = n
	}
	return out
}

func tally(rows []map[string]string, col string) map[string]int {
	out := map[string]int{}
	for _, r := range rows {
		out[r[col]]++
	}
	return out
}

// TestBrowserOverviewMatchesGet opens the overview in Chromium and checks
// each of its numbers against what `kilnctl get` prints for the same
// controller: hosts by state and by laid image, clusters by phase and
// version, nodes (machines) by version and image, the totals, the BMCs
// whose BMCReachable is False.
func TestBrowserOverviewMatchesGet(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller and Chromium")
	}
	requireChromium(t)
	env := startFleet(t, fixture{hosts: 130, clusters: 9})
	admin := env.AdminConfigPath
	base, loginURL := startDashboard(t, env.ConfigFor(t, "reader", "alice"))
	ctx := newBrowser(t)
	login(t, ctx, loginURL, base)
	waitJS(t, ctx, `document.querySelector('[data-total="hosts"]')?.textContent === '130'`, 30*time.Second)
	got := dists(t, ctx)

	hosts := columns(kilnctl(t, admin, "get", "hosts"))
	clusters := columns(kilnctl(t, admin, "get", "clusters"))
	machines := columns(kilnctl(t, admin, "get", "machines", "-o", "wide"))
	require.Len(t, hosts, 130)

	require.Equal(t, tally(hosts, "STATE"), got["hosts-state"], "hosts by state: overview vs kilnctl get hosts")
	laid := tally(hosts, "IMAGE")
	delete(laid, "-")
	require.Equal(t, laid, got["hosts-image"], "images laid on hosts: overview vs kilnctl get hosts")
	require.Equal(t, tally(clusters, "PHASE"), got["clusters-phase"], "clusters by phase: overview vs kilnctl get clusters")
	require.Equal(t, tally(clusters, "VERSION"), got["clusters-version"], "clusters by version: overview vs kilnctl get clusters")
	require.Equal(t, tally(machines, "VERSION"), got["nodes-version"], "nodes by version: overview vs kilnctl get machines")
	require.Equal(t, tally(machines, "IMAGE"), got["nodes-image"], "nodes by image: overview vs kilnctl get machines -o wide")

	totals := eval[map[string]string](t, ctx, `Object.fromEntries([...document.querySelectorAll('[data-total]')].map(e => [e.dataset.total, e.textContent]))`)
	require.Equal(t, strconv.Itoa(len(hosts)), totals["hosts"])
	require.Equal(t, strconv.Itoa(len(clusters)), totals["clusters"])
	require.Equal(t, strconv.Itoa(len(machines)), totals["nodes"])

	// BMCs unreachable: the hosts whose BMCReachable condition is False,
	// as kilnctl describe shows it.
	want := 0
	for _, h := range hosts {
		if d := kilnctl(t, admin, "describe", "host", h["NAME"]); regexpBMCFalse.MatchString(d) {
			want++
		}
	}
	require.Equal(t, strconv.Itoa(want), totals["bmc-unreachable"], "BMCs unreachable")
	require.NotZero(t, want, "the fixture has unreachable BMCs")
}

// TestBrowserLiveHost opens a host's page, changes the host's state in
// the controller and checks the page shows each change, pushed over the
// Watch stream, without a reload: a marker set in the page survives and
// the page has had one navigation. Then the same on the overview: a host
// leaving Available moves the hosts-by-state counts.
func TestBrowserLiveHost(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller and Chromium")
	}
	requireChromium(t)
	env := startFleet(t, fixture{hosts: 30, clusters: 2})
	base, loginURL := startDashboard(t, env.ConfigFor(t, "reader", "alice"))
	ctx := newBrowser(t)
	login(t, ctx, loginURL, base)
	st := env.Store()
	// The first two hosts the clusters left over: Available.
	name, other := "rack01-027", "rack01-028"
	for _, h := range []string{name, other} {
		require.Equal(t, typesv1.HostState_HOST_STATE_AVAILABLE, getHost(t, st, h).GetStatus().GetState(), h)
	}
	live := func() {
		t.Helper()
		eval[bool](t, ctx, `window.kilnMarker = 'still here'; true`)
		// The live stream is open before the change.
		waitJS(t, ctx, `document.querySelector('#live')['htmx-internal-data']?.sseEventSource?.readyState === 1`, 10*time.Second)
	}
	noReload := func() {
		t.Helper()
		require.Equal(t, "still here", eval[string](t, ctx, `window.kilnMarker`), "the page was reloaded")
		require.Equal(t, 1, eval[int](t, ctx, `performance.getEntriesByType('navigation').length`))
	}

	require.Equal(t, int64(200), open(t, ctx, base+"/hosts/"+name))
	waitJS(t, ctx, `document.querySelector('#host-state').dataset.state === 'Available'`, 10*time.Second)
	live()
	updateHost(t, st, name, func(s *typesv1.HostStatus) {
		s.State = typesv1.HostState_HOST_STATE_PROVISIONING
		s.ProvisioningStep = "LayImage"
		s.LastOperation = &typesv1.OperationStatus{Id: name + "-lay-1", Kind: "LayImage", State: "Running", Percent: 42, Message: "write", Started: timestamppb.Now()}
	})
	waitJS(t, ctx, `document.querySelector('#host-state').dataset.state === 'Provisioning'`, 10*time.Second)
	waitJS(t, ctx, `document.querySelector('progress[data-percent]')?.value === 42`, 10*time.Second)
	updateHost(t, st, name, func(s *typesv1.HostStatus) {
		s.State = typesv1.HostState_HOST_STATE_PROVISIONED
		s.ProvisioningStep = ""
		s.LastOperation.State, s.LastOperation.Percent, s.LastOperation.Finished = "Succeeded", 100, timestamppb.Now()
	})
	waitJS(t, ctx, `document.querySelector('#host-state').dataset.state === 'Provisioned'`, 10*time.Second)
	// The journal holds the operation the page saw running, now ended.
	waitJS(t, ctx, fmt.Sprintf(`document.querySelector('[data-op="%s-lay-1"]')?.textContent.includes('Succeeded')`, name), 10*time.Second)
	noReload()

	require.Equal(t, int64(200), open(t, ctx, base+"/"))
	count := `(state => +(document.querySelector('[data-dist="hosts-state"][data-key="' + state + '"]')?.dataset.n ?? 0))`
	available := eval[int](t, ctx, count+`('Available')`)
	wiping := eval[int](t, ctx, count+`('Wiping')`)
	live()
	updateHost(t, st, other, func(s *typesv1.HostStatus) { s.State = typesv1.HostState_HOST_STATE_WIPING })
	waitJS(t, ctx, fmt.Sprintf(`%s('Available') === %d && %s('Wiping') === %d`, count, available-1, count, wiping+1), 10*time.Second)
	noReload()
}

// TestBrowserReaderNoWritePath logs a reader's browser in and tries every
// method but GET on every route (and routes that do not exist): each is
// refused with 405 and an empty body, and nothing in the controller
// changed. No page holds a form or an htmx request other than GET.
func TestBrowserReaderNoWritePath(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller and Chromium")
	}
	requireChromium(t)
	env := startFleet(t, fixture{hosts: 20, clusters: 2})
	before := revisions(t, env.Store())
	base, loginURL := startDashboard(t, env.ConfigFor(t, "reader", "alice"))
	ctx := newBrowser(t)
	login(t, ctx, loginURL, base)

	paths := []string{"/", "/hosts", "/hosts?state=Available", "/hosts/rack01-001", "/clusters/prod-001", "/live/", "/live/hosts/rack01-001",
		"/static/style.css", "/login?token=x", "/apply", "/api/v1/hosts/rack01-001", "/hosts/rack01-001/delete"}
	for _, p := range paths[:5] {
		require.Equal(t, int64(200), open(t, ctx, base+p), "GET %s", p)
		writers := eval[int](t, ctx, `document.querySelectorAll('form, [hx-post], [hx-put], [hx-patch], [hx-delete], [data-hx-post], [data-hx-put], [data-hx-patch], [data-hx-delete]').length`)
		require.Zero(t, writers, "%s has a form or a writing htmx request", p)
	}
	for _, p := range paths {
		for _, m := range []string{"POST", "PUT", "PATCH", "DELETE"} {
			js := fmt.Sprintf(`fetch(%q, {method: %q, body: %q, headers: {'Content-Type': 'application/x-www-form-urlencoded'}}).then(async r => ({Status: r.status, Body: await r.text()}))`, p, m, "replicas=0")
			if m == "DELETE" {
				js = fmt.Sprintf(`fetch(%q, {method: %q}).then(async r => ({Status: r.status, Body: await r.text()}))`, p, m)
			}
			res := eval[struct {
				Status int
				Body   string
			}](t, ctx, js)
			require.Equal(t, 405, res.Status, "%s %s", m, p)
			require.Empty(t, res.Body, "%s %s", m, p)
		}
	}
	require.Equal(t, before, revisions(t, env.Store()), "the controller's objects changed")
}

// TestBrowserUnauthenticated opens the dashboard from a browser that has
// neither the token nor the cookie: every page, the live stream and the
// static files answer 401 with an empty body; a wrong token too; the
// right token, once used by another browser, too.
func TestBrowserUnauthenticated(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller and Chromium")
	}
	requireChromium(t)
	env := startFleet(t, fixture{hosts: 10, clusters: 1})
	base, loginURL := startDashboard(t, env.ConfigFor(t, "reader", "alice"))

	stranger := newBrowser(t)
	check := func(u string) {
		t.Helper()
		status, length := openRefused(t, stranger, u)
		require.Equal(t, int64(401), status, "GET %s", u)
		require.Equal(t, "0", length, "GET %s: the body is not empty", u)
	}
	for _, p := range []string{"/", "/hosts", "/hosts/rack01-001", "/clusters/prod-001", "/live/", "/static/style.css", "/static/vendor/htmx.min.js", "/login?token=wrong", "/login"} {
		check(base + p)
	}
	owner := newBrowser(t)
	login(t, owner, loginURL, base)
	check(loginURL) // the token worked once
}

var regexpBMCFalse = regexp.MustCompile(`(?m)^\s+BMCReachable\s+False\b`)

func getHost(t testing.TB, st *store.Store, name string) *typesv1.Host {
	t.Helper()
	h := &typesv1.Host{}
	_, err := st.Get(context.Background(), "hosts", name, h)
	require.NoError(t, err)
	return h
}

func updateHost(t testing.TB, st *store.Store, name string, fn func(*typesv1.HostStatus)) {
	t.Helper()
	h := &typesv1.Host{}
	rev, err := st.Get(context.Background(), "hosts", name, h)
	require.NoError(t, err)
	fn(h.Status)
	_, err = st.Update(context.Background(), "hosts", name, h, rev)
	require.NoError(t, err)
}

// revisions maps every object in the store to its revision.
func revisions(t testing.TB, st *store.Store) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for kind, newObj := range map[string]func() proto.Message{
		"hosts": func() proto.Message { return &typesv1.Host{} }, "clusters": func() proto.Message { return &typesv1.Cluster{} },
		"controlplanes": func() proto.Message { return &typesv1.ControlPlane{} }, "machinedeployments": func() proto.Message { return &typesv1.MachineDeployment{} },
		"machines": func() proto.Message { return &typesv1.Machine{} }, "images": func() proto.Message { return &typesv1.Image{} },
	} {
		items, _, err := st.List(context.Background(), kind, newObj, store.ListOptions{})
		require.NoError(t, err)
		for _, it := range items {
			out[kind+"/"+it.Name] = it.Rev
		}
	}
	return out
}
