package rack

import (
	"bufio"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"testing"
	"time"
)

// echo serves lines back prefixed with its name.
func echo(t *testing.T, name, addr string) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					fmt.Fprintf(c, "%s:%s\n", name, sc.Text())
				}
			}()
		}
	}()
	return ln
}

func ask(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintln(c, "ping")
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return ""
	}
	return line
}

// TestLoadBalancerFollowsTheHealthyBackend: connections go to the backend
// that answers; when it goes away and another comes up, to that one (a
// control plane replaced behind its endpoint).
func TestLoadBalancerFollowsTheHealthyBackend(t *testing.T) {
	a := echo(t, "a", "127.0.0.1:0")
	// b's address, not listening yet.
	tmp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	bAddr := tmp.Addr().String()
	tmp.Close()
	lb, err := ListenLoadBalancer("127.0.0.1:0", []string{a.Addr().String(), bAddr}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer lb.Close()
	for range 4 {
		if got := ask(t, lb.Addr()); got != "a:ping\n" {
			t.Fatalf("through the balancer with only a up: %q, want a:ping", got)
		}
	}
	b := echo(t, "b", bAddr)
	defer b.Close()
	a.Close()
	deadline := time.Now().Add(10 * time.Second)
	for !slices.Equal(lb.Healthy(), []string{bAddr}) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if h := lb.Healthy(); !slices.Equal(h, []string{bAddr}) {
		t.Fatalf("Healthy() = %v, want [%s] after a went away and b came up", h, bAddr)
	}
	if got := ask(t, lb.Addr()); got != "b:ping\n" {
		t.Errorf("through the balancer after the switch: %q, want b:ping", got)
	}
}
