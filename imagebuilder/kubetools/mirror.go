package kubetools

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/go-retryablehttp"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// download fetches every binary the mirror has into binDir, verifying each
// against the mirror's <name>.sha256, and returns the names it fetched. A
// Kubernetes binary the mirror lacks is a NotFound error; a missing etcd,
// coredns or pause is left for the caller to build (dl.k8s.io does not
// serve them).
func (b *Builder) download(ctx context.Context, binDir string) (map[string]bool, error) {
	r := b.Release
	client := retryablehttp.NewClient()
	if b.HTTP != nil {
		client.HTTPClient = b.HTTP
	}
	client.RetryMax = 4
	client.RetryWaitMin = 100 * time.Millisecond
	client.RetryWaitMax = 2 * time.Second
	client.Logger = nil
	client.ErrorHandler = retryablehttp.PassthroughErrorHandler

	base := strings.TrimRight(b.Mirror, "/")
	kube := map[string]bool{}
	for _, n := range KubernetesBinaries() {
		kube[n] = true
	}
	got := map[string]bool{}
	for i, name := range Binaries() {
		u := fmt.Sprintf("%s/%s/bin/linux/%s/%s", base, r.Kubernetes, b.arch(), name)
		want, err := b.fetchSHA256(ctx, client, u+".sha256")
		if errdefs.IsNotFound(err) && !kube[name] {
			b.stepf("mirror has no %s; it will be built", name)
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("kube-tools %s: %s: %w", r.Kubernetes, name, err)
		}
		b.stepf("downloading %s (%d/%d)", name, i+1, len(Binaries()))
		t0 := time.Now()
		n, err := b.fetchVerified(ctx, client, u, filepath.Join(binDir, name), want)
		if err != nil {
			return nil, fmt.Errorf("kube-tools %s: %s: %w", r.Kubernetes, name, err)
		}
		b.stepf("downloaded %s (%d bytes, sha256 verified) in %s", name, n, time.Since(t0).Round(100*time.Millisecond))
		got[name] = true
	}
	return got, nil
}

// get performs a GET and returns the response of a 200, NotFound for a 404
// and Unavailable otherwise. Errors never carry the URL's credentials.
func get(ctx context.Context, client *retryablehttp.Client, u string) (*http.Response, error) {
	req, err := retryablehttp.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, errdefs.InvalidArgument("mirror URL %s: %v", redactURL(u), scrub(err, u))
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, errdefs.Unavailable("GET %s: %v", redactURL(u), scrub(err, u))
	}
	switch resp.StatusCode {
	case http.StatusOK:
		return resp, nil
	case http.StatusNotFound:
		resp.Body.Close()
		return nil, errdefs.NotFound("GET %s: %s", redactURL(u), resp.Status)
	default:
		resp.Body.Close()
		return nil, errdefs.Unavailable("GET %s: %s", redactURL(u), resp.Status)
	}
}

// fetchSHA256 reads a .sha256 file: the hex digest, optionally followed by
// a file name (sha256sum format).
func (b *Builder) fetchSHA256(ctx context.Context, client *retryablehttp.Client, u string) (string, error) {
	resp, err := get(ctx, client, u)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if err != nil {
		return "", errdefs.Unavailable("GET %s: %v", redactURL(u), scrub(err, u))
	}
	return parseSHA256(body, redactURL(u))
}

func parseSHA256(body []byte, from string) (string, error) {
	fields := strings.Fields(string(body))
	if len(fields) == 0 {
		return "", errdefs.InvalidArgument("%s is empty", from)
	}
	sum := strings.ToLower(fields[0])
	if b, err := hex.DecodeString(sum); err != nil || len(b) != sha256.Size {
		return "", errdefs.InvalidArgument("%s does not hold a sha256 (%.20q)", from, fields[0])
	}
	return sum, nil
}

// fetchVerified streams u into name while hashing it; the file is removed
// unless its sha256 equals want.
func (b *Builder) fetchVerified(ctx context.Context, client *retryablehttp.Client, u, name, want string) (int64, error) {
	resp, err := get(ctx, client, u)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	f, err := os.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return 0, err
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), resp.Body)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(name)
		return 0, errdefs.Unavailable("GET %s: after %d bytes: %v", redactURL(u), n, scrub(err, u))
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != want {
		os.Remove(name)
		return 0, errdefs.FailedPrecondition("GET %s: sha256 %s, the mirror's .sha256 says %s", redactURL(u), got, want)
	}
	return n, nil
}

// redactURL drops the user info and query of a URL, which may hold
// credentials.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparsable URL>"
	}
	u.User = nil
	u.RawQuery = ""
	u.Fragment = ""
	return u.String()
}

// scrub returns err's message with the raw URL (and its redacted forms)
// replaced, so that no credential leaks through a library's message.
func scrub(err error, raw string) error {
	msg := err.Error()
	var ue *url.Error
	if errors.As(err, &ue) {
		msg = ue.Err.Error()
	}
	msg = strings.ReplaceAll(msg, raw, redactURL(raw))
	if u, perr := url.Parse(raw); perr == nil {
		msg = strings.ReplaceAll(msg, u.Redacted(), redactURL(raw))
		if p, ok := u.User.Password(); ok && p != "" {
			msg = strings.ReplaceAll(msg, p, "xxxxx")
		}
	}
	return errors.New(msg)
}
