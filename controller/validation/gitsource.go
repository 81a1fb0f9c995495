package validation

import (
	"net"
	"net/url"
	"path"
	"slices"
	"strings"
	"time"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// GitSource defaults, applied by the GitSource controller when a field is
// empty.
const (
	DefaultGitBranch   = "main"
	DefaultGitInterval = time.Minute
	// MinGitInterval bounds how often a source may fetch.
	MinGitInterval = time.Second
)

// checkGitSource checks a GitSource spec on its own.
//
// URL schemes: https (the default choice), file (a repository on the
// controller's own disk) and, because they are neither authenticated nor
// encrypted, git and http only to a loopback host: a GitSource's commits
// are applied with the controller's authority, so whoever can change the
// bytes on the way can change the fleet. Credentials in the URL are
// refused (they would be stored and shown in plain text).
func checkGitSource(p *problems, s *typesv1.GitSourceSpec) {
	switch u, err := url.Parse(s.GetUrl()); {
	case s.GetUrl() == "":
		p.add("spec.url", "is required (https://host/repo.git, or file:///path for a repository on the controller, under its --gitsource-file-root)")
	case err != nil:
		p.add("spec.url", "is not a URL") // not quoted: it may hold a password
	case u.User != nil && slices.Contains([]string{"https", "http", "git", "file"}, u.Scheme):
		p.add("spec.url", "carries credentials: they would be stored and shown in plain text; credentials are not supported yet")
	case u.Scheme == "https":
		if u.Host == "" {
			p.add("spec.url", "%q has no host", s.GetUrl())
		}
	case u.Scheme == "file":
		if u.Host != "" || !strings.HasPrefix(u.Path, "/") {
			p.add("spec.url", "%q: a file URL is file:///absolute/path", s.GetUrl())
		}
	case u.Scheme == "git" || u.Scheme == "http":
		if !loopback(u.Hostname()) {
			p.add("spec.url", "%q: %s:// is neither authenticated nor encrypted, and a GitSource is applied with the controller's authority: use https (git:// and http:// only to a loopback host, for tests)", s.GetUrl(), u.Scheme)
		}
	default:
		p.add("spec.url", "scheme %q is not supported (ssh is not, yet): use https, file, or git/http on loopback", u.Scheme)
	}
	if b := s.GetBranch(); b != "" && (strings.ContainsAny(b, " ~^:?*[\\") || strings.HasPrefix(b, "-") || strings.Contains(b, "..")) {
		p.add("spec.branch", "%q is not a branch name", b)
	}
	if pth := s.GetPath(); pth != "" {
		clean := path.Clean(pth)
		if path.IsAbs(pth) || clean == ".." || strings.HasPrefix(clean, "../") {
			p.add("spec.path", "%q must be a relative path inside the repository", pth)
		}
	}
	if iv := s.GetInterval(); iv != "" {
		d, err := time.ParseDuration(iv)
		switch {
		case err != nil:
			p.add("spec.interval", "%q is not a duration (30s, 5m)", iv)
		case d < MinGitInterval:
			p.add("spec.interval", "%s is shorter than %s", iv, MinGitInterval)
		}
	}
}

func loopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
