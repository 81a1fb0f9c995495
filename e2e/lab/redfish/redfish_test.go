package redfish_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

type client struct {
	t     *testing.T
	base  string
	token string
	http  *http.Client
}

func (c *client) do(method, path, body string) (*http.Response, map[string]any) {
	c.t.Helper()
	req, err := http.NewRequest(method, c.base+path, strings.NewReader(body))
	require.NoError(c.t, err)
	if c.token != "" {
		req.Header.Set("X-Auth-Token", c.token)
	}
	resp, err := c.http.Do(req)
	require.NoError(c.t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var v map[string]any
	_ = json.Unmarshal(b, &v)
	return resp, v
}

func newEmulator(t *testing.T, tls bool) (*redfish.BMC, *machine.Memory, *client) {
	m := &machine.Memory{}
	e, err := redfish.New(redfish.Config{
		Username: "admin", Password: "pw", TLS: tls, MaxSessions: 2,
		Systems: []redfish.System{{ID: "S1", Machine: m}},
	})
	require.NoError(t, err)
	e.Start()
	t.Cleanup(e.Close)
	hc := http.DefaultClient
	if tls {
		hc = &http.Client{Transport: &http.Transport{TLSClientConfig: e.TLSConfig()}}
	}
	return e, m, &client{t: t, base: e.URL(), http: hc}
}

func TestSessionsAndAuth(t *testing.T) {
	for _, tls := range []bool{false, true} {
		e, _, c := newEmulator(t, tls)
		if resp, _ := c.do("GET", "/redfish/v1/", ""); resp.StatusCode != 200 {
			t.Fatalf("GET service root = %d, want 200 without auth", resp.StatusCode)
		}
		if resp, _ := c.do("GET", "/redfish/v1/Systems/S1", ""); resp.StatusCode != 401 {
			t.Fatalf("GET system without auth = %d, want 401", resp.StatusCode)
		}
		if resp, _ := c.do("POST", "/redfish/v1/SessionService/Sessions", `{"UserName":"admin","Password":"nope"}`); resp.StatusCode != 401 {
			t.Fatalf("login with a wrong password = %d, want 401", resp.StatusCode)
		}
		var locs []string
		for range 2 {
			resp, _ := c.do("POST", "/redfish/v1/SessionService/Sessions", `{"UserName":"admin","Password":"pw"}`)
			require.Equal(t, 201, resp.StatusCode)
			c.token = resp.Header.Get("X-Auth-Token")
			locs = append(locs, resp.Header.Get("Location"))
		}
		resp, body := c.do("POST", "/redfish/v1/SessionService/Sessions", `{"UserName":"admin","Password":"pw"}`)
		if resp.StatusCode != 503 || !strings.Contains(toJSON(body), "SessionLimitExceeded") {
			t.Fatalf("third login with MaxSessions 2 = %d %v, want 503 SessionLimitExceeded", resp.StatusCode, body)
		}
		if resp, _ := c.do("GET", "/redfish/v1/Systems/S1", ""); resp.StatusCode != 200 {
			t.Fatalf("GET system with a session = %d, want 200", resp.StatusCode)
		}
		for _, l := range locs {
			if resp, _ := c.do("DELETE", strings.TrimPrefix(l, c.base), ""); resp.StatusCode != 204 {
				t.Fatalf("DELETE %s = %d, want 204", l, resp.StatusCode)
			}
		}
		if resp, _ := c.do("GET", "/redfish/v1/Systems/S1", ""); resp.StatusCode != 401 {
			t.Fatalf("GET with a deleted session = %d, want 401", resp.StatusCode)
		}
		if s := e.Stats(); s.Sessions != 0 {
			t.Fatalf("Stats().Sessions = %d, want 0", s.Sessions)
		}
	}
}

func toJSON(v any) string { b, _ := json.Marshal(v); return string(b) }

func login(c *client) {
	resp, _ := c.do("POST", "/redfish/v1/SessionService/Sessions", `{"UserName":"admin","Password":"pw"}`)
	require.Equal(c.t, 201, resp.StatusCode)
	c.token = resp.Header.Get("X-Auth-Token")
}

func TestBootOverrideOnceIsConsumed(t *testing.T) {
	e, m, c := newEmulator(t, false)
	login(c)
	tests := []struct {
		patch    string
		wantBoot string
		wantLeft string // BootSourceOverrideEnabled after the power-on
	}{
		{`{"Boot":{"BootSourceOverrideTarget":"Pxe","BootSourceOverrideEnabled":"Once"}}`, machine.BootPXE, "Disabled"},
		{`{"Boot":{"BootSourceOverrideTarget":"Cd","BootSourceOverrideEnabled":"Continuous"}}`, machine.BootCD, "Continuous"},
		{`{"Boot":{"BootSourceOverrideEnabled":"Disabled"}}`, machine.BootDisk, "Disabled"},
	}
	for _, tt := range tests {
		resp, _ := c.do("PATCH", "/redfish/v1/Systems/S1", tt.patch)
		require.Equal(t, 204, resp.StatusCode, tt.patch)
		resp, _ = c.do("POST", "/redfish/v1/Systems/S1/Actions/ComputerSystem.Reset", `{"ResetType":"On"}`)
		require.Equal(t, 204, resp.StatusCode)
		_, enabled, _ := e.BootOverride("S1")
		if m.BootSource() != tt.wantBoot || enabled != tt.wantLeft {
			t.Errorf("PATCH %s then On: booted %q, override left %q; want %q, %q", tt.patch, m.BootSource(), enabled, tt.wantBoot, tt.wantLeft)
		}
		resp, _ = c.do("POST", "/redfish/v1/Systems/S1/Actions/ComputerSystem.Reset", `{"ResetType":"ForceOff"}`)
		require.Equal(t, 204, resp.StatusCode)
	}
	if resp, _ := c.do("PATCH", "/redfish/v1/Systems/S1", `{"Boot":{"BootSourceOverrideTarget":"Floppy"}}`); resp.StatusCode != 400 {
		t.Fatalf("PATCH target Floppy = %d, want 400", resp.StatusCode)
	}
	if resp, _ := c.do("POST", "/redfish/v1/Systems/S1/Actions/ComputerSystem.Reset", `{"ResetType":"Explode"}`); resp.StatusCode != 400 {
		t.Fatalf("Reset Explode = %d, want 400", resp.StatusCode)
	}
}

func TestFaults(t *testing.T) {
	e, m, c := newEmulator(t, false)
	login(c)
	e.FailNext(2, 503)
	for i := range 2 {
		if resp, _ := c.do("GET", "/redfish/v1/Systems/S1", ""); resp.StatusCode != 503 {
			t.Fatalf("request %d in a 5xx burst = %d, want 503", i, resp.StatusCode)
		}
	}
	if resp, _ := c.do("GET", "/redfish/v1/Systems/S1", ""); resp.StatusCode != 200 {
		t.Fatalf("request after the burst = %d, want 200", resp.StatusCode)
	}

	e.SetPowerLies(true)
	resp, _ := c.do("POST", "/redfish/v1/Systems/S1/Actions/ComputerSystem.Reset", `{"ResetType":"On"}`)
	require.Equal(t, 204, resp.StatusCode)
	_, sys := c.do("GET", "/redfish/v1/Systems/S1", "")
	if sys["PowerState"] != "Off" || !m.State() {
		t.Fatalf("lying bmc: PowerState %v, machine on %v; want Off reported while on", sys["PowerState"], m.State())
	}
	e.ClearFaults()
	_, sys = c.do("GET", "/redfish/v1/Systems/S1", "")
	if sys["PowerState"] != "On" {
		t.Fatalf("after ClearFaults PowerState = %v, want On", sys["PowerState"])
	}
}

func TestMockupHandler(t *testing.T) {
	root, err := redfish.MockupsDir()
	if errdefs.IsNotFound(err) {
		testenv.Skip(t, err.Error())
	}
	require.NoError(t, err)
	dir := filepath.Join(root, "public-tower")
	srv := httptest.NewServer(redfish.MockupHandler(dir))
	t.Cleanup(srv.Close)
	c := &client{t: t, base: srv.URL, http: http.DefaultClient}
	for path, want := range map[string]string{
		"/redfish/v1/":                               "RootService",
		"/redfish/v1/Systems/437XR1238R2":            "437XR1238R2",
		"/redfish/v1/Managers/BMC/VirtualMedia/CD1/": "CD1",
	} {
		resp, body := c.do("GET", path, "")
		if resp.StatusCode != 200 || body["Id"] != want {
			t.Errorf("GET %s = %d Id %v, want 200 Id %s", path, resp.StatusCode, body["Id"], want)
		}
	}
	for _, path := range []string{"/redfish/v1/Systems/nope", "/redfish/v1/../../etc/passwd", "/etc"} {
		if resp, _ := c.do("GET", path, ""); resp.StatusCode != 404 {
			t.Errorf("GET %s = %d, want 404", path, resp.StatusCode)
		}
	}
	if resp, _ := c.do("PATCH", "/redfish/v1/Systems/437XR1238R2", `{"AssetTag":"x"}`); resp.StatusCode != 405 {
		t.Errorf("PATCH of AssetTag on a mockup = %d, want 405", resp.StatusCode)
	}

	// The write overlay: Boot PATCH checked against AllowableValues,
	// Reset, virtual media actions where the resource offers them.
	sys := "/redfish/v1/Systems/437XR1238R2"
	for _, tc := range []struct {
		method, path, body string
		want               int
	}{
		{"PATCH", sys, `{"Boot":{"BootSourceOverrideTarget":"UefiHttp"}}`, 400},
		{"PATCH", sys, `{"Boot":{"BootSourceOverrideTarget":"Cd","BootSourceOverrideEnabled":"Once"}}`, 204},
		{"POST", sys + "/Actions/ComputerSystem.Reset", `{"ResetType":"Explode"}`, 400},
		{"POST", sys + "/Actions/ComputerSystem.Reset", `{"ResetType":"ForceOff"}`, 204},
		{"POST", "/redfish/v1/Managers/BMC/VirtualMedia/CD1/Actions/VirtualMedia.InsertMedia", `{"Image":"http://x/a.iso"}`, 404},
	} {
		if resp, _ := c.do(tc.method, tc.path, tc.body); resp.StatusCode != tc.want {
			t.Errorf("%s %s %s = %d, want %d", tc.method, tc.path, tc.body, resp.StatusCode, tc.want)
		}
	}
	_, body := c.do("GET", sys, "")
	boot, _ := body["Boot"].(map[string]any)
	if body["PowerState"] != "Off" || boot["BootSourceOverrideTarget"] != "Cd" || boot["BootSourceOverrideEnabled"] != "Once" {
		t.Errorf("after the writes: PowerState %v, Boot %v; want Off, Cd Once", body["PowerState"], boot)
	}
	c.do("POST", sys+"/Actions/ComputerSystem.Reset", `{"ResetType":"On"}`)
	_, body = c.do("GET", sys, "")
	if boot, _ := body["Boot"].(map[string]any); body["PowerState"] != "On" || boot["BootSourceOverrideEnabled"] != "Disabled" {
		t.Errorf("after Reset On: PowerState %v, Boot %v; want On with the override consumed", body["PowerState"], boot)
	}
}

func TestMockupsDirEnv(t *testing.T) {
	t.Setenv("KILN_REDFISH_MOCKUPS", t.TempDir())
	if _, err := redfish.MockupsDir(); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("MockupsDir() with KILN_REDFISH_MOCKUPS naming an empty dir = %v, want FailedPrecondition", err)
	}
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "vendor-x"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "vendor-x", "index.json"), []byte(`{}`), 0o644))
	t.Setenv("KILN_REDFISH_MOCKUPS", dir)
	if got, err := redfish.MockupsDir(); err != nil || got != dir {
		t.Fatalf("MockupsDir() = %q, %v; want %q (any tree will do)", got, err, dir)
	}
	if trees, _ := redfish.MockupTrees(dir); len(trees) != 1 || trees[0] != "vendor-x" {
		t.Fatalf("MockupTrees() = %v, want [vendor-x]", trees)
	}
}

