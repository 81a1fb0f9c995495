package trust

import (
	"context"
	"fmt"
	"log/slog"
	"os/user"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/authz"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
	"github.com/kilnhq/kiln/internal/seal"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Phase is one step of a CA rotation.
type Phase string

const (
	// Prepare makes the new CA and has every replica and agent trust it
	// next to the old one; nothing is signed by it yet.
	Prepare Phase = "prepare"
	// Switch makes the new CA the one that signs agent and operator
	// certificates; agents are asked to renew at their next heartbeat.
	// The controller keeps serving with a certificate of the old CA,
	// which every client trusts.
	Switch Phase = "switch"
	// Retire removes the old CA once every agent's certificate is from
	// the new one; the controller then serves with a certificate of the
	// new CA, and certificates of the old one are refused.
	Retire Phase = "retire"
	// Status changes nothing: it says where the rotation is and which
	// hosts still hold a certificate of the old CA.
	Status Phase = "status"
)

// ParsePhase parses a --phase value.
func ParsePhase(s string) (Phase, error) {
	switch p := Phase(s); p {
	case Prepare, Switch, Retire, Status:
		return p, nil
	}
	return "", errdefs.InvalidArgument("phase %q: want prepare, switch, retire or status", s)
}

// RotateRequest asks for one phase of a CA rotation.
type RotateRequest struct {
	Phase Phase
	// AllowOffline lets retire go ahead while hosts whose agent is not
	// sending heartbeats still hold a certificate of the old CA: those
	// agents must enroll again afterwards.
	AllowOffline bool
	// Clock is the time source (time.Now).
	Clock func() time.Time
}

// HostCA says which CA a host's agent certificate is from.
type HostCA struct {
	Host string
	// Issuer is the key id of the CA of its current certificate ("" when
	// not recorded: enrolled before the controller recorded it).
	Issuer string
	// OnSigner is set when the current certificate is from the signing CA
	// and the agent has used it (no previous certificate pending).
	OnSigner bool
	// Live is set when the agent sends heartbeats (AgentReachable=True).
	Live bool
}

// RotateResult says what a phase did, or found.
type RotateResult struct {
	Phase Phase
	// State is the rotation's state after the phase: idle, prepared or
	// switched.
	State string
	// Resumed is set when the phase had already been done (by an earlier
	// run, or another replica): nothing was changed.
	Resumed bool
	// Old and New are the key ids (pki.CA.KeyID) of the CA being retired
	// and the one replacing it; OldHash and NewHash are their pins.
	Old, New         string
	OldHash, NewHash string
	// Hosts are the hosts with an enrolled agent, by name.
	Hosts []HostCA
}

// Pending returns the hosts not yet on the signing CA, live ones first.
func (r RotateResult) Pending() (live, offline []string) {
	for _, h := range r.Hosts {
		switch {
		case h.OnSigner:
		case h.Live:
			live = append(live, h.Host)
		default:
			offline = append(offline, h.Host)
		}
	}
	return live, offline
}

// Rotate runs one phase of a rotation of the controller's CA, against
// the controller's etcd (a running controller's embedded one, a stopped
// one's, or an external one), with cfg's secret key file to open and seal
// the CA keys. Each phase is one etcd transaction, compared against what
// it read: a crash leaves the rotation before or after the phase, two
// runs at once cannot both apply, and running a phase again that is done
// changes nothing (Resumed). Running replicas follow each change within
// moments (they watch the CA records); agents follow through their
// heartbeats. Each applied phase is an audit entry (verb rotate-ca).
//
// It returns FailedPrecondition when the phase does not follow the
// rotation's state (switch before prepare, prepare while switched), when
// retire finds live agents still on the old CA (listing them; or offline
// ones without AllowOffline), when the store holds no CA, or when the CA
// key does not open with the key file; Unavailable when etcd does not
// answer or another run changed the CA records meanwhile.
func Rotate(ctx context.Context, cfg datadir.Config, req RotateRequest, log *slog.Logger) (RotateResult, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "rotate-ca")
	res := RotateResult{Phase: req.Phase}
	if _, err := ParsePhase(string(req.Phase)); err != nil {
		return res, fmt.Errorf("rotate CA: %w", err)
	}
	if cfg.DataDir == "" && (cfg.SecretKeyFile == "" || len(cfg.EtcdEndpoints) == 0) {
		return res, errdefs.InvalidArgument("rotate CA: --data-dir (or --secret-key-file and --etcd-endpoints) is required")
	}
	keyFile := cfg.KeyFile()
	ring, err := seal.LoadKeyRing(keyFile)
	if err != nil {
		return res, errdefs.FailedPrecondition("rotate CA: secret key %s: %v", keyFile, err)
	}
	clock := req.Clock
	if clock == nil {
		clock = time.Now
	}
	client, done, err := datadir.Open(ctx, cfg, log)
	if err != nil {
		return res, err
	}
	defer done()
	st := store.New(client, store.WithSealer(ring), store.WithLogger(log))
	set, revs, err := readCASet(ctx, st)
	if errdefs.IsNotFound(err) {
		return res, errdefs.FailedPrecondition("rotate CA: the store holds no CA: start the controller once first (or check --data-dir / --etcd-endpoints)")
	}
	if err != nil {
		return res, fmt.Errorf("rotate CA: %w (is --secret-key-file this controller's?)", err)
	}
	res.describe(set)
	if res.Hosts, err = hostCAs(ctx, st, set.Signer); err != nil {
		return res, fmt.Errorf("rotate CA: %w", err)
	}

	switch req.Phase {
	case Status:
		return res, nil
	case Prepare:
		switch set.Phase() {
		case "prepared":
			res.Resumed = true
			return res, nil
		case "switched":
			return res, errdefs.FailedPrecondition("rotate CA: a rotation is switched to CA %s and CA %s is not retired yet: run --phase retire first", res.New, res.Old)
		}
		now := clock()
		next, err := pki.NewCA(fmt.Sprintf("%s-%s", commonName, now.UTC().Format("20060102T150405Z")), now)
		if err != nil {
			return res, fmt.Errorf("rotate CA: %w", err)
		}
		keyPEM, err := next.KeyPEM()
		if err != nil {
			return res, fmt.Errorf("rotate CA: %w", err)
		}
		ok, err := st.CommitIf(ctx,
			[]clientv3.Cmp{
				clientv3.Compare(clientv3.ModRevision(CertKey), "=", revs.signer),
				clientv3.Compare(clientv3.CreateRevision(nextCertKey), "=", 0),
				clientv3.Compare(clientv3.CreateRevision(prevCertKey), "=", 0),
			},
			[]clientv3.Op{clientv3.OpPut(nextCertKey, string(next.CertPEM()))},
			audit.Record(rotateCAEntry(Prepare, next.KeyID(), fmt.Sprintf("new CA %s (%s) trusted next to %s; nothing signed by it yet", next.KeyID(), next.Hash(), set.Signer.KeyID()), now)),
			store.PutSecretOp(nextKeySecret, keyPEM))
		clear(keyPEM)
		if err != nil {
			return res, fmt.Errorf("rotate CA: %w", err)
		}
		if !ok {
			return res, errdefs.Unavailable("rotate CA: the CA records changed while this ran (another rotate-ca?): run it again")
		}
		set.Next = next
		res.describe(set)
		log.Info("new CA prepared", "new", res.New, "new_ca_hash", res.NewHash, "old", res.Old)
		return res, nil
	case Switch:
		switch set.Phase() {
		case "switched":
			res.Resumed = true
			return res, nil
		case "idle":
			return res, errdefs.FailedPrecondition("rotate CA: no new CA prepared: run --phase prepare first")
		}
		oldKey, err := set.Signer.KeyPEM()
		if err != nil {
			return res, fmt.Errorf("rotate CA: %w", err)
		}
		newKey, err := set.Next.KeyPEM()
		if err != nil {
			return res, fmt.Errorf("rotate CA: %w", err)
		}
		now := clock()
		ok, err := st.CommitIf(ctx,
			[]clientv3.Cmp{
				clientv3.Compare(clientv3.ModRevision(CertKey), "=", revs.signer),
				clientv3.Compare(clientv3.ModRevision(nextCertKey), "=", revs.next),
				clientv3.Compare(clientv3.CreateRevision(prevCertKey), "=", 0),
			},
			[]clientv3.Op{
				clientv3.OpPut(prevCertKey, string(set.Signer.CertPEM())),
				clientv3.OpPut(CertKey, string(set.Next.CertPEM())),
				clientv3.OpDelete(nextCertKey),
			},
			audit.Record(rotateCAEntry(Switch, set.Next.KeyID(), fmt.Sprintf("CA %s signs from now on; CA %s still trusted and serving until retired", set.Next.KeyID(), set.Signer.KeyID()), now)),
			store.PutSecretOp(prevKeySecret, oldKey),
			store.PutSecretOp(KeySecret, newKey),
			store.DeleteSecretOp(nextKeySecret))
		clear(oldKey)
		clear(newKey)
		if err != nil {
			return res, fmt.Errorf("rotate CA: %w", err)
		}
		if !ok {
			return res, errdefs.Unavailable("rotate CA: the CA records changed while this ran (another rotate-ca?): run it again")
		}
		set = &Set{Signer: set.Next, Prev: set.Signer}
		res.describe(set)
		if res.Hosts, err = hostCAs(ctx, st, set.Signer); err != nil {
			return res, fmt.Errorf("rotate CA: switched, but: %w", err)
		}
		log.Info("switched to the new CA", "new", res.New, "old", res.Old)
		return res, nil
	default: // Retire
		switch set.Phase() {
		case "idle":
			res.Resumed = true
			return res, nil
		case "prepared":
			return res, errdefs.FailedPrecondition("rotate CA: the new CA %s is prepared but does not sign yet: run --phase switch, let the agents renew, then retire", res.New)
		}
		live, offline := res.Pending()
		if len(live) > 0 {
			return res, errdefs.FailedPrecondition("rotate CA: %d live agent(s) still use a certificate of the old CA %s: %s; they are asked to renew at their next heartbeat: wait and run --phase retire again (kiln-controller rotate-ca --phase status lists them)",
				len(live), res.Old, joinAtMost(live, 10))
		}
		if len(offline) > 0 && !req.AllowOffline {
			return res, errdefs.FailedPrecondition("rotate CA: %d host(s) whose agent is not sending heartbeats still hold a certificate of the old CA %s: %s; once it is retired they must enroll again: bring them up and wait for them to renew, or pass --allow-offline",
				len(offline), res.Old, joinAtMost(offline, 10))
		}
		now := clock()
		msg := fmt.Sprintf("CA %s retired; CA %s signs and serves", set.Prev.KeyID(), set.Signer.KeyID())
		if len(offline) > 0 {
			msg += fmt.Sprintf("; %d offline host(s) left on the old CA must enroll again: %s", len(offline), joinAtMost(offline, 10))
		}
		ok, err := st.CommitIf(ctx,
			[]clientv3.Cmp{
				clientv3.Compare(clientv3.ModRevision(CertKey), "=", revs.signer),
				clientv3.Compare(clientv3.ModRevision(prevCertKey), "=", revs.prev),
			},
			[]clientv3.Op{clientv3.OpDelete(prevCertKey)},
			audit.Record(rotateCAEntry(Retire, set.Signer.KeyID(), msg, now)),
			store.DeleteSecretOp(prevKeySecret))
		if err != nil {
			return res, fmt.Errorf("rotate CA: %w", err)
		}
		if !ok {
			return res, errdefs.Unavailable("rotate CA: the CA records changed while this ran (another rotate-ca?): run it again")
		}
		res.State = "idle"
		log.Info("old CA retired", "old", res.Old, "new", res.New)
		return res, nil
	}
}

