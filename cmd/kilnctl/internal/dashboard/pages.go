package dashboard

import (
	"bytes"
	"context"
	"embed"
	"hash/fnv"
	"html/template"
	"log/slog"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/cmd/kilnctl/internal/describe"
	"github.com/kilnhq/kiln/internal/errgrpc"
	opprogress "github.com/kilnhq/kiln/internal/progress"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

//go:embed templates static
var assets embed.FS

func parseTemplates() (*template.Template, error) {
	return template.New("").Funcs(template.FuncMap{
		"hostState":      describe.HostState,
		"dash":           describe.Dash,
		"statusClass":    statusClass,
		"conditionClass": conditionClass,
		"bytes":          humanBytes,
		"pct":            func(f float64) string { return strconv.FormatFloat(f, 'f', 0, 64) },
		"labels":         labelString,
		"dist":           func(id, title string, c []count) distView { return distView{ID: id, Title: title, Counts: c} },
		"timestamp": func(ts *timestamppb.Timestamp) string {
			if ts == nil {
				return "-"
			}
			return ts.AsTime().UTC().Format(time.RFC3339)
		},
		"query": url.QueryEscape,
		"first": func(n int, rows []bmcRow) []bmcRow { return rows[:min(n, len(rows))] },
	}).ParseFS(assets, "templates/*.html")
}

// distView is one distribution block of the overview; ID names it for
// tests and links (data-dist).
type distView struct {
	ID, Title string
	Counts    []count
}

// frame is what every fragment gets: the view and the fleet's health.
type frame struct {
	V      any
	Errors []string
	Synced bool
	// Now is the time of the render, for ages.
	Now time.Time
}

// age is a kubectl-style age at the time of the render.
func (f frame) Age(ts *timestamppb.Timestamp) string { return describe.Age(ts, f.Now) }

// Duration is how long op ran (or has been running).
func (f frame) Duration(op *typesv1.OperationStatus) string {
	if op.GetStarted() == nil {
		return "-"
	}
	end := f.Now
	if op.GetFinished() != nil {
		end = op.GetFinished().AsTime()
	}
	return max(end.Sub(op.GetStarted().AsTime()), 0).Round(time.Second).String()
}

// view renders the part of a page that live updates replace: its
// template and data, or status (404) when the page's object is gone.
type view func(s *Server, r *http.Request, f *fleet) (title, tmpl string, data any, status int)

func viewOverviewPage(s *Server, _ *http.Request, f *fleet) (string, string, any, int) {
	return "Fleet", "overview", viewOverview(f, s.cfg.Now()), http.StatusOK
}

func viewHosts(s *Server, r *http.Request, f *fleet) (string, string, any, int) {
	state := r.URL.Query().Get("state")
	title := "Hosts"
	if state != "" {
		title = state + " hosts"
	}
	return title, "hosts", viewHostList(f, state), http.StatusOK
}

func viewHost(s *Server, r *http.Request, f *fleet) (string, string, any, int) {
	name := r.PathValue("name")
	var h *typesv1.Host
	for _, x := range f.Hosts {
		if x.GetMetadata().GetName() == name {
			h = x
		}
	}
	if h == nil {
		return "Host " + name, "missing", missing{Kind: "host", Name: name}, http.StatusNotFound
	}
	evs := s.events.get(r.Context(), "Host", name, s.cfg.Events)
	return "Host " + name, "host", viewHostPage(h, f.journal[name], clusterOf(f, h), evs, s.cfg.Now()), http.StatusOK
}

func viewCluster(s *Server, r *http.Request, f *fleet) (string, string, any, int) {
	name := r.PathValue("name")
	var c *typesv1.Cluster
	for _, x := range f.Clusters {
		if x.GetMetadata().GetName() == name {
			c = x
		}
	}
	if c == nil {
		return "Cluster " + name, "missing", missing{Kind: "cluster", Name: name}, http.StatusNotFound
	}
	tree := describe.ClusterTree(describe.Collect(c, f.Resources), s.cfg.Now())
	return "Cluster " + name, "cluster", clusterView{
		Cluster: c, Tree: describe.Rows(tree), Events: s.events.get(r.Context(), "Cluster", name, s.cfg.Events),
	}, http.StatusOK
}

// missing is the page of an object that does not exist (or no longer).
type missing struct{ Kind, Name string }

// fragment renders v for r from the cache.
func (s *Server) fragment(r *http.Request, v view) (title string, body []byte, status int, err error) {
	f := s.cache.snapshot()
	title, tmpl, data, status := v(s, r, f)
	var buf bytes.Buffer
	err = s.pages.ExecuteTemplate(&buf, tmpl, frame{V: data, Errors: f.Errors, Synced: f.Synced, Now: s.cfg.Now()})
	return title, buf.Bytes(), status, err
}

func digest(b []byte) string {
	h := fnv.New64a()
	h.Write(b)
	return strconv.FormatUint(h.Sum64(), 36)
}

// page serves a whole page: the layout around v's fragment, and the
// address of the live stream that replaces the fragment as the fleet
// changes.
func (s *Server) page(v view) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		title, body, status, err := s.fragment(r, v)
		if err != nil {
			s.log.Error("render failed", "path", r.URL.Path, "err", err)
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		q := r.URL.Query()
		q.Set("h", digest(body))
		live := "/live" + r.URL.Path + "?" + q.Encode()
		if r.URL.Path == "/" {
			live = "/live/?" + q.Encode()
		}
		var buf bytes.Buffer
		err = s.pages.ExecuteTemplate(&buf, "layout", struct {
			Title, Live, Controller, Identity string
			Body                              template.HTML
		}{title, live, s.cfg.Controller, s.cfg.Identity, template.HTML(body)})
		if err != nil {
			s.log.Error("render failed", "path", r.URL.Path, "err", err)
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.WriteHeader(status)
		_, _ = w.Write(buf.Bytes())
	}
}

// live streams v's fragment as server-sent events ("update", the HTML
// the htmx SSE extension swaps into the page): again after every change
// of the fleet, at most once per PushInterval, and every
// RefreshInterval so that ages move; never the same HTML twice. The
// query's h is the digest of the fragment the page was served with.
func (s *Server) live(v view) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		if err := rc.Flush(); err != nil {
			return
		}
		last := r.URL.Query().Get("h")
		refresh := time.NewTicker(s.cfg.RefreshInterval)
		defer refresh.Stop()
		ctx := r.Context()
		for {
			_, changed := s.cache.changes()
			_, body, _, err := s.fragment(r, v)
			if err != nil {
				s.log.Error("render failed", "path", r.URL.Path, "err", err)
				return
			}
			if d := digest(body); d != last {
				last = d
				var ev bytes.Buffer
				ev.WriteString("event: update\n")
				for _, line := range strings.Split(string(body), "\n") {
					ev.WriteString("data: " + line + "\n")
				}
				ev.WriteString("\n")
				if _, err := w.Write(ev.Bytes()); err != nil {
					return
				}
			} else if _, err := w.Write([]byte(": ping\n\n")); err != nil {
				return
			}
			if err := rc.Flush(); err != nil {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-changed:
			case <-refresh.C:
			}
			t := time.NewTimer(s.cfg.PushInterval)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
	}
}

