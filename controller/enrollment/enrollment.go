// Package enrollment turns one-time tokens into agent identities. An
// operator creates a token (CreateToken); an agent presents it with a CSR
// for its own key (Enroll) and receives a certificate naming its host; the
// enrolled agent then keeps its Host alive with heartbeats (Heartbeat) and
// renews its certificate before expiry (Renew).
//
// Only the sha256 of a token's secret is stored. A token is used exactly
// once: it is marked used with a compare-and-swap on its etcd revision, so
// of two concurrent enrollments with one token only one wins.
package enrollment

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/events"
	"github.com/kilnhq/kiln/controller/liveness"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TokensKind is the store kind of enrollment tokens.
const TokensKind = "tokens"

// HostsKind is the store kind of hosts.
const HostsKind = "hosts"

// ConditionAgentReachable is the Host condition that says whether the
// agent's heartbeats arrive.
const ConditionAgentReachable = liveness.ConditionAgentReachable

// Defaults.
const (
	DefaultTokenTTL          = time.Hour
	DefaultCertTTL           = 30 * 24 * time.Hour
	DefaultHeartbeatInterval = 10 * time.Second
)

// Store is what enrollment needs of the store.
type Store interface {
	Create(ctx context.Context, kind, name string, m proto.Message) (int64, error)
	Get(ctx context.Context, kind, name string, into proto.Message) (int64, error)
	Update(ctx context.Context, kind, name string, m proto.Message, expectRev int64) (int64, error)
	// UpdateWith is Update with ops (a heartbeat's events) in the same
	// etcd transaction.
	UpdateWith(ctx context.Context, kind, name string, m proto.Message, expectRev int64, ops []clientv3.Op) (int64, []*etcdserverpb.ResponseOp, error)
	CreateAudited(ctx context.Context, kind, name string, m proto.Message, rec store.AuditRecord, secrets ...store.SecretOp) (int64, error)
}

// unpausedGetter is the store's Get that fails while the controller is
// paused for a move (*store.Store).
type unpausedGetter interface {
	GetUnpaused(ctx context.Context, kind, name string, into proto.Message) (int64, error)
}

var _ unpausedGetter = (*store.Store)(nil)

// Signer signs agent CSRs (*pki.CA).
type Signer interface {
	SignCSR(csrDER []byte, role pki.Role, name string, ttl time.Duration, now time.Time, opts ...pki.SignOption) ([]byte, error)
	CertPEM() []byte
	Hash() string
}

var _ Signer = (*pki.CA)(nil)

// Rotation is implemented by a Signer whose CA is being rotated
// (kiln-controller rotate-ca): it says which agents must renew now.
type Rotation interface {
	// WantsRenewal reports whether a certificate issued by the CA of key
	// id issuer (pki.IssuerKeyID; "" when not recorded) is to be renewed
	// now: its CA is being retired.
	WantsRenewal(issuer string) bool
}

// Recorder records events (*events.Recorder): alone (Record), or
// prepared to be stored in the transaction of a Host write (Prepare).
type Recorder interface {
	Record(ctx context.Context, kind, name, typ, reason, message string)
	Prepare(ctx context.Context, kind, name string, evs []events.Event) (*events.Batch, error)
}

var _ Recorder = (*events.Recorder)(nil)

// Config tunes a Service.
type Config struct {
	// CertTTL is the validity of agent certificates (DefaultCertTTL).
	CertTTL time.Duration
	// HeartbeatInterval is what agents are told (DefaultHeartbeatInterval).
	HeartbeatInterval time.Duration
	// Clock is the time source (time.Now).
	Clock func() time.Time
	// Observer, when set, is told the outcome of every enrollment attempt
	// (metrics).
	Observer Observer
	// Replica is this controller replica's ID, recorded on the Hosts whose
	// heartbeats it receives (status.agent.controller).
	Replica string
	// Tracker is where heartbeats record when each agent was last seen
	// (a new one when nil); the replica's liveness.Monitor reads it.
	Tracker *liveness.Tracker
	// Refresh is how old a stored heartbeat may grow before a heartbeat
	// rewrites it (liveness.DefaultRefresh; negative: never).
	Refresh time.Duration
	// MaxInFlight bounds the heartbeats that read or write etcd at once
	// (DefaultMaxInFlight); the others wait their turn in the controller.
	// A fleet powered on at once (every first check-in writes its Host)
	// then queues here, cheaply, instead of as 100,000 concurrent etcd
	// requests, each with its buffers and goroutines on both ends.
	MaxInFlight int
}

