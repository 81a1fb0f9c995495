package dashboard_test

import (
	"io"
	"net/http"
	"net/http/cookiejar"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// BenchmarkOverview measures the overview of 1,000 hosts and 100
// clusters (900 machines, 100 control planes, 100 deployments) served by
// the real `kilnctl dashboard` from a controller with embedded etcd:
//
//   - server: one GET / by a Go client, the time kilnctl takes to render
//     the page from its watched copy of the fleet (no controller call);
//   - chromium: one load of the page in headless Chromium, to the load
//     event (HTML, CSS, htmx, and the live stream's first connection),
//     reported as load-ms.
//
// It also reports how long the dashboard took, after it started, to list
// the fleet (sync-ms). docs/benchmarks.md records the numbers:
//
//	go test ./cmd/kilnctl/internal/dashboard -run '^$' -bench Overview -benchtime 20x
func BenchmarkOverview(b *testing.B) {
	env := startFleet(b, fixture{hosts: 1000, clusters: 100})
	start := time.Now()
	base, loginURL := startDashboard(b, env.ConfigFor(b, "reader", "bench"))
	jar, err := cookiejar.New(nil)
	require.NoError(b, err)
	client := &http.Client{Jar: jar}
	resp, err := client.Get(loginURL)
	require.NoError(b, err)
	resp.Body.Close()
	require.Equal(b, http.StatusOK, resp.StatusCode)
	get := func() string {
		resp, err := client.Get(base + "/")
		require.NoError(b, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(b, err)
		require.Equal(b, http.StatusOK, resp.StatusCode)
		return string(body)
	}
	require.Eventually(b, func() bool { return strings.Contains(get(), `data-total="hosts">1000<`) }, time.Minute, 10*time.Millisecond)
	synced := time.Since(start)

	b.Run("server", func(b *testing.B) {
		n := 0
		for b.Loop() {
			n = len(get())
		}
		b.ReportMetric(float64(n), "page-bytes")
		b.ReportMetric(float64(synced.Milliseconds()), "sync-ms")
	})
	b.Run("chromium", func(b *testing.B) {
		requireChromium(b)
		ctx := newBrowser(b)
		// The browser logs in with a session of its own: the token is
		// spent, so hand it the Go client's cookie.
		for _, c := range jar.Cookies(mustURL(b, base)) {
			_, err := chromedpSetCookie(ctx, base, c)
			require.NoError(b, err)
		}
		var total float64
		n := 0
		for b.Loop() {
			require.Equal(b, int64(200), open(b, ctx, base+"/"))
			total += eval[float64](b, ctx, `performance.getEntriesByType('navigation')[0].loadEventEnd`)
			n++
		}
		b.ReportMetric(total/float64(n), "load-ms")
	})
}
