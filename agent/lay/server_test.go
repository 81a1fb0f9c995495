package lay

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// imageServer serves one image over HTTP on loopback with real Range
// support (http.ServeContent) and injects faults: it can drop connections
// after some bytes, stop at a fixed offset every time, ignore Range, or
// serve a corrupted byte.
type imageServer struct {
	data []byte

	// dropAfter aborts each of the first drops responses after that many
	// body bytes (the client sees a connection reset mid-body).
	dropAfter int64
	drops     atomic.Int64
	// truncateAt aborts every response when it reaches that offset of the
	// image (a server that always closes early); 0 disables it.
	truncateAt int64
	// ignoreRange answers every request with 200 and the whole image.
	ignoreRange bool
	// status, when set, is the answer to every request.
	status int

	mu     sync.Mutex
	ranges []string // Range header of each request ("" for none)
	sent   atomic.Int64

	srv *httptest.Server
}

func newImageServer(t testing.TB, data []byte, configure func(*imageServer)) *imageServer {
	t.Helper()
	s := &imageServer{data: data}
	if configure != nil {
		configure(s)
	}
	s.srv = httptest.NewServer(s)
	t.Cleanup(s.srv.Close)
	return s
}

func (s *imageServer) url() string { return s.srv.URL + "/image.raw" }

func (s *imageServer) requests() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.ranges...)
}

func (s *imageServer) rangeRequests() int {
	n := 0
	for _, r := range s.requests() {
		if r != "" {
			n++
		}
	}
	return n
}

func (s *imageServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.ranges = append(s.ranges, r.Header.Get("Range"))
	s.mu.Unlock()
	if s.status != 0 {
		http.Error(w, http.StatusText(s.status), s.status)
		return
	}
	if s.ignoreRange {
		r.Header.Del("Range")
	}
	start := int64(0)
	if v, ok := strings.CutPrefix(r.Header.Get("Range"), "bytes="); ok {
		f, _, _ := strings.Cut(v, "-")
		start, _ = strconv.ParseInt(f, 10, 64)
	}
	cw := &faultWriter{ResponseWriter: w, s: s, pos: start, limit: -1}
	if s.dropAfter > 0 && s.drops.Add(-1) >= 0 {
		cw.limit = s.dropAfter
	}
	if s.truncateAt > 0 {
		if l := s.truncateAt - start; cw.limit < 0 || l < cw.limit {
			cw.limit = max(l, 0)
		}
	}
	w.Header().Set("ETag", `"image-v1"`)
	http.ServeContent(cw, r, "image.raw", time.Unix(1700000000, 0), bytes.NewReader(s.data))
}

// faultWriter counts body bytes and aborts the connection at limit.
type faultWriter struct {
	http.ResponseWriter
	s       *imageServer
	pos     int64
	written int64
	limit   int64 // -1: no limit
}

func (w *faultWriter) Write(p []byte) (int, error) {
	if w.limit >= 0 && w.written+int64(len(p)) > w.limit {
		p = p[:w.limit-w.written]
		n, _ := w.ResponseWriter.Write(p)
		w.s.sent.Add(int64(n))
		w.ResponseWriter.(http.Flusher).Flush()
		panic(http.ErrAbortHandler) // net/http closes the connection
	}
	n, err := w.ResponseWriter.Write(p)
	w.written += int64(n)
	w.pos += int64(n)
	w.s.sent.Add(int64(n))
	return n, err
}

// stallServer sends the first half of the image and then stops sending,
// without closing, on its first response; later responses serve Range
// requests normally.
func stallServer(t testing.TB, data []byte) (*httptest.Server, *atomic.Int64) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			w.Header().Set("Content-Length", strconv.Itoa(len(data)))
			w.WriteHeader(http.StatusOK)
			w.Write(data[:len(data)/2])
			w.(http.Flusher).Flush()
			<-r.Context().Done() // stalled until the client gives up
			return
		}
		http.ServeContent(w, r, "image.raw", time.Unix(1700000000, 0), bytes.NewReader(data))
	}))
	t.Cleanup(srv.Close)
	return srv, &calls
}
