package dashboard_test

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestGuard checks, with a plain HTTP client (a browser cannot forge
// these headers), what the dashboard answers to requests a browser would
// send after a DNS rebinding attack or from another origin, and to the
// token: 403 to a Host or Origin that is not the dashboard's loopback
// address, even with the session cookie; 401 to a wrong, empty or spent
// token; the cookie is HttpOnly and SameSite=Strict; every method but
// GET is 405 with an empty body; all refusals have empty bodies.
func TestGuard(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := startFleet(t, fixture{hosts: 4, clusters: 1})
	base, loginURL := startDashboard(t, env.ConfigFor(t, "reader", "alice"))
	port := base[strings.LastIndex(base, ":")+1:]

	// No cookie jar: a jar (like a browser) keeps the cookie for the
	// Host it came from; the session cookie is sent by hand below,
	// whatever the Host, to check the guard and not the jar.
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	session := ""
	do := func(method, path string, hdr map[string]string) (int, string, http.Header) {
		t.Helper()
		req, err := http.NewRequest(method, base+path, strings.NewReader(""))
		require.NoError(t, err)
		if session != "" {
			req.Header.Set("Cookie", session)
		}
		for k, v := range hdr {
			if k == "Host" {
				req.Host = v
			} else {
				req.Header.Set(k, v)
			}
		}
		resp, err := c.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b), resp.Header
	}

	for _, p := range []string{"/login?token=", "/login?token=nope", "/login"} {
		code, body, _ := do("GET", p, nil)
		require.Equal(t, http.StatusUnauthorized, code, "GET %s", p)
		require.Empty(t, body, "GET %s", p)
	}
	// A rebinding page's requests carry its own name as Host; the token
	// in such a request does not even get checked.
	code, _, _ := do("GET", loginURL[len(base):], map[string]string{"Host": "attacker.example:" + port})
	require.Equal(t, http.StatusForbidden, code)

	code, _, hdr := do("GET", loginURL[len(base):], nil)
	require.Equal(t, http.StatusSeeOther, code, "redeem the token")
	require.Equal(t, "/", hdr.Get("Location"))
	set := hdr.Get("Set-Cookie")
	require.Contains(t, set, "HttpOnly")
	require.Contains(t, set, "SameSite=Strict")
	require.Contains(t, set, "Path=/")
	session = strings.SplitN(set, ";", 2)[0]
	code, _, _ = do("GET", loginURL[len(base):], nil)
	require.Equal(t, http.StatusUnauthorized, code, "a spent token")

	for _, tc := range []struct {
		name string
		hdr  map[string]string
		want int
	}{
		{"own address", nil, http.StatusOK},
		{"localhost", map[string]string{"Host": "localhost:" + port}, http.StatusOK},
		{"own origin", map[string]string{"Origin": base}, http.StatusOK},
		{"rebound name", map[string]string{"Host": "attacker.example:" + port}, http.StatusForbidden},
		{"other port", map[string]string{"Host": "127.0.0.1:1"}, http.StatusForbidden},
		{"no port", map[string]string{"Host": "127.0.0.1"}, http.StatusForbidden},
		{"cross origin", map[string]string{"Origin": "http://attacker.example"}, http.StatusForbidden},
		{"https origin", map[string]string{"Origin": "https://127.0.0.1:" + port}, http.StatusForbidden},
		{"null origin", map[string]string{"Origin": "null"}, http.StatusForbidden},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body, _ := do("GET", "/", tc.hdr)
			require.Equal(t, tc.want, code)
			if code != http.StatusOK {
				require.Empty(t, body)
			}
		})
	}
	for _, m := range []string{"POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE", "CONNECT"} {
		code, body, hdr := do(m, "/hosts", nil)
		require.Equal(t, http.StatusMethodNotAllowed, code, m)
		require.Empty(t, body, m)
		require.Equal(t, "GET", hdr.Get("Allow"), m)
	}
}