// describe fills in the state and the old and new CAs of set.
func (r *RotateResult) describe(set *Set) {
	r.State = set.Phase()
	switch {
	case set.Next != nil:
		r.Old, r.OldHash = set.Signer.KeyID(), set.Signer.Hash()
		r.New, r.NewHash = set.Next.KeyID(), set.Next.Hash()
	case set.Prev != nil:
		r.Old, r.OldHash = set.Prev.KeyID(), set.Prev.Hash()
		r.New, r.NewHash = set.Signer.KeyID(), set.Signer.Hash()
	default:
		r.Old, r.OldHash = "", ""
		r.New, r.NewHash = set.Signer.KeyID(), set.Signer.Hash()
	}
}

// caRevs are the mod revisions of the CA records read.
type caRevs struct{ signer, next, prev int64 }

// readCASet reads the CA set and the revisions of its records.
func readCASet(ctx context.Context, st *store.Store) (*Set, caRevs, error) {
	var revs caRevs
	resp, err := st.Client().Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, revs, errdefs.Unavailable("etcd: %w", err)
	}
	for _, kv := range resp.Kvs {
		switch string(kv.Key) {
		case CertKey:
			revs.signer = kv.ModRevision
		case nextCertKey:
			revs.next = kv.ModRevision
		case prevCertKey:
			revs.prev = kv.ModRevision
		}
	}
	set, err := LoadSet(ctx, st)
	if err != nil {
		return nil, revs, err
	}
	// A change between the two reads shows in the revisions the phases
	// compare against: their transaction then fails, and nothing is done.
	return set, revs, nil
}