func TestAdminAPI(t *testing.T) {
	e, _, c := newEmulator(t, false)
	req := func(method, body, user, pw string) (int, redfish.Faults) {
		r, err := http.NewRequest(method, c.base+redfish.AdminPath, strings.NewReader(body))
		require.NoError(t, err)
		r.SetBasicAuth(user, pw)
		resp, err := http.DefaultClient.Do(r)
		require.NoError(t, err)
		defer resp.Body.Close()
		var f redfish.Faults
		_ = json.NewDecoder(resp.Body).Decode(&f)
		return resp.StatusCode, f
	}
	if code, _ := req("PATCH", `{"failNext":1}`, "admin", "nope"); code != 401 {
		t.Fatalf("admin PATCH with a wrong password = %d, want 401", code)
	}
	code, f := req("PATCH", `{"failNext":2,"failStatus":502,"powerLies":true}`, "admin", "pw")
	if code != 200 || *f.FailNext != 2 || *f.FailStatus != 502 || !*f.PowerLies {
		t.Fatalf("admin PATCH = %d %+v", code, f)
	}
	if resp, _ := c.do("GET", "/redfish/v1/", ""); resp.StatusCode != 502 {
		t.Fatalf("GET after failNext=2 via the admin API = %d, want 502", resp.StatusCode)
	}
	code, f = req("DELETE", "", "admin", "pw")
	if code != 200 || *f.FailNext != 0 || *f.PowerLies {
		t.Fatalf("admin DELETE = %d %+v, want faults cleared", code, f)
	}
	if st := e.Stats(); st.Requests != 1 {
		t.Fatalf("Stats().Requests = %d, want 1 (admin calls are not counted)", st.Requests)
	}
}