// DefaultMaxInFlight is Config.MaxInFlight's default: enough concurrent
// requests for etcd to batch its commits.
const DefaultMaxInFlight = 256

// Observer is told of enrollment attempts (*metrics.Metrics).
type Observer interface {
	// ObserveEnrollment records one Enroll call and its error (nil on
	// success). It must not block.
	ObserveEnrollment(err error)
}

// Service implements token creation, enrollment and heartbeats.
type Service struct {
	store   Store
	ca      Signer
	events  Recorder
	cfg     Config
	tracker *liveness.Tracker
	log     *slog.Logger
	// inFlight holds a token per heartbeat at etcd (Config.MaxInFlight).
	inFlight chan struct{}
	// hostCache, when set, answers idle heartbeats (UseHostCache).
	hostCache *hostCache
}

// New returns a Service.
func New(st Store, ca Signer, rec Recorder, cfg Config, log *slog.Logger) *Service {
	if cfg.CertTTL <= 0 {
		cfg.CertTTL = DefaultCertTTL
	}
	if cfg.HeartbeatInterval <= 0 {
		cfg.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Tracker == nil {
		cfg.Tracker = liveness.NewTracker()
	}
	switch {
	case cfg.Refresh == 0:
		cfg.Refresh = liveness.DefaultRefresh
	case cfg.Refresh < 0:
		cfg.Refresh = 0
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = DefaultMaxInFlight
	}
	return &Service{store: st, ca: ca, events: rec, cfg: cfg, tracker: cfg.Tracker, inFlight: make(chan struct{}, cfg.MaxInFlight), log: log.With("component", "enrollment")}
}

// CreateToken makes a one-time token valid for ttl (DefaultTokenTTL when
// 0), bound to host when host is not empty. The returned token is shown
// once; only its hash is stored.
func (s *Service) CreateToken(ctx context.Context, ttl time.Duration, host, description string) (Token, time.Time, error) {
	if ttl < 0 {
		return Token{}, time.Time{}, errdefs.InvalidArgument("token ttl %v is negative", ttl)
	}
	if ttl == 0 {
		ttl = DefaultTokenTTL
	}
	if host != "" {
		if err := checkHostName(host); err != nil {
			return Token{}, time.Time{}, err
		}
	}
	now := s.cfg.Clock()
	expires := now.Add(ttl)
	for range 3 {
		t, err := NewToken()
		if err != nil {
			return Token{}, time.Time{}, fmt.Errorf("create token: %w", err)
		}
		rec := &typesv1.EnrollmentToken{
			Id:           t.ID,
			SecretSha256: t.SecretHash(),
			Host:         host,
			Expires:      timestamppb.New(expires),
			Created:      timestamppb.New(now),
			Description:  description,
		}
		// An API call's audit entry is stored with the token (the
		// token's ID only, never its secret).
		var entry *controllerv1.AuditEntry
		call := audit.CallFrom(ctx)
		if call != nil {
			entry = call.Entry("Token", t.ID)
			entry.Result = audit.OK
			if host != "" {
				entry.Message = "bound to host " + host
			}
		}
		_, err = s.store.CreateAudited(ctx, TokensKind, t.ID, rec, audit.Record(entry))
		if err == nil && call != nil {
			call.Committed(entry)
		}
		if errdefs.IsAlreadyExists(err) {
			continue // an id collision: draw again
		}
		if err != nil {
			return Token{}, time.Time{}, fmt.Errorf("create token: %w", err)
		}
		s.log.Info("enrollment token created", "token_id", t.ID, "host", host, "expires", expires)
		return t, expires, nil
	}
	return Token{}, time.Time{}, errdefs.Unavailable("create token: could not draw an unused token id")
}

// EnrollRequest is what an agent sends.
type EnrollRequest struct {
	Token  string
	CSRDER []byte
	// Host is the host name asked for; empty means the token's host or
	// the facts' hostname.
	Host  string
	Facts *typesv1.Facts
}

// EnrollResult is the agent's new identity.
type EnrollResult struct {
	Host    string
	CertPEM []byte
	CAPEM   []byte
}

// Enroll checks the token, signs the CSR with role agent for the host,
// consumes the token and registers the host. It returns PermissionDenied
// for an unknown, wrong, expired, used or differently-bound token (the
// message never contains the secret), InvalidArgument for a malformed
// token, CSR or host name.
func (s *Service) Enroll(ctx context.Context, req EnrollRequest) (*EnrollResult, error) {
	res, err := s.enroll(ctx, req)
	if s.cfg.Observer != nil {
		s.cfg.Observer.ObserveEnrollment(err)
	}
	return res, err
}

func (s *Service) enroll(ctx context.Context, req EnrollRequest) (*EnrollResult, error) {
	tok, err := ParseToken(req.Token)
	if err != nil {
		return nil, err
	}
	rec := &typesv1.EnrollmentToken{}
	rev, err := s.store.Get(ctx, TokensKind, tok.ID, rec)
	if errdefs.IsNotFound(err) {
		return nil, errdefs.PermissionDenied("enrollment token %s is not valid", tok.ID)
	}
	if err != nil {
		return nil, fmt.Errorf("enroll: %w", err)
	}
	if !tok.matches(rec.GetSecretSha256()) {
		return nil, errdefs.PermissionDenied("enrollment token %s is not valid", tok.ID)
	}
	now := s.cfg.Clock()
	keySum := csrKeySHA256(req.CSRDER)
	// The same key asking again for the same host is the agent that used
	// the token retrying after its answer was lost (the controller
	// restarted mid-call): the CSR proves it holds that key.
	retry := rec.GetUsed() && keySum != "" && rec.GetUsedByKeySha256() == keySum && rec.GetUsedByHost() != ""
	if rec.GetUsed() && !retry {
		return nil, errdefs.PermissionDenied("enrollment token %s was already used: create a new one", tok.ID)
	}
	if !now.Before(rec.GetExpires().AsTime()) {
		return nil, errdefs.PermissionDenied("enrollment token %s expired at %s: create a new one", tok.ID, rec.GetExpires().AsTime().UTC().Format(time.RFC3339))
	}
	host := req.Host
	if host == "" {
		host = rec.GetHost()
	}
	if host == "" {
		host = req.Facts.GetHostname()
	}
	if rec.GetHost() != "" && host != rec.GetHost() {
		return nil, errdefs.PermissionDenied("enrollment token %s is bound to host %q, not %q", tok.ID, rec.GetHost(), host)
	}
	if host == "" {
		return nil, errdefs.InvalidArgument("enroll: no host name: the token is not bound to a host and neither host nor facts.hostname is set")
	}
	if err := checkHostName(host); err != nil {
		return nil, err
	}
	if retry && host != rec.GetUsedByHost() {
		return nil, errdefs.PermissionDenied("enrollment token %s was already used: create a new one", tok.ID)
	}
	// A token bound to no host enrolls new hosts (or ones never enrolled),
	// never one that has an agent: that would hand a stranger the
	// identity of a working node (issue 12, hole 6).
	if rec.GetHost() == "" && !retry {
		h := &typesv1.Host{}
		if _, err := s.store.Get(ctx, HostsKind, host, h); err == nil && h.GetStatus().GetAgent().GetCertificateSerial() != "" {
			return nil, errdefs.PermissionDenied("enrollment token %s is not bound to a host, and host %q already has an enrolled agent: to enroll it again, create a token for it (kilnctl token create --host %s)", tok.ID, host, host)
		} else if err != nil && !errdefs.IsNotFound(err) {
			return nil, fmt.Errorf("enroll: %w", err)
		}
	}

	// Sign before consuming the token, so a bad CSR does not burn it.
	// No subject alternative names: the controller identifies an agent by
	// its role and CommonName (agent/client.VerifyAgent), never by the
	// address it dials. Any name here would come from what the agent says
	// about itself, and serve only clients that check an address and
	// nothing else: an agent reporting 127.0.0.1 got a certificate valid
	// for the controller's own loopback address (issue 12).
	certPEM, err := s.ca.SignCSR(req.CSRDER, pki.RoleAgent, host, s.cfg.CertTTL, now)
	if err != nil {
		return nil, fmt.Errorf("enroll host %q: %w", host, err)
	}
	if !retry {
		rec.Used, rec.UsedByKeySha256, rec.UsedByHost = true, keySum, host
		if _, err := s.store.Update(ctx, TokensKind, tok.ID, rec, rev); err != nil {
			if errdefs.IsConflict(err) || errdefs.IsNotFound(err) {
				return nil, errdefs.PermissionDenied("enrollment token %s was already used: create a new one", tok.ID)
			}
			return nil, fmt.Errorf("enroll host %q: consume token: %w", host, err)
		}
	}
	cert, err := parseCert(certPEM)
	if err != nil {
		return nil, err
	}
	if err := s.register(ctx, host, req.Facts, cert, now); err != nil {
		return nil, fmt.Errorf("enroll host %q: %w", host, err)
	}
	s.log.Info("agent enrolled", "host", host, "token_id", tok.ID, "serial", cert.SerialNumber.Text(16))
	s.events.Record(ctx, HostsKind, host, events.Normal, "Enrolled", fmt.Sprintf("agent enrolled with token %s, certificate serial %s", tok.ID, cert.SerialNumber.Text(16)))
	return &EnrollResult{Host: host, CertPEM: certPEM, CAPEM: s.ca.CertPEM()}, nil
}

// register creates the Host (state Registering) or records the new
// agent identity and facts on an existing one.
func (s *Service) register(ctx context.Context, host string, facts *typesv1.Facts, cert *x509.Certificate, now time.Time) error {
	return s.updateHost(ctx, host, true, func(h *typesv1.Host) ([]events.Event, error) {
		if h.Status == nil {
			h.Status = &typesv1.HostStatus{}
		}
		if h.Status.State == typesv1.HostState_HOST_STATE_UNSPECIFIED {
			h.Status.State = typesv1.HostState_HOST_STATE_REGISTERING
		}
		if facts != nil {
			h.Status.Facts = facts
		}
		if h.Status.Agent == nil {
			h.Status.Agent = &typesv1.AgentStatus{}
		}
		// A new enrollment revokes every earlier certificate of the host.
		h.Status.Agent.CertificateSerial = cert.SerialNumber.Text(16)
		h.Status.Agent.PreviousCertificateSerial = ""
		h.Status.Agent.CertificateNotAfter = timestamppb.New(cert.NotAfter)
		h.Status.Agent.CertificateIssuer = pki.IssuerKeyID(cert)
		if facts != nil {
			h.Status.Agent.Mode = facts.GetAgentMode()
			h.Status.Agent.BootSource = facts.GetBootSource()
		}
		return nil, nil
	}, now)
}

// errUnchanged, from an updateHost fn, ends the update without a write.
var errUnchanged = errors.New("unchanged")

// maxRetries bounds compare-and-swap retries of status updates.
const maxRetries = 10

// updateHost applies fn to the stored Host and writes it back with a
// compare-and-swap, retrying on conflict, with the events fn returns in
// the same etcd transaction (one write; see writeHost). With create, a
// missing Host is created, and fn's events are recorded after it. An
// error from fn stops it, writing nothing.
func (s *Service) updateHost(ctx context.Context, host string, create bool, fn func(*typesv1.Host) ([]events.Event, error), now time.Time) error {
	// An update of an existing Host (a heartbeat) reads it with the
	// pause's check when the store has one: a heartbeat that writes
	// nothing is refused, like a write, while the controller is paused for
	// a move, and tells the agent where the fleet went.
	get := s.store.Get
	if g, ok := s.store.(unpausedGetter); ok && !create {
		get = g.GetUnpaused
	}
	for range maxRetries {
		h := &typesv1.Host{}
		rev, err := get(ctx, HostsKind, host, h)
		if errdefs.IsNotFound(err) && create {
			h = &typesv1.Host{
				ApiVersion: "kiln.dev/v1",
				Kind:       "Host",
				Metadata: &typesv1.ObjectMeta{
					Name:              host,
					Generation:        1,
					Uid:               newUID(),
					CreationTimestamp: timestamppb.New(now),
				},
				Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "none"}},
			}
			evs, err := fn(h)
			if err != nil {
				return err
			}
			_, err = s.store.Create(ctx, HostsKind, host, h)
			if errdefs.IsAlreadyExists(err) {
				continue
			}
			if err == nil {
				for _, ev := range evs {
					s.events.Record(ctx, HostsKind, host, ev.Type, ev.Reason, ev.Message)
				}
			}
			return err
		}
		if err != nil {
			return err
		}
		evs, err := fn(h)
		if err != nil {
			if errors.Is(err, errUnchanged) {
				return nil
			}
			return err
		}
		err = s.writeHost(ctx, host, h, rev, evs)
		if errdefs.IsConflict(err) {
			continue
		}
		return err
	}
	return errdefs.Unavailable("host %q: too many concurrent updates", host)
}

