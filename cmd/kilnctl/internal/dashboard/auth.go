package dashboard

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
)

// auth is the dashboard's guard: the loopback address it answers as, the
// one-time login token and the session it is exchanged for.
type auth struct {
	mu sync.Mutex
	// hosts are the Host header values the dashboard answers to:
	// "127.0.0.1:PORT", "localhost:PORT" (or "[::1]:PORT").
	hosts   map[string]bool
	base    string // "http://127.0.0.1:PORT"
	cookie  string // the cookie's name: one per port, so two dashboards do not collide
	token   string // "" once redeemed
	session string // "" until the token is redeemed
}

// secret returns 32 random bytes, base64url.
func secret() (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(b), nil
}

func newAuth(token string) (*auth, error) {
	if token == "" {
		var err error
		if token, err = secret(); err != nil {
			return nil, err
		}
	}
	return &auth{token: token}, nil
}

// bind sets the address the dashboard answers as.
func (a *auth) bind(addr *net.TCPAddr) {
	a.mu.Lock()
	defer a.mu.Unlock()
	port := strconv.Itoa(addr.Port)
	ip := addr.IP.String()
	host := net.JoinHostPort(ip, port)
	a.hosts = map[string]bool{host: true, net.JoinHostPort("localhost", port): true}
	a.base = "http://" + host
	a.cookie = "kiln_dashboard_" + port
}

func (a *auth) loginURL() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.base + "/login?token=" + url.QueryEscape(a.token)
}

// sameOrigin reports whether the request is addressed to this dashboard:
// its Host is one of ours (a DNS-rebound name is not) and its Origin,
// when the browser sent one, is ours too.
func (a *auth) sameOrigin(r *http.Request) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.hosts[r.Host] {
		return false
	}
	o := r.Header.Get("Origin")
	if o == "" {
		return true
	}
	u, err := url.Parse(o)
	return err == nil && u.Scheme == "http" && a.hosts[u.Host] && u.Path == "" && u.User == nil
}

// redeem exchanges the one-time token for the session secret: once.
func (a *auth) redeem(token string) (string, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.token == "" || token == "" || subtle.ConstantTimeCompare([]byte(token), []byte(a.token)) != 1 {
		return "", false
	}
	s, err := secret()
	if err != nil {
		return "", false
	}
	a.token, a.session = "", s
	return s, true
}

// authenticated reports whether the request carries the session cookie.
func (a *auth) authenticated(r *http.Request) bool {
	a.mu.Lock()
	name, session := a.cookie, a.session
	a.mu.Unlock()
	if session == "" {
		return false
	}
	c, err := r.Cookie(name)
	return err == nil && subtle.ConstantTimeCompare([]byte(c.Value), []byte(session)) == 1
}

// guard answers for next: 403 (empty) to a request not addressed to this
// loopback address, 401 (empty) without the session, 405 to any method
// but GET. GET /login?token=T redeems the one-time token: it sets the
// session cookie and redirects to the overview.
func (a *auth) guard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Cache-Control", "no-store")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
		if !a.sameOrigin(r) {
			w.WriteHeader(http.StatusForbidden)
			return
		}
		if r.URL.Path == "/login" && r.Method == http.MethodGet {
			s, ok := a.redeem(r.URL.Query().Get("token"))
			if !ok {
				w.WriteHeader(http.StatusUnauthorized)
				return
			}
			a.mu.Lock()
			name := a.cookie
			a.mu.Unlock()
			http.SetCookie(w, &http.Cookie{Name: name, Value: s, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode})
			// 303 to a URL without the token: it leaves the address bar
			// and the history.
			http.Redirect(w, r, "/", http.StatusSeeOther)
			return
		}
		if !a.authenticated(r) {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		if r.Method != http.MethodGet {
			h.Set("Allow", http.MethodGet)
			w.WriteHeader(http.StatusMethodNotAllowed)
			return
		}
		next.ServeHTTP(w, r)
	})
}