func TestAuthModes(t *testing.T) {
	tests := []struct {
		auth                     string
		wantSessionService       bool
		loginStatus, basicStatus int
	}{
		{auth: redfish.AuthBoth, wantSessionService: true, loginStatus: 201, basicStatus: 200},
		{auth: redfish.AuthBasicOnly, wantSessionService: false, loginStatus: 401, basicStatus: 200},
		{auth: redfish.AuthSessionOnly, wantSessionService: true, loginStatus: 201, basicStatus: 401},
	}
	for _, tc := range tests {
		t.Run(tc.auth, func(t *testing.T) {
			e, err := redfish.New(redfish.Config{Username: "admin", Password: "pw", Auth: tc.auth,
				Systems: []redfish.System{{ID: "S1", Machine: &machine.Memory{}}}})
			require.NoError(t, err)
			e.Start()
			t.Cleanup(e.Close)
			c := &client{t: t, base: e.URL(), http: http.DefaultClient}

			_, root := c.do("GET", "/redfish/v1/", "")
			_, hasSS := root["SessionService"]
			links, _ := root["Links"].(map[string]any)
			_, hasSessions := links["Sessions"]
			if hasSS != tc.wantSessionService || hasSessions != tc.wantSessionService {
				t.Fatalf("service root SessionService %v, Links.Sessions %v; want %v", hasSS, hasSessions, tc.wantSessionService)
			}
			resp, _ := c.do("POST", "/redfish/v1/SessionService/Sessions", `{"UserName":"admin","Password":"pw"}`)
			if resp.StatusCode != tc.loginStatus {
				t.Fatalf("session login = %d, want %d", resp.StatusCode, tc.loginStatus)
			}
			req, _ := http.NewRequest("GET", e.URL()+"/redfish/v1/Systems/S1", nil)
			req.SetBasicAuth("admin", "pw")
			r, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			r.Body.Close()
			if r.StatusCode != tc.basicStatus {
				t.Fatalf("GET with basic auth = %d, want %d", r.StatusCode, tc.basicStatus)
			}
		})
	}
	if _, err := redfish.New(redfish.Config{Auth: "digest", Systems: []redfish.System{{ID: "S1", Machine: &machine.Memory{}}}}); err == nil {
		t.Fatal(`New(Auth: "digest") = nil error, want InvalidArgument`)
	}
}