// writeHost stores h (read at rev) and evs, its events, in one etcd
// transaction, as the host lifecycle stores a step's events with its
// status: a heartbeat that makes an agent reachable costs one write, not
// two. Events that cannot be prepared (no event lease) are logged and the
// Host is written without them. It returns the store's Conflict and
// NotFound.
func (s *Service) writeHost(ctx context.Context, host string, h *typesv1.Host, rev int64, evs []events.Event) error {
	var batch *events.Batch
	if len(evs) > 0 {
		b, err := s.events.Prepare(ctx, HostsKind, host, evs)
		if err != nil {
			s.log.Warn("events not recorded", "host", host, "err", err)
		} else {
			batch = b
		}
	}
	var ops []clientv3.Op
	if batch != nil {
		ops = batch.Ops()
	}
	newRev, answers, err := s.store.UpdateWith(ctx, HostsKind, host, h, rev, ops)
	if batch != nil {
		batch.Done(ctx, newRev, answers)
	}
	return err
}

// HeartbeatResult is the controller's answer to a heartbeat.
type HeartbeatResult struct {
	// Interval is when to send the next one.
	Interval time.Duration
	// RenewCertificate asks the agent to renew now: its certificate's CA
	// is being retired (Rotation).
	RenewCertificate bool
	// FactsWanted asks the agent to send its facts in full now: it sent
	// the hash of facts the controller does not hold. Nothing was written.
	FactsWanted bool
	// MovedTo is set when this controller's fleet moved (kilnctl move):
	// the API address of the controller the agent is to heartbeat from now
	// on. Nothing was written.
	MovedTo string
}

