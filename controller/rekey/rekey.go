// Package rekey rotates the key that seals the controller's secrets at
// rest (kiln-controller rotate-secret-key): a new key, the key file
// switched to it, every secret re-sealed, the old key retired, each step
// safe to interrupt and run again (docs/controller.md, "Rotating the
// secret key").
package rekey

import (
	"context"
	"fmt"
	"log/slog"
	"os/user"
	"time"

	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/authz"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/trust"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Phase is how far Rotate goes.
type Phase string

const (
	// All runs the rotation to its end: prepare a next key, switch
	// the key file to it, re-seal every secret, retire the old key.
	All Phase = "all"
	// Prepare only writes KEY.Next (for replicas that keep their own
	// copy of the key file: copy it next to each of theirs).
	Prepare Phase = "prepare"
	// Switch only switches the key file to an existing KEY.Next,
	// keeping the old key as KEY.Prev; it does not reach etcd.
	Switch Phase = "switch"
)

// ParsePhase parses a --phase value ("" is All).
func ParsePhase(s string) (Phase, error) {
	switch p := Phase(s); p {
	case "":
		return All, nil
	case All, Prepare, Switch:
		return p, nil
	}
	return "", errdefs.InvalidArgument("phase %q: want all, prepare or switch", s)
}

// Request asks for a rotation of the secret key.
type Request struct {
	Phase Phase
	// Progress, when not nil, is called with each secret's path once it
	// is re-sealed.
	Progress func(path string)
	// Clock is the time source (time.Now).
	Clock func() time.Time
}

// Result says what a rotation did. Key ids name keys without
// revealing them (seal.IDOf).
type Result struct {
	// Resumed is set when the key files were in the middle of a rotation
	// (an interrupted run, or a phase run earlier): it was carried on, no
	// other key was made.
	Resumed bool
	// Created is set when this run generated the new key.
	Created bool
	// Old and New are the ids of the retired and the new key.
	Old, New seal.KeyID
	// Phase is the phase run to.
	Phase Phase
	// Secrets, Resealed and Conflicts are store.ResealResult's, summed
	// over the passes.
	Secrets, Resealed, Conflicts int
	// Retired is set when the old key file was removed.
	Retired bool
}

// resealPasses bounds the passes over the secrets until none is left
// under the old key (a controller may write one under it meanwhile).
const resealPasses = 5

// Rotate rotates the key that seals secrets at rest (cfg's secret
// key file): it makes a new key, switches the key file to it keeping the
// old one as KEY.Prev, re-seals every secret of the store under the new
// key (each in an etcd transaction on the value's mod revision, so a
// concurrent write is retried, never lost), and removes the old key once
// no secret is sealed under it. Every step leaves every secret openable
// by a controller started on the key files as they are: after a crash,
// run it again and it carries on (it makes no second key). See seal's
// rotate.go for the key files.
//
// It works on a stopped controller (it starts the data directory's
// embedded etcd), on a running one with an embedded etcd (through its
// client URL) and on an external etcd. Running controllers that read the
// same key file follow it: they seal under the new key from the switch on
// and open both. Replicas with their own copy of the key file need the
// prepare and switch phases on each (docs/controller.md).
//
// It returns FailedPrecondition when the key file is missing, damaged or
// not this store's (the CA key does not open under it), or when the key
// files are in a state no rotation leaves; the errors of
// store.ResealSecrets; and Unavailable when etcd does not answer.
func Rotate(ctx context.Context, cfg datadir.Config, req Request, log *slog.Logger) (Result, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "rotate-secret-key")
	res := Result{Phase: req.Phase}
	if res.Phase == "" {
		res.Phase = All
	}
	if cfg.DataDir == "" && cfg.SecretKeyFile == "" {
		return res, errdefs.InvalidArgument("rotate secret key: data directory is required")
	}
	keyFile := cfg.KeyFile()
	state, err := seal.ReadRotation(keyFile)
	if err != nil {
		return res, fmt.Errorf("rotate secret key: %w", err)
	}
	res.Resumed = state != seal.Idle
	log.Info("key files read", "key_file", keyFile, "state", state)

	switch res.Phase {
	case Prepare:
		res.New, res.Created, err = seal.Prepare(keyFile)
		return res, err
	case Switch:
		if state == seal.Idle {
			return res, errdefs.FailedPrecondition("rotate secret key: %s does not exist: run --phase prepare on one replica and copy the file it writes next to this key file first", seal.NextPath(keyFile))
		}
		return res, switchKey(keyFile, &res)
	}

	// Reach the store, and check the key files are its, before any file
	// changes: a wrong --secret-key-file or etcd must change nothing.
	if len(cfg.EtcdEndpoints) == 0 && cfg.DataDir == "" {
		return res, errdefs.InvalidArgument("rotate secret key: --data-dir or --etcd-endpoints is required to reach the store")
	}
	client, done, err := datadir.Open(ctx, cfg, log)
	if err != nil {
		return res, err
	}
	defer done()
	ring, err := seal.LoadKeyRing(keyFile)
	if err != nil {
		return res, fmt.Errorf("rotate secret key: %w", err)
	}
	if _, err := store.New(client, store.WithSealer(ring)).GetSecret(ctx, trust.KeySecret); err != nil {
		if errdefs.IsNotFound(err) {
			return res, errdefs.FailedPrecondition("rotate secret key: the store holds no CA key: start the controller once first (or check --data-dir / --etcd-endpoints)")
		}
		return res, errdefs.FailedPrecondition("rotate secret key: the CA key does not open under %s and the keys next to it (%v): is it this controller's --secret-key-file?", keyFile, err)
	}

	if state == seal.Idle || state == seal.Prepared {
		if res.New, res.Created, err = seal.Prepare(keyFile); err != nil {
			return res, fmt.Errorf("rotate secret key: %w", err)
		}
		log.Info("next key ready", "key_id", res.New, "created", res.Created)
		if err := switchKey(keyFile, &res); err != nil {
			return res, err
		}
	}
	// Switched: the key file holds the new key, KEY.Prev the old one. The
	// re-seal uses a fixed ring of both, so that a value a controller
	// sealed under the old key just before it followed the switch still
	// opens after KEY.Prev is gone.
	newKey, err := seal.ReadKeyFile(keyFile)
	if err != nil {
		return res, fmt.Errorf("rotate secret key: %w", err)
	}
	oldKey, err := seal.ReadKeyFile(seal.PrevPath(keyFile))
	if err != nil {
		return res, fmt.Errorf("rotate secret key: %w", err)
	}
	res.New, res.Old = seal.IDOf(newKey), seal.IDOf(oldKey)
	both, err := seal.NewRing(newKey, oldKey)
	clear(newKey)
	clear(oldKey)
	if err != nil {
		return res, err
	}
	st := store.New(client, store.WithSealer(both), store.WithLogger(log))
	if err := resealAll(ctx, st, req.Progress, &res, log); err != nil {
		return res, err
	}
	if err := seal.Retire(keyFile); err != nil {
		return res, fmt.Errorf("rotate secret key: %w", err)
	}
	res.Retired = true
	log.Info("old key retired", "key_id", res.Old)
	// A write that raced the last check is still ours to re-seal: this
	// ring holds the old key until we return.
	if err := resealAll(ctx, st, req.Progress, &res, log); err != nil {
		return res, err
	}
	clock := req.Clock
	if clock == nil {
		clock = time.Now
	}
	if err := st.AppendAudit(ctx, audit.Record(rotateEntry(res, clock()))); err != nil {
		return res, fmt.Errorf("rotate secret key: done, but the audit record failed: %w", err)
	}
	log.Info("secret key rotated", "old_key_id", res.Old, "new_key_id", res.New, "secrets", res.Secrets, "resealed", res.Resealed)
	return res, nil
}

