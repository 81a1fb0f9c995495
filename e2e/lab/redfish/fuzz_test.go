package redfish_test

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnhq/kiln/e2e/lab/machine"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/testenv"
)

// checkJSONResponse checks what a Redfish client relies on: a JSON body
// (or none for 204 and HEAD) and no server error.
func checkJSONResponse(t *testing.T, what string, rec *httptest.ResponseRecorder, method string) {
	t.Helper()
	if rec.Code >= 500 {
		t.Fatalf("%s = %d: %s", what, rec.Code, rec.Body)
	}
	if rec.Code == http.StatusNoContent || method == http.MethodHead {
		return
	}
	if rec.Code/100 == 3 && rec.Header().Get("Location") != "" {
		return // net/http's redirect to the clean path ("/." to "/")
	}
	if !json.Valid(rec.Body.Bytes()) {
		t.Fatalf("%s = %d with a body that is not JSON: %q", what, rec.Code, rec.Body)
	}
}

// FuzzMockupHandler drives the DMTF mockup trees (shared/fixtures) with
// any method, path and JSON body, seeded with each tree's own resources,
// Boot properties and actions. Properties: every answer is JSON and never
// a server error; after an accepted PATCH the resource still reads as
// JSON with the patched Boot values; nothing outside the tree is served.
func FuzzMockupHandler(f *testing.F) {
	root, err := redfish.MockupsDir()
	if err != nil {
		testenv.Skip(f, err.Error())
	}
	dir := filepath.Join(root, "public-rackmount1")
	// Seeds: every resource of the tree, PATCHes of Boot with its
	// allowable values, and each action with its first allowable value.
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "index.json" {
			return err
		}
		rel, _ := filepath.Rel(dir, filepath.Dir(p))
		url := strings.TrimSuffix("/redfish/v1/"+filepath.ToSlash(rel), "/.")
		f.Add("GET", url, "")
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		var doc map[string]any
		if json.Unmarshal(b, &doc) != nil {
			return nil
		}
		if boot, ok := doc["Boot"].(map[string]any); ok {
			for k, v := range boot {
				if list, ok := v.([]any); ok && strings.HasSuffix(k, "@Redfish.AllowableValues") && len(list) > 0 {
					body, _ := json.Marshal(map[string]any{"Boot": map[string]any{strings.TrimSuffix(k, "@Redfish.AllowableValues"): list[len(list)-1]}})
					f.Add("PATCH", url, string(body))
				}
			}
		}
		if actions, ok := doc["Actions"].(map[string]any); ok {
			for _, a := range actions {
				a, _ := a.(map[string]any)
				target, _ := a["target"].(string)
				if target == "" {
					continue
				}
				body := "{}"
				if list, ok := a["ResetType@Redfish.AllowableValues"].([]any); ok && len(list) > 0 {
					b, _ := json.Marshal(map[string]any{"ResetType": list[0]})
					body = string(b)
				}
				if strings.HasSuffix(target, "InsertMedia") {
					body = `{"Image":"http://10.0.0.1/boot/iso/rack1-07.iso","Inserted":true}`
				}
				f.Add("POST", target, body)
			}
		}
		return nil
	})
	f.Add("POST", "/redfish/v1/SessionService/Sessions", `{"UserName":"admin","Password":"pw"}`)
	f.Add("GET", "/redfish/v1/../../../etc/passwd", "")
	f.Add("PATCH", "/redfish/v1/Systems/437XR1238R2", `{"Boot":{"BootSourceOverrideTarget":{"a":[1,2]}}}`)
	h := redfish.MockupHandler(dir)
	f.Fuzz(func(t *testing.T, method, path, body string) {
		req, err := http.NewRequest(method, "http://bmc"+path, strings.NewReader(body))
		if err != nil || req.URL.Path == "" || !strings.HasPrefix(req.URL.Path, "/") {
			return
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		what := method + " " + path + " " + body
		checkJSONResponse(t, what, rec, method)
		if bytes.Contains(rec.Body.Bytes(), []byte("root:x:0:0")) {
			t.Fatalf("%s served a file outside the mockup tree", what)
		}
		if method != http.MethodPatch || rec.Code != http.StatusNoContent {
			return
		}
		get := httptest.NewRecorder()
		h.ServeHTTP(get, httptest.NewRequest(http.MethodGet, req.URL.Path, nil))
		var doc, patch map[string]any
		if get.Code != http.StatusOK || json.Unmarshal(get.Body.Bytes(), &doc) != nil {
			t.Fatalf("GET after an accepted %s = %d %q", what, get.Code, get.Body)
		}
		_ = json.Unmarshal([]byte(body), &patch)
		want, _ := json.Marshal(patch["Boot"])
		boot, _ := doc["Boot"].(map[string]any)
		for k := range patch["Boot"].(map[string]any) {
			got, _ := json.Marshal(boot[k])
			var w map[string]json.RawMessage
			_ = json.Unmarshal(want, &w)
			if !bytes.Equal(got, w[k]) && !jsonEqual(got, w[k]) {
				t.Fatalf("after %s, Boot.%s reads %s, want %s", what, k, got, w[k])
			}
		}
	})
}

