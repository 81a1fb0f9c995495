package redfish

import (
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// MockupHandler serves a DMTF Redfish mockup tree read-only: a GET of
// /redfish/v1/A/B answers DIR/A/B/index.json. Logins
// (POST .../SessionService/Sessions) get a fixed token so session-based
// clients work; DELETE of a session succeeds; every other write is
// refused with 405. dir is for example
// fixtures/redfish-mockups/public-rackmount1.
func MockupHandler(dir string) http.Handler {
	root, err := os.OpenRoot(dir)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err != nil {
			writeError(w, http.StatusInternalServerError, "Base.1.8.InternalError", "mockup tree unavailable")
			return
		}
		p := strings.TrimSuffix(path.Clean(r.URL.Path), "/")
		rel, ok := strings.CutPrefix(p, "/redfish/v1")
		if !ok {
			if p == "/redfish" {
				writeJSON(w, http.StatusOK, map[string]any{"v1": "/redfish/v1/"})
				return
			}
			writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no resource at "+r.URL.Path)
			return
		}
		rel = strings.TrimPrefix(rel, "/")
		switch {
		case r.Method == http.MethodPost && strings.HasSuffix(rel, "SessionService/Sessions"):
			w.Header().Set("Location", "/redfish/v1/SessionService/Sessions/mockup")
			w.Header().Set("X-Auth-Token", "mockup-token")
			writeJSON(w, http.StatusCreated, sessionJSON("mockup", "mockup"))
			return
		case r.Method == http.MethodDelete && strings.Contains(rel, "SessionService/Sessions/"):
			w.WriteHeader(http.StatusNoContent)
			return
		case r.Method != http.MethodGet && r.Method != http.MethodHead:
			writeError(w, http.StatusMethodNotAllowed, "Base.1.8.OperationNotAllowed", "mockups are read-only")
			return
		}
		data, rerr := root.ReadFile(filepath.Join(filepath.FromSlash(rel), "index.json"))
		if rerr != nil {
			writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no resource at "+r.URL.Path)
			return
		}
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		w.Header().Set("OData-Version", "4.0")
		_, _ = w.Write(data)
	})
}