// HeartbeatRequest is what an enrolled agent reports.
type HeartbeatRequest struct {
	AgentAddress string
	// Facts are sent in full on an agent's first heartbeat and when asked
	// (HeartbeatResult.FactsWanted); nil otherwise.
	Facts   *typesv1.Facts
	Version string
	// FactsSHA256 is the hash of the agent's facts (factshash.Sum); ""
	// from agents that predate it, which send facts every minute instead.
	FactsSHA256 string
}

// Heartbeat records that the agent of host is alive, at its address, with
// these facts, and returns the interval until the next heartbeat. It
// writes the Host only when the heartbeat changes it (liveness.Plan);
// otherwise the agent is only marked seen in this replica's tracker. host and
// serial (hex) must come from the caller's certificate: only the host's
// latest certificate, or the one it replaced until the latest is first
// used, is accepted (CheckSerial). It returns PermissionDenied for any
// other certificate and NotFound when the Host was deleted (the agent must
// enroll again).
func (s *Service) Heartbeat(ctx context.Context, host, serial string, req HeartbeatRequest) (HeartbeatResult, error) {
	return s.heartbeat(ctx, host, &serial, req)
}

// SimulatedHeartbeat is Heartbeat for the simulated agents of simulation
// mode (controller/sim), which run in the controller's process and hold
// no certificate.
func (s *Service) SimulatedHeartbeat(ctx context.Context, host string, req HeartbeatRequest) (HeartbeatResult, error) {
	return s.heartbeat(ctx, host, nil, req)
}

