package limits

import (
	"context"
	"net"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/controller/authz"
)

// Defaults of the gRPC API's limits.
var (
	// DefaultPeople is the rate of each reader, operator and admin
	// certificate: far above what kilnctl does (an apply of any size is
	// one call), low enough that one script cannot starve the others.
	DefaultPeople = Rate{PerSecond: 50, Burst: 200}
	// DefaultAgent is the rate of each agent certificate: agents
	// heartbeat every few seconds and renew rarely.
	DefaultAgent = Rate{PerSecond: 5, Burst: 20}
	// DefaultAnonymous is the rate of each address calling without a
	// certificate (enrollment).
	DefaultAnonymous = Rate{PerSecond: 5, Burst: 20}
)

// DefaultStreamsPerCaller is how many streams (watches) one caller may
// hold open at once.
const DefaultStreamsPerCaller = 32

// DefaultMaxMessageBytes is the largest request the API reads (gRPC's
// default, made explicit): an apply larger than this is refused with
// ResourceExhausted before it is decoded.
const DefaultMaxMessageBytes = 4 << 20

// DefaultMaxStreamsPerConnection bounds concurrent calls on one
// connection (grpc.MaxConcurrentStreams).
const DefaultMaxStreamsPerConnection = 100

// GRPCConfig are the API's per-caller limits. Zero fields take the
// defaults; a negative PerSecond lifts a rate limit, a negative
// StreamsPerCaller the stream bound.
type GRPCConfig struct {
	People, Agent, Anonymous Rate
	StreamsPerCaller         int
}

func (c *GRPCConfig) defaults() {
	for _, r := range []struct {
		r   *Rate
		def Rate
	}{{&c.People, DefaultPeople}, {&c.Agent, DefaultAgent}, {&c.Anonymous, DefaultAnonymous}} {
		if *r.r == (Rate{}) {
			*r.r = r.def
		}
	}
	if c.StreamsPerCaller == 0 {
		c.StreamsPerCaller = DefaultStreamsPerCaller
	}
}

// GRPC holds the API's limit interceptors. Put them first in the chain:
// a refused call costs no certificate check beyond naming the caller, no
// audit record and no store access.
type GRPC struct {
	people, agent, anon *Limiter
	streams             *Counter
	identify            func(context.Context) authz.Caller
}

// NewGRPC returns the interceptors of cfg; identify names callers
// (authz.Authorizer.Identify).
func NewGRPC(cfg GRPCConfig, identify func(context.Context) authz.Caller, clock func() time.Time) *GRPC {
	cfg.defaults()
	return &GRPC{
		people:   NewLimiter(cfg.People, clock),
		agent:    NewLimiter(cfg.Agent, clock),
		anon:     NewLimiter(cfg.Anonymous, clock),
		streams:  NewCounter(cfg.StreamsPerCaller),
		identify: identify,
	}
}

// caller returns the key, a description for errors and the limiter of the
// call's caller.
func (g *GRPC) caller(ctx context.Context) (key, who string, l *Limiter) {
	c := g.identify(ctx)
	switch c.Role {
	case authz.RoleAnonymous:
		addr := "unknown"
		if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
			addr = p.Addr.String()
			if h, _, err := net.SplitHostPort(addr); err == nil {
				addr = h
			}
		}
		return "addr:" + addr, "unauthenticated caller at " + addr, g.anon
	case authz.RoleAgent:
		return c.Role + ":" + c.Name, "agent " + c.Name, g.agent
	}
	return c.Role + ":" + c.Name, c.Role + " " + c.Name, g.people
}

// refuse is the ResourceExhausted error of a caller over its rate, with
// the wait in the message and in a "retry-after" trailer (seconds).
func refuse(who string, l *Limiter, wait time.Duration, setTrailer func(metadata.MD)) error {
	setTrailer(metadata.Pairs("retry-after", strconv.Itoa(int(wait/time.Second))))
	return status.Errorf(codes.ResourceExhausted, "rate limit: %s is over %s; retry after %v", who, l.Rate(), wait)
}

// Unary is the unary server interceptor.
func (g *GRPC) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	key, who, l := g.caller(ctx)
	if ok, wait := l.Allow(key); !ok {
		return nil, refuse(who, l, wait, func(md metadata.MD) { _ = grpc.SetTrailer(ctx, md) })
	}
	return handler(ctx, req)
}

// Stream is the stream server interceptor: a stream is one request
// against the rate, and holds one of the caller's streams while open.
func (g *GRPC) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	key, who, l := g.caller(ss.Context())
	if ok, wait := l.Allow(key); !ok {
		return refuse(who, l, wait, ss.SetTrailer)
	}
	release, ok := g.streams.Acquire(key)
	if !ok {
		return status.Errorf(codes.ResourceExhausted, "stream limit: %s holds %d open streams (watches), the most one caller may; close one and retry", who, g.streams.Max())
	}
	defer release()
	return handler(srv, ss)
}
