package limits

import (
	"fmt"
	"net"
	"net/http"
	"strconv"
)

// DefaultBoot is the rate of each client address on the boot server's
// token-minting paths (iPXE scripts and ISOs): a booting host asks for a
// few; an address asking for hundreds is minting tokens.
var DefaultBoot = Rate{PerSecond: 10, Burst: 100}

// HTTP wraps next so that requests for which limited returns true are
// counted against their client address's bucket in l; over it they get
// 429 Too Many Requests with Retry-After (seconds) and a message saying
// so. Other requests pass untouched.
func HTTP(l *Limiter, limited func(*http.Request) bool, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !limited(r) {
			next.ServeHTTP(w, r)
			return
		}
		addr := r.RemoteAddr
		if h, _, err := net.SplitHostPort(addr); err == nil {
			addr = h
		}
		if ok, wait := l.Allow(addr); !ok {
			w.Header().Set("Retry-After", strconv.Itoa(int(wait.Seconds())))
			http.Error(w, fmt.Sprintf("rate limit: client %s is over %s on the boot server; retry after %v", addr, l.Rate(), wait), http.StatusTooManyRequests)
			return
		}
		next.ServeHTTP(w, r)
	})
}