// heartbeat checks *serial unless serial is nil. It writes the Host only
// when the heartbeat changes something (liveness.Plan); otherwise it only
// reads it (to check the serial) and records the agent as seen in the
// replica's tracker.
func (s *Service) heartbeat(ctx context.Context, host string, serial *string, req HeartbeatRequest) (HeartbeatResult, error) {
	now := s.cfg.Clock()
	beat := liveness.Beat{
		Address:     req.AgentAddress,
		Version:     req.Version,
		Facts:       req.Facts,
		FactsSHA256: req.FactsSHA256,
		Replica:     s.cfg.Replica,
		Now:         now,
	}
	var renew, wantFacts bool
	done, err := s.heartbeatFromCache(ctx, host, serial, beat, &renew, &wantFacts)
	if !done {
		if err = s.acquire(ctx); err != nil {
			return HeartbeatResult{}, fmt.Errorf("heartbeat of host %q: %w", host, err)
		}
		err = s.updateHost(ctx, host, false, func(h *typesv1.Host) ([]events.Event, error) {
			d, err := s.decide(h, serial, beat)
			if err != nil {
				return nil, err
			}
			renew, wantFacts = d.renew, d.wantFacts
			if !d.write {
				return nil, errUnchanged
			}
			return applyBeat(h, d, beat), nil
		}, now)
		s.release()
	}
	if errdefs.IsNotFound(err) {
		return HeartbeatResult{}, errdefs.NotFound("host %q is not registered (deleted?): enroll the agent again", host)
	}
	if p, ok := store.PauseOf(err); ok && p.Moved && p.MovedTo != "" {
		return s.moved(ctx, host, serial, p.MovedTo)
	}
	if err != nil {
		return HeartbeatResult{}, fmt.Errorf("heartbeat of host %q: %w", host, err)
	}
	s.tracker.Seen(host, now)
	return HeartbeatResult{Interval: s.cfg.HeartbeatInterval, RenewCertificate: renew, FactsWanted: wantFacts}, nil
}

