package rack

import (
	"context"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"
)

// APIServerPort is the port of the lab's Kubernetes API load balancer on
// the lab gateway, and of the API servers behind it.
const APIServerPort = 6443

// LoadBalancer is the lab's stand-in for the load balancer (or VIP) a
// real rack puts in front of its control plane: a TCP proxy on the lab
// gateway that forwards each connection to one of the backends answering
// on the port (checked every second), so that a cluster's
// controlPlaneEndpoint stays valid while its control-plane machines are
// replaced. Equivalent to an haproxy `mode tcp` frontend with
// `option tcp-check` on every rack host.
type LoadBalancer struct {
	ln       net.Listener
	backends []string
	log      *slog.Logger

	mu      sync.Mutex
	healthy []string
	next    int

	wg     sync.WaitGroup
	cancel context.CancelFunc
}

// ListenLoadBalancer listens on addr and balances over backends
// (host:port); Close stops it.
func ListenLoadBalancer(addr string, backends []string, log *slog.Logger) (*LoadBalancer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	lb := &LoadBalancer{ln: ln, backends: backends, log: log, cancel: cancel}
	lb.check(ctx)
	lb.wg.Add(2)
	go func() { defer lb.wg.Done(); lb.checkLoop(ctx) }()
	go func() { defer lb.wg.Done(); lb.serve(ctx) }()
	return lb, nil
}

// Addr is the address the balancer listens on.
func (lb *LoadBalancer) Addr() string { return lb.ln.Addr().String() }

// Healthy returns the backends that answered the last check.
func (lb *LoadBalancer) Healthy() []string {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	return append([]string(nil), lb.healthy...)
}

// Close stops listening and ends every proxied connection.
func (lb *LoadBalancer) Close() error {
	lb.cancel()
	err := lb.ln.Close()
	lb.wg.Wait()
	return err
}

func (lb *LoadBalancer) checkLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			lb.check(ctx)
		}
	}
}

// check connects to every backend in parallel and keeps those that accept.
func (lb *LoadBalancer) check(ctx context.Context) {
	ok := make([]bool, len(lb.backends))
	var wg sync.WaitGroup
	for i, b := range lb.backends {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := net.Dialer{Timeout: 500 * time.Millisecond}
			if c, err := d.DialContext(ctx, "tcp", b); err == nil {
				c.Close()
				ok[i] = true
			}
		}()
	}
	wg.Wait()
	var healthy []string
	for i, b := range lb.backends {
		if ok[i] {
			healthy = append(healthy, b)
		}
	}
	lb.mu.Lock()
	changed := len(healthy) != len(lb.healthy)
	for i := 0; !changed && i < len(healthy); i++ {
		changed = healthy[i] != lb.healthy[i]
	}
	lb.healthy = healthy
	lb.mu.Unlock()
	if changed {
		lb.log.Info("API load balancer backends", "healthy", healthy)
	}
}

// pick returns the next healthy backend, round robin, or "".
func (lb *LoadBalancer) pick() string {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	if len(lb.healthy) == 0 {
		return ""
	}
	lb.next++
	return lb.healthy[lb.next%len(lb.healthy)]
}

func (lb *LoadBalancer) serve(ctx context.Context) {
	for {
		c, err := lb.ln.Accept()
		if err != nil {
			return
		}
		lb.wg.Add(1)
		go func() {
			defer lb.wg.Done()
			lb.proxy(ctx, c)
		}()
	}
}

func (lb *LoadBalancer) proxy(ctx context.Context, c net.Conn) {
	defer c.Close()
	b := lb.pick()
	if b == "" {
		return // no API server answers: the client sees the connection close
	}
	d := net.Dialer{Timeout: 2 * time.Second}
	up, err := d.DialContext(ctx, "tcp", b)
	if err != nil {
		return
	}
	defer up.Close()
	stop := context.AfterFunc(ctx, func() { c.Close(); up.Close() })
	defer stop()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); closeWrite(up); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); closeWrite(c); done <- struct{}{} }()
	<-done
	<-done
}

func closeWrite(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	}
}
