package redfish

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
)

// MockupHandler serves a DMTF Redfish mockup tree: a GET of
// /redfish/v1/A/B answers DIR/A/B/index.json. Logins
// (POST .../SessionService/Sessions) get a fixed token so session-based
// clients work; DELETE of a session succeeds.
//
// Writes go to an in-memory overlay over the tree (the files are never
// changed), so that power, boot and virtual media can be driven on any
// tree:
//
//   - PATCH of a resource's Boot: each BootSourceOverride* value is checked
//     against its @Redfish.AllowableValues (400 PropertyValueNotInList);
//   - POST .../Actions/ComputerSystem.Reset, where the resource offers
//     the action: On, ForceOn, ForceRestart, GracefulRestart, PowerCycle
//     leave PowerState On (a one-time boot override is consumed), ForceOff
//     and GracefulShutdown Off, PushPowerButton toggles, Nmi nothing; a
//     ResetType outside the action's AllowableValues is 400;
//   - POST .../Actions/VirtualMedia.InsertMedia and .EjectMedia, where the
//     slot offers them, set Image and Inserted.
//
// Every other write is refused with 405. dir is for example
// fixtures/redfish-mockups/public-rackmount1.
func MockupHandler(dir string) http.Handler {
	root, err := os.OpenRoot(dir)
	m := &mockup{root: root, overlay: map[string]map[string]any{}}
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
		case r.Method == http.MethodDelete && strings.Contains(rel, "SessionService/Sessions/"):
			w.WriteHeader(http.StatusNoContent)
		case r.Method == http.MethodGet || r.Method == http.MethodHead:
			m.get(w, r, rel)
		case r.Method == http.MethodPatch:
			m.patch(w, r, rel)
		case r.Method == http.MethodPost && strings.Contains(rel, "/Actions/"):
			m.action(w, r, rel)
		default:
			writeError(w, http.StatusMethodNotAllowed, "Base.1.8.OperationNotAllowed", "mockups are read-only except Boot, Reset and virtual media")
		}
	})
}

type mockup struct {
	root *os.Root

	mu      sync.Mutex
	overlay map[string]map[string]any // by rel path: resources written to
}

// loadLocked returns the resource at rel: the overlay's copy, or the
// file's.
func (m *mockup) loadLocked(rel string) (map[string]any, bool) {
	if doc, ok := m.overlay[rel]; ok {
		return doc, true
	}
	data, err := m.root.ReadFile(filepath.Join(filepath.FromSlash(rel), "index.json"))
	if err != nil {
		return nil, false
	}
	var doc map[string]any
	if json.Unmarshal(data, &doc) != nil {
		return nil, false
	}
	return doc, true
}

func (m *mockup) get(w http.ResponseWriter, r *http.Request, rel string) {
	m.mu.Lock()
	doc, written := m.overlay[rel]
	var body []byte
	if written {
		body, _ = json.Marshal(doc)
	}
	m.mu.Unlock()
	if !written {
		var err error
		body, err = m.root.ReadFile(filepath.Join(filepath.FromSlash(rel), "index.json"))
		if err != nil {
			writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no resource at "+r.URL.Path)
			return
		}
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("OData-Version", "4.0")
	_, _ = w.Write(body)
}

// allowed reports whether v is in obj[prop+"@Redfish.AllowableValues"]
// (true when the resource lists none).
func allowed(obj map[string]any, prop, v string) bool {
	list, ok := obj[prop+"@Redfish.AllowableValues"].([]any)
	return !ok || slices.Contains(list, any(v))
}

func (m *mockup) patch(w http.ResponseWriter, r *http.Request, rel string) {
	var body map[string]any
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		writeError(w, http.StatusBadRequest, "Base.1.8.MalformedJSON", "malformed PATCH body")
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	doc, ok := m.loadLocked(rel)
	if !ok {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no resource at "+r.URL.Path)
		return
	}
	boot, hasBoot := doc["Boot"].(map[string]any)
	patch, _ := body["Boot"].(map[string]any)
	if !hasBoot || patch == nil || len(body) != 1 {
		writeError(w, http.StatusMethodNotAllowed, "Base.1.8.OperationNotAllowed", "mockups take PATCHes of Boot only")
		return
	}
	for k, v := range patch {
		s, _ := v.(string)
		if !strings.HasPrefix(k, "BootSourceOverride") || !allowed(boot, k, s) {
			writeError(w, http.StatusBadRequest, "Base.1.8.PropertyValueNotInList",
				fmt.Sprintf("the value %v for the property %s is not in the list of acceptable values", v, k))
			return
		}
	}
	for k, v := range patch {
		boot[k] = v
	}
	m.overlay[rel] = doc
	w.WriteHeader(http.StatusNoContent)
}

func (m *mockup) action(w http.ResponseWriter, r *http.Request, rel string) {
	res, name, _ := strings.Cut(rel, "/Actions/")
	var body map[string]any
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		body = map[string]any{}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	doc, ok := m.loadLocked(res)
	actions, _ := doc["Actions"].(map[string]any)
	// The action is the one whose target is this URL (its last element
	// may differ from the action's name: .../Actions/VM.InsertMedia).
	var act map[string]any
	for key, a := range actions {
		a, _ := a.(map[string]any)
		target, _ := a["target"].(string)
		if a != nil && strings.TrimSuffix(path.Clean(target), "/") == "/redfish/v1/"+rel {
			act, name = a, strings.TrimPrefix(key, "#")
		}
	}
	if !ok || act == nil {
		writeError(w, http.StatusNotFound, "Base.1.8.ActionNotSupported", "the resource offers no action "+name)
		return
	}
	switch name {
	case "ComputerSystem.Reset":
		rt, _ := body["ResetType"].(string)
		if rt == "" || !allowed(act, "ResetType", rt) {
			writeError(w, http.StatusBadRequest, "Base.1.8.ActionParameterValueNotInList",
				fmt.Sprintf("ResetType %q is not supported", rt))
			return
		}
		was := doc["PowerState"]
		switch rt {
		case "On", "ForceOn", "ForceRestart", "GracefulRestart", "PowerCycle":
			doc["PowerState"] = "On"
		case "ForceOff", "GracefulShutdown":
			doc["PowerState"] = "Off"
		case "PushPowerButton":
			doc["PowerState"] = map[bool]string{true: "Off", false: "On"}[was == "On"]
		}
		if boot, ok := doc["Boot"].(map[string]any); ok && doc["PowerState"] == "On" && rt != "Nmi" && boot["BootSourceOverrideEnabled"] == "Once" {
			boot["BootSourceOverrideEnabled"] = "Disabled"
		}
	case "VirtualMedia.InsertMedia":
		img, _ := body["Image"].(string)
		if img == "" {
			writeError(w, http.StatusBadRequest, "Base.1.8.ActionParameterMissing", "InsertMedia needs an Image")
			return
		}
		doc["Image"], doc["Inserted"] = img, true
	case "VirtualMedia.EjectMedia":
		doc["Image"], doc["Inserted"] = nil, false
	default:
		writeError(w, http.StatusMethodNotAllowed, "Base.1.8.OperationNotAllowed", "mockups do not perform "+name)
		return
	}
	m.overlay[res] = doc
	w.WriteHeader(http.StatusNoContent)
}