// heartbeatFromCache answers a heartbeat from the host cache when it can
// (UseHostCache); done is false when the caller must go to etcd: no
// cache, not confirmed current, paused, no such Host in it, a serial it
// refuses, or a write that lost its compare-and-swap. A heartbeat that
// writes nothing only marks the agent seen. One that writes (a first
// check-in, new facts) writes the cached Host with a compare-and-swap on
// the cached revision: as safe as a fresh read (a Host changed since,
// say by a re-enrollment that revoked the serial, fails the swap and the
// heartbeat is decided again on a linearizable read), and one etcd
// request instead of two. *renew and *wantFacts are set from the
// decision.
func (s *Service) heartbeatFromCache(ctx context.Context, host string, serial *string, beat liveness.Beat, renew, wantFacts *bool) (done bool, err error) {
	cached, rev, ok := s.cachedHost(host, beat.Now)
	if !ok {
		return false, nil
	}
	d, err := s.decide(cached, serial, beat)
	if err != nil {
		return false, nil
	}
	*renew, *wantFacts = d.renew, d.wantFacts
	if !d.write {
		return true, nil
	}
	h := proto.CloneOf(cached)
	if err := s.acquire(ctx); err != nil {
		return true, err
	}
	err = s.writeHost(ctx, host, h, rev, applyBeat(h, d, beat))
	s.release()
	if errdefs.IsConflict(err) || errdefs.IsNotFound(err) {
		return false, nil
	}
	return true, err
}