// eventCache reads recent events for the cluster and host pages, at most
// once per ttl per object however many pages show them.
type eventCache struct {
	api     API
	log     *slog.Logger
	timeout time.Duration
	now     func() time.Time
	ttl     time.Duration

	mu    sync.Mutex
	items map[string]eventEntry
}

type eventEntry struct {
	at     time.Time
	events []*typesv1.Event
}

func newEventCache(api API, timeout time.Duration, now func() time.Time, log *slog.Logger) *eventCache {
	return &eventCache{api: api, log: log, timeout: timeout, now: now, ttl: 2 * time.Second, items: map[string]eventEntry{}}
}

// get returns the recent events of kind/name. When the controller does
// not answer it returns the last events read (or none): the page says
// so through the watch errors.
func (e *eventCache) get(ctx context.Context, kind, name string, limit int64) []*typesv1.Event {
	key := kind + "/" + name
	e.mu.Lock()
	ent, ok := e.items[key]
	e.mu.Unlock()
	if ok && e.now().Sub(ent.at) < e.ttl {
		return ent.events
	}
	cctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	resp, err := e.api.ListEvents(cctx, &controllerv1.ListEventsRequest{ObjectKind: kind, ObjectName: name, Limit: limit})
	if err != nil {
		e.log.Warn("list events failed", "object", key, "err", errgrpc.FromGRPC(err))
		return ent.events
	}
	evs := resp.GetEvents()
	// Newest first, as a person reads a journal.
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].GetTime().AsTime().After(evs[j].GetTime().AsTime()) })
	e.mu.Lock()
	e.items[key] = eventEntry{at: e.now(), events: evs}
	if len(e.items) > 256 {
		for k, v := range e.items {
			if e.now().Sub(v.at) > e.ttl {
				delete(e.items, k)
			}
		}
	}
	e.mu.Unlock()
	return evs
}

// humanBytes is b in IEC units, "-" for none.
func humanBytes(b uint64) string {
	if b == 0 {
		return "-"
	}
	return opprogress.Bytes(b)
}

func labelString(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ", ")
}
