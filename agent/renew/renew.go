// Package renew rotates the agent's certificate before it expires: with a
// fresh key, a CSR sent to Agents.Renew over the current mTLS identity, and
// the new pair stored and put into use (identity.Rotate). Certificates are
// renewed when a third of their validity is left.
package renew

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/agent/identity"
	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Client is the part of controllerv1.AgentsClient renewal calls.
type Client interface {
	Renew(ctx context.Context, in *controllerv1.RenewRequest, opts ...grpc.CallOption) (*controllerv1.RenewResponse, error)
}

var _ Client = controllerv1.AgentsClient(nil)

// Renew asks the controller for a new certificate for a new key and
// rotates id (stored under dir) to it. It blocks for one call; errors are
// the controller's (mapped back to errdefs classes) or identity.Rotate's.
func Renew(ctx context.Context, c Client, id *identity.Identity, dir string) error {
	keyPEM, csr, err := pki.NewKeyAndCSR(id.Host())
	if err != nil {
		return fmt.Errorf("renew: %w", err)
	}
	resp, err := c.Renew(ctx, &controllerv1.RenewRequest{CsrDer: csr})
	if err != nil {
		return fmt.Errorf("renew: %w", errgrpc.FromGRPC(err))
	}
	// During a CA rotation the new certificate is from a CA the agent may
	// not trust yet: take the controller's CAs first (they still hold the
	// current certificate's issuer).
	if b := resp.GetCaBundlePem(); len(b) > 0 {
		if _, err := id.SetTrust(dir, b); err != nil {
			return fmt.Errorf("renew: %w", err)
		}
	}
	if err := id.Rotate(dir, keyPEM, resp.GetCertificatePem()); err != nil {
		return fmt.Errorf("renew: %w", err)
	}
	return nil
}

// Loop renews the certificate when it is due.
type Loop struct {
	Client   Client
	Identity *identity.Identity
	// Dir is the data directory the identity is stored in.
	Dir string
	// Interval is how often the certificate is checked (1h when 0).
	Interval time.Duration
	// Backoff is the retry policy after a failed renewal (10s doubling to
	// 10m when zero).
	Backoff backoff.Policy
	// Observe, when set, is called after every renewal attempt.
	Observe func(error)
	Log     *slog.Logger

	wakeOnce sync.Once
	wake     chan struct{}
	asked    atomic.Bool
}

func (l *Loop) wakeCh() chan struct{} {
	l.wakeOnce.Do(func() { l.wake = make(chan struct{}, 1) })
	return l.wake
}

// RenewNow asks Run to renew at once, whether or not the certificate is
// due: the controller asks for it while it retires the certificate's CA
// (HeartbeatResponse.renew_certificate). It does not block.
func (l *Loop) RenewNow() {
	l.asked.Store(true)
	select {
	case l.wakeCh() <- struct{}{}:
	default:
	}
}

// Run checks every Interval whether the certificate is due
// (identity.RenewDue) and renews it, retrying with Backoff on failure. It
// blocks until ctx is done and returns nil.
func (l *Loop) Run(ctx context.Context) error {
	log := l.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "renew")
	interval := l.Interval
	if interval <= 0 {
		interval = time.Hour
	}
	policy := l.Backoff
	if policy.Base <= 0 {
		policy = backoff.Policy{Base: 10 * time.Second, Max: 10 * time.Minute, Factor: 2, Jitter: 0.2}
	}
	rnd := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	failures := 0
	for {
		wait := interval
		if l.Identity.RenewDue(time.Now()) || l.asked.Load() {
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			err := Renew(cctx, l.Client, l.Identity, l.Dir)
			cancel()
			if ctx.Err() != nil {
				return nil
			}
			if l.Observe != nil {
				l.Observe(err)
			}
			if err != nil {
				wait = policy.Delay(failures, rnd)
				failures++
				log.Warn("certificate renewal failed", "error", err, "not_after", l.Identity.Certificate().Leaf.NotAfter, "retry_in", wait)
			} else {
				failures = 0
				l.asked.Store(false)
				leaf := l.Identity.Certificate().Leaf
				log.Info("certificate renewed", "serial", leaf.SerialNumber.Text(16), "not_after", leaf.NotAfter)
			}
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		case <-l.wakeCh():
			t.Stop()
		}
	}
}