// applyBeat records heartbeat beat on h as decided by d (which must say
// write) and returns the events to store with it: AgentReachable when
// the agent became reachable.
func applyBeat(h *typesv1.Host, d beatDecision, beat liveness.Beat) []events.Event {
	if d.clearPrevious {
		h.Status.Agent.PreviousCertificateSerial = ""
	}
	if liveness.Apply(h, beat) {
		return []events.Event{{Type: events.Normal, Reason: "AgentReachable", Message: "agent heartbeats arrive from " + beat.Address}}
	}
	return nil
}

// acquire takes one of Config.MaxInFlight slots for a heartbeat that goes
// to etcd, waiting while all are taken. It returns Unavailable when ctx
// ends first. release gives it back.
func (s *Service) acquire(ctx context.Context) error {
	select {
	case s.inFlight <- struct{}{}:
		return nil
	case <-ctx.Done():
		return errdefs.Unavailable("waiting for a turn to write: %w", ctx.Err())
	}
}

func (s *Service) release() { <-s.inFlight }

// beatDecision is what a heartbeat does to its stored Host (decide).
type beatDecision struct {
	// write: the Host changes (liveness.Apply, and clearPrevious).
	write bool
	// clearPrevious: the latest certificate is in use, so the one it
	// replaced is revoked.
	clearPrevious bool
	// wantFacts: ask the agent for its facts; nothing is written.
	wantFacts bool
	// renew: ask the agent to renew (its CA is being retired).
	renew bool
}

// decide checks *serial (unless serial is nil) against the stored Host h
// and decides what heartbeat beat changes. It does not change h. It
// returns CheckSerial's PermissionDenied.
func (s *Service) decide(h *typesv1.Host, serial *string, beat liveness.Beat) (beatDecision, error) {
	if serial != nil {
		if err := CheckSerial(h, *serial); err != nil {
			return beatDecision{}, err
		}
	}
	change := liveness.Plan(h, beat, s.cfg.Refresh)
	d := beatDecision{wantFacts: change.WantFacts}
	a := h.GetStatus().GetAgent()
	if serial != nil && *serial == a.GetCertificateSerial() {
		d.clearPrevious = a.GetPreviousCertificateSerial() != ""
		if r, ok := s.ca.(Rotation); ok {
			d.renew = r.WantsRenewal(a.GetCertificateIssuer())
		}
	}
	d.write = !d.wantFacts && (change.Write || d.clearPrevious)
	return d, nil
}

// moved answers the heartbeat of an agent whose fleet moved to another
// controller (kilnctl move): with where it went, once the caller's
// certificate is one the Host accepts (the read is allowed while paused;
// nothing is written). The agent checks that the controller there holds
// a certificate of the CA it trusts before it follows.
func (s *Service) moved(ctx context.Context, host string, serial *string, to string) (HeartbeatResult, error) {
	h := &typesv1.Host{}
	if _, err := s.store.Get(ctx, HostsKind, host, h); err != nil {
		if errdefs.IsNotFound(err) {
			return HeartbeatResult{}, errdefs.NotFound("host %q is not registered (deleted?): enroll the agent again", host)
		}
		return HeartbeatResult{}, fmt.Errorf("heartbeat of host %q: %w", host, err)
	}
	if serial != nil {
		if err := CheckSerial(h, *serial); err != nil {
			return HeartbeatResult{}, err
		}
	}
	return HeartbeatResult{Interval: s.cfg.HeartbeatInterval, MovedTo: to}, nil
}

// Tracker is the replica's in-memory record of when each agent was last
// heard from (Config.Tracker, or one of its own).
func (s *Service) Tracker() *liveness.Tracker { return s.tracker }

// TrustPEM is the CA certificates agents are to trust (PEM): the CA
// during a rotation, the old and the new one during it.
func (s *Service) TrustPEM() []byte { return s.ca.CertPEM() }