// hostCAs lists the hosts with an enrolled agent and whether each is on
// the signing CA.
func hostCAs(ctx context.Context, st *store.Store, signer *pki.CA) ([]HostCA, error) {
	var out []HostCA
	cont := ""
	for {
		items, next, err := st.List(ctx, enrollment.HostsKind, func() proto.Message { return &typesv1.Host{} }, store.ListOptions{Limit: 500, Continue: cont})
		if err != nil {
			return nil, fmt.Errorf("hosts: %w", err)
		}
		for _, it := range items {
			h := it.Msg.(*typesv1.Host)
			a := h.GetStatus().GetAgent()
			if a.GetCertificateSerial() == "" {
				continue
			}
			out = append(out, HostCA{
				Host:     h.GetMetadata().GetName(),
				Issuer:   a.GetCertificateIssuer(),
				OnSigner: a.GetCertificateIssuer() == signer.KeyID() && a.GetPreviousCertificateSerial() == "",
				Live:     conditions.IsTrue(h.GetStatus().GetConditions(), enrollment.ConditionAgentReachable),
			})
		}
		if next == "" {
			break
		}
		cont = next
	}
	slices.SortFunc(out, func(a, b HostCA) int { return strings.Compare(a.Host, b.Host) })
	return out, nil
}

// rotateCAEntry is the audit entry of a CA rotation phase, made by whoever
// can read the data directory and its key, named by the local user.
func rotateCAEntry(phase Phase, keyID, msg string, now time.Time) *controllerv1.AuditEntry {
	by := "local"
	if u, err := user.Current(); err == nil {
		by = "local:" + u.Username
	}
	e := audit.NewCall(authz.Caller{Name: by, Role: "data-dir"}, "rotate-ca", func() time.Time { return now }).Entry("CA", keyID)
	e.Result = audit.OK
	e.Message = string(phase) + ": " + msg
	return e
}

// joinAtMost joins the first n names and says how many more.
func joinAtMost(names []string, n int) string {
	if len(names) <= n {
		return strings.Join(names, ", ")
	}
	return strings.Join(names[:n], ", ") + fmt.Sprintf(" and %d more", len(names)-n)
}