func jsonEqual(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}

// FuzzEmulator drives the lab's Redfish emulator with any method, path,
// body and credentials. Properties: every answer is JSON and never a
// server error; the BMC password is never in an answer; a boot override
// the emulator accepts is what it then reports.
func FuzzEmulator(f *testing.F) {
	const password = "emulator-secret-pw"
	m := &machine.Memory{}
	e, err := redfish.New(redfish.Config{Username: "admin", Password: password, MaxSessions: 4,
		Systems: []redfish.System{{ID: "S1", Machine: m}}})
	if err != nil {
		f.Fatal(err)
	}
	for _, s := range [][3]string{
		{"GET", "/redfish/v1/", ""},
		{"GET", "/redfish/v1/Systems/S1", ""},
		{"PATCH", "/redfish/v1/Systems/S1", `{"Boot":{"BootSourceOverrideTarget":"Pxe","BootSourceOverrideEnabled":"Once","BootSourceOverrideMode":"UEFI"}}`},
		{"POST", "/redfish/v1/Systems/S1/Actions/ComputerSystem.Reset", `{"ResetType":"ForceRestart"}`},
		{"POST", "/redfish/v1/Managers/BMC/VirtualMedia/CD1/Actions/VirtualMedia.InsertMedia", `{"Image":"http://10.0.0.1/boot/iso/a.iso"}`},
		{"POST", "/redfish/v1/Managers/BMC/VirtualMedia/CD1/Actions/VirtualMedia.EjectMedia", `{}`},
		{"POST", "/redfish/v1/SessionService/Sessions", `{"UserName":"admin","Password":"` + password + `"}`},
		{"DELETE", "/redfish/v1/SessionService/Sessions/1", ""},
		{"GET", "/redfish/v1/Managers/BMC/VirtualMedia/CD1", ""},
	} {
		f.Add(s[0], s[1], s[2], true)
	}
	f.Fuzz(func(t *testing.T, method, path, body string, basic bool) {
		req, err := http.NewRequest(method, "http://bmc"+path, strings.NewReader(body))
		if err != nil || !strings.HasPrefix(req.URL.Path, "/") || req.URL.Path == redfish.AdminPath {
			return
		}
		if basic {
			req.SetBasicAuth("admin", password)
		}
		rec := httptest.NewRecorder()
		e.ServeHTTP(rec, req)
		what := method + " " + path + " " + body
		checkJSONResponse(t, what, rec, method)
		if strings.Contains(rec.Body.String(), password) {
			t.Fatalf("%s answers with the BMC password: %s", what, rec.Body)
		}
		if method != http.MethodPatch || rec.Code != http.StatusNoContent || !strings.HasPrefix(req.URL.Path, "/redfish/v1/Systems/") {
			return
		}
		var patch struct{ Boot map[string]string }
		if json.Unmarshal([]byte(body), &patch) != nil || patch.Boot == nil {
			return
		}
		target, enabled, mode := e.BootOverride("S1")
		for k, got := range map[string]string{"BootSourceOverrideTarget": target, "BootSourceOverrideMode": mode} {
			if v := patch.Boot[k]; v != "" && v != got {
				t.Fatalf("after %s, %s = %q, want %q", what, k, got, v)
			}
		}
		if v := patch.Boot["BootSourceOverrideEnabled"]; v != "" && v != enabled {
			t.Fatalf("after %s, BootSourceOverrideEnabled = %q, want %q", what, enabled, v)
		}
	})
}