// Renew signs a fresh agent certificate for host and records its serial.
// host and serial (hex) come from the caller's certificate, which must be
// one CheckSerial accepts (PermissionDenied otherwise); it stays accepted
// until the new one is first used.
func (s *Service) Renew(ctx context.Context, host, serial string, csrDER []byte) ([]byte, error) {
	now := s.cfg.Clock()
	h := &typesv1.Host{}
	if _, err := s.store.Get(ctx, HostsKind, host, h); err != nil {
		return nil, fmt.Errorf("renew host %q: %w", host, err)
	}
	if err := CheckSerial(h, serial); err != nil {
		return nil, err
	}
	// No subject alternative names, as at enrollment (see Enroll).
	certPEM, err := s.ca.SignCSR(csrDER, pki.RoleAgent, host, s.cfg.CertTTL, now)
	if err != nil {
		return nil, fmt.Errorf("renew host %q: %w", host, err)
	}
	cert, err := parseCert(certPEM)
	if err != nil {
		return nil, err
	}
	err = s.updateHost(ctx, host, false, func(h *typesv1.Host) ([]events.Event, error) {
		// Checked again in the compare-and-swap: a re-enrollment since
		// the read revoked the caller.
		if err := CheckSerial(h, serial); err != nil {
			return nil, err
		}
		RecordNewSerial(h, serial, cert)
		return []events.Event{{Type: events.Normal, Reason: "CertificateRenewed", Message: "certificate serial " + cert.SerialNumber.Text(16)}}, nil
	}, now)
	if err != nil {
		return nil, fmt.Errorf("renew host %q: %w", host, err)
	}
	return certPEM, nil
}

// CheckSerial returns nil when serial (hex) is host h's latest agent
// certificate or the one it replaced, and a PermissionDenied error saying
// what to do otherwise: a certificate superseded by a new enrollment, or
// one of a host that was deleted and applied again, is revoked.
func CheckSerial(h *typesv1.Host, serial string) error {
	a := h.GetStatus().GetAgent()
	if serial != "" && (serial == a.GetCertificateSerial() || serial == a.GetPreviousCertificateSerial()) {
		return nil
	}
	return errdefs.PermissionDenied("host %q: agent certificate serial %s is not the host's current one (the host was enrolled again, reprovisioned, or deleted and applied again): enroll the agent again", h.GetMetadata().GetName(), serial)
}

// RecordNewSerial makes cert host h's latest agent certificate. from, the
// serial of the certificate it replaces (the caller's, at renewal; the
// boot agent's, for the installed agent's identity), stays accepted until
// the new one is first used; every other earlier certificate is revoked.
func RecordNewSerial(h *typesv1.Host, from string, cert *x509.Certificate) {
	if h.Status == nil {
		h.Status = &typesv1.HostStatus{}
	}
	if h.Status.Agent == nil {
		h.Status.Agent = &typesv1.AgentStatus{}
	}
	h.Status.Agent.PreviousCertificateSerial = from
	h.Status.Agent.CertificateSerial = cert.SerialNumber.Text(16)
	h.Status.Agent.CertificateNotAfter = timestamppb.New(cert.NotAfter)
	h.Status.Agent.CertificateIssuer = pki.IssuerKeyID(cert)
}

func parseCert(certPEM []byte) (*x509.Certificate, error) {
	b, _ := pem.Decode(certPEM)
	if b == nil {
		return nil, fmt.Errorf("signed certificate is not PEM")
	}
	return x509.ParseCertificate(b.Bytes)
}

// checkHostName accepts DNS-1123 labels joined by dots, as Host names.
func checkHostName(name string) error {
	if len(name) > 253 {
		return errdefs.InvalidArgument("host name of %d characters is too long (max 253)", len(name))
	}
	for _, label := range strings.Split(name, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return errdefs.InvalidArgument("host name %q is not a lowercase DNS name such as rack1-01", name)
		}
		for _, r := range label {
			if (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '-' {
				return errdefs.InvalidArgument("host name %q is not a lowercase DNS name such as rack1-01", name)
			}
		}
	}
	return nil
}

// CAHash is the hash of the CA agents must pin ("sha256:...").
func (s *Service) CAHash() string { return s.ca.Hash() }

// csrKeySHA256 is the hex sha256 of the public key of a DER CSR, or "".
func csrKeySHA256(der []byte) string {
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return ""
	}
	sum := sha256.Sum256(csr.RawSubjectPublicKeyInfo)
	return hex.EncodeToString(sum[:])
}