// switchKey switches the key files and records the ids.
func switchKey(keyFile string, res *Result) error {
	before, err := seal.ReadKeyFile(keyFile)
	if err != nil {
		return fmt.Errorf("rotate secret key: %w", err)
	}
	if err := seal.Switch(keyFile); err != nil {
		return fmt.Errorf("rotate secret key: %w", err)
	}
	after, err := seal.ReadKeyFile(keyFile)
	if err != nil {
		return fmt.Errorf("rotate secret key: %w", err)
	}
	res.New = seal.IDOf(after)
	if prev, err := seal.ReadKeyFile(seal.PrevPath(keyFile)); err == nil {
		res.Old = seal.IDOf(prev)
	} else {
		res.Old = seal.IDOf(before)
	}
	clear(before)
	clear(after)
	return nil
}

// resealAll re-seals until a pass finds every secret under the new key.
func resealAll(ctx context.Context, st *store.Store, progress func(string), res *Result, log *slog.Logger) error {
	for pass := 1; pass <= resealPasses; pass++ {
		r, err := st.ResealSecrets(ctx, progress)
		res.Resealed += r.Resealed
		res.Conflicts += r.Conflicts
		if err != nil {
			return fmt.Errorf("rotate secret key: %w (the old key is kept: run the command again)", err)
		}
		res.Secrets = r.Secrets
		log.Info("re-seal pass", "pass", pass, "secrets", r.Secrets, "resealed", r.Resealed, "conflicts", r.Conflicts)
		ids, err := st.SecretKeyIDs(ctx)
		if err != nil {
			return fmt.Errorf("rotate secret key: %w", err)
		}
		left := 0
		for _, id := range ids {
			if id != res.New.String() {
				left++
			}
		}
		if left == 0 {
			return nil
		}
	}
	return errdefs.Unavailable("rotate secret key: secrets are still being written under the old key after %d passes (a controller that does not read this key file?); the old key is kept: run the command again", resealPasses)
}

// rotateEntry is the audit entry of a rotation, made by whoever can read
// the key file, named by the local user.
func rotateEntry(res Result, now time.Time) *controllerv1.AuditEntry {
	by := "local"
	if u, err := user.Current(); err == nil {
		by = "local:" + u.Username
	}
	e := audit.NewCall(authz.Caller{Name: by, Role: "data-dir"}, "rotate-secret-key", func() time.Time { return now }).Entry("SecretKey", res.New.String())
	e.Result = audit.OK
	e.Message = fmt.Sprintf("re-sealed %d of %d secrets under key %s; key %s retired", res.Resealed, res.Secrets, res.New, res.Old)
	return e
}
