// Package promserve serves a Prometheus scrape endpoint (/metrics) on a
// listener until its context ends: the one HTTP server the controller and
// the agent both run for their metrics.
package promserve

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// Serve serves h at /metrics on lis until ctx ends (then it shuts down,
// waiting up to 2 s for scrapes in flight, and returns nil) or serving
// fails (it returns that error). Server errors go to log at Warn.
func Serve(ctx context.Context, lis net.Listener, h http.Handler, log *slog.Logger) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", h)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	if log != nil {
		srv.ErrorLog = slog.NewLogLogger(log.Handler(), slog.LevelWarn)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(lis) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = srv.Shutdown(sctx)
	<-done
	return nil
}
