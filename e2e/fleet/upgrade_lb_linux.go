package fleet

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/kilnhq/kiln/controller/clusterplan"
)

// APIBalancer is the lab's stand-in for the load balancer (or virtual IP)
// in front of a cluster's API servers: the stable controlPlaneEndpoint
// kubeadm requires before a second control-plane member may join, so that
// a control-plane rollout (1→2→1) can replace the only member. It listens
// on the lab bridge's address and forwards each TCP connection to the
// first control-plane machine's API server that accepts it (TLS passes
// through; kubeadm puts the endpoint in the API server certificate). The
// backends are re-read from the controller every few seconds. It lives as
// long as the process that started it.
type APIBalancer struct {
	ln     net.Listener
	mu     sync.Mutex
	back   []string
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// StartAPIBalancer listens on addr (the lab's Gateway():6443) and follows
// the control-plane machines of cluster.
func (l *Lab) StartAPIBalancer(ctx context.Context, addr, cluster string) (*APIBalancer, error) {
	if _, err := l.Client(ctx); err != nil { // dial once, before two goroutines use it
		return nil, fmt.Errorf("api balancer: %w", err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("api balancer: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	b := &APIBalancer{ln: ln, cancel: cancel}
	b.wg.Add(2)
	go func() {
		defer b.wg.Done()
		for {
			if s, err := l.Snapshot(ctx, cluster); err == nil {
				var back []string
				for _, m := range s.Machines {
					if m.GetSpec().GetRole() != clusterplan.RoleControlPlane || m.GetMetadata().GetDeletionTimestamp() != nil {
						continue
					}
					h := s.Hosts[m.GetSpec().GetHost()]
					if host, _, err := net.SplitHostPort(h.GetStatus().GetAgent().GetAddress()); err == nil {
						back = append(back, net.JoinHostPort(host, "6443"))
					}
				}
				b.mu.Lock()
				b.back = back
				b.mu.Unlock()
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(3 * time.Second):
			}
		}
	}()
	go func() {
		defer b.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go b.forward(ctx, c)
		}
	}()
	return b, nil
}

// Addr is the address the balancer listens on.
func (b *APIBalancer) Addr() string { return b.ln.Addr().String() }

func (b *APIBalancer) forward(ctx context.Context, c net.Conn) {
	defer c.Close()
	b.mu.Lock()
	back := append([]string(nil), b.back...)
	b.mu.Unlock()
	var up net.Conn
	for _, a := range back {
		d := net.Dialer{Timeout: 2 * time.Second}
		if conn, err := d.DialContext(ctx, "tcp", a); err == nil {
			up = conn
			break
		}
	}
	if up == nil {
		return
	}
	defer up.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

// Close stops listening and following the controller; open connections end
// with the context given to StartAPIBalancer or when either side closes.
func (b *APIBalancer) Close() error {
	b.cancel()
	err := b.ln.Close()
	b.wg.Wait()
	return err
}
