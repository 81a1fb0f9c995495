package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

// AdoptInfo describes an adoption.
type AdoptInfo struct {
	BackupInfo
	// Secrets is the number of sealed secrets re-sealed under this
	// store's key.
	Secrets int
}

// Adopt makes this store, a fresh controller's, the home of the fleet in
// a backup of another controller (the target side of a move): it pauses
// this controller (moving in from from), checks that it holds no
// resource, deletes its own secrets (its CA: the backup's replaces it)
// and audit records, and writes every key of the backup, the sealed
// secrets opened with the backup's sealer and sealed again under this
// store's. The pause stays: Resume once the copy is verified.
//
// It returns InvalidArgument for a damaged backup, FailedPrecondition
// when this store holds a resource (unless it is paused adopting from the
// same address: a move run again) or is paused for another move, and
// PermissionDenied when a secret does not open under the backup's key.
// Keys are written in transactions of 100.
func (s *Store) Adopt(ctx context.Context, r io.Reader, from *seal.Sealer, fromAddr string, now time.Time) (AdoptInfo, error) {
	if s.sealer == nil {
		return AdoptInfo{}, errdefs.FailedPrecondition("adopt: store has no sealing key configured")
	}
	data, err := io.ReadAll(io.LimitReader(r, MaxBackupSize+1))
	if err != nil {
		return AdoptInfo{}, fmt.Errorf("adopt: read: %w", err)
	}
	if len(data) > MaxBackupSize {
		return AdoptInfo{}, errdefs.InvalidArgument("adopt: backup larger than %d bytes", MaxBackupSize)
	}
	info, kvs, err := parseBackup(data)
	if err != nil {
		return AdoptInfo{}, err
	}
	// Re-seal first: nothing is written when a secret does not open.
	out := AdoptInfo{BackupInfo: info}
	secretsPrefix := Prefix + secretsKind + "/"
	for i, e := range kvs {
		if !strings.HasPrefix(string(e.key), secretsPrefix) {
			continue
		}
		pt, err := from.Open(e.value, e.key)
		if err != nil {
			return AdoptInfo{}, errdefs.PermissionDenied("adopt: secret %s does not open under the backup's key: %v", strings.TrimPrefix(string(e.key), secretsPrefix), err)
		}
		sealed, err := s.sealer.Seal(pt, e.key)
		if err != nil {
			return AdoptInfo{}, fmt.Errorf("adopt: seal %s: %w", strings.TrimPrefix(string(e.key), secretsPrefix), err)
		}
		kvs[i].value = sealed
		out.Secrets++
	}

	p, created, err := s.pause(ctx, Pause{From: fromAddr, By: "adopt", Since: now})
	if err != nil {
		return AdoptInfo{}, err
	}
	if p.From != fromAddr {
		return AdoptInfo{}, errdefs.FailedPrecondition("adopt: this controller is paused for another move (%s): it is not a fresh controller", p.String())
	}
	existing, err := s.client.Get(ctx, Prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return AdoptInfo{}, etcdErr(ctx, "adopt", err)
	}
	var drop []string
	var resources []string
	for _, e := range existing.Kvs {
		k := string(e.Key)
		switch {
		case k == pauseKey || strings.HasPrefix(k, Prefix+electionKind+"/") || strings.HasPrefix(k, ReplicasPrefix):
			// This controller's own live state: kept.
		case strings.HasPrefix(k, secretsPrefix) || strings.HasPrefix(k, AuditPrefix) || strings.HasPrefix(k, Prefix+PKIKind+"/") || e.Lease != 0:
			// The controller's own: its CA (the backup's replaces it),
			// its audit log, events.
			drop = append(drop, k)
		default:
			resources = append(resources, k)
			drop = append(drop, k)
		}
	}
	if len(resources) > 0 && created {
		// Paused just now by this call: a controller with a fleet of its
		// own. Leave it as it was.
		if err := s.Resume(ctx); err != nil {
			return AdoptInfo{}, err
		}
		return AdoptInfo{}, errdefs.FailedPrecondition("adopt: the target holds %d resources (first %s): a move needs a fresh controller (a new data directory), nothing was changed", len(resources), strings.TrimPrefix(resources[0], Prefix))
	}
	for i := 0; i < len(drop); i += restoreBatch {
		ops := make([]clientv3.Op, 0, restoreBatch)
		for _, k := range drop[i:min(i+restoreBatch, len(drop))] {
			ops = append(ops, clientv3.OpDelete(k))
		}
		if _, err := s.client.Txn(ctx).Then(ops...).Commit(); err != nil {
			return AdoptInfo{}, etcdErr(ctx, "adopt: delete this controller's own keys", err)
		}
	}
	for i := 0; i < len(kvs); i += restoreBatch {
		ops := make([]clientv3.Op, 0, restoreBatch)
		for _, e := range kvs[i:min(i+restoreBatch, len(kvs))] {
			ops = append(ops, clientv3.OpPut(string(e.key), string(e.value)))
		}
		if _, err := s.client.Txn(ctx).Then(ops...).Commit(); err != nil {
			return AdoptInfo{}, etcdErr(ctx, fmt.Sprintf("adopt: write keys %d-%d of %d (run the move again)", i+1, i+len(ops), len(kvs)), err)
		}
	}
	s.log.Info("fleet adopted", "from", fromAddr, "backup_revision", info.Revision, "keys", info.Keys, "secrets", out.Secrets, "replaced", len(drop))
	return out, nil
}

// PKIKind holds the controller CA's certificates (package controller);
// a fresh controller has them, and a move replaces them.
const PKIKind = "pki"

// KindInventory is the count and hash of one kind's keys (Inventory).
type KindInventory struct {
	Kind  string
	Count int
	// SHA256 (hex) of every key and value of the kind in key order; of
	// the paths only for secrets.
	SHA256 string
}

// Inventory counts and hashes every kind's keys at one revision, the
// sealed secrets by path only (their sealed values differ between
// controllers, and a hash of a value would be a guessable digest of a
// password). Audit records, election keys, events and the pause are left
// out: they belong to the controller, not the fleet. The kinds are in
// name order.
func (s *Store) Inventory(ctx context.Context) ([]KindInventory, int64, error) {
	resp, err := s.client.Get(ctx, Prefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		return nil, 0, etcdErr(ctx, "inventory", err)
	}
	type acc struct {
		n int
		h interface {
			Write([]byte) (int, error)
			Sum([]byte) []byte
		}
	}
	kinds := map[string]*acc{}
	for _, kv := range resp.Kvs {
		k := string(kv.Key)
		if kv.Lease != 0 || k == pauseKey || strings.HasPrefix(k, Prefix+electionKind+"/") || strings.HasPrefix(k, AuditPrefix) {
			continue
		}
		kind, _, _ := strings.Cut(strings.TrimPrefix(k, Prefix), "/")
		a := kinds[kind]
		if a == nil {
			a = &acc{h: sha256.New()}
			kinds[kind] = a
		}
		a.n++
		a.h.Write(kv.Key)
		a.h.Write([]byte{0})
		if kind != secretsKind {
			a.h.Write(kv.Value)
			a.h.Write([]byte{0})
		}
	}
	out := make([]KindInventory, 0, len(kinds))
	for kind, a := range kinds {
		out = append(out, KindInventory{Kind: kind, Count: a.n, SHA256: hex.EncodeToString(a.h.Sum(nil))})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Kind < out[j].Kind })
	return out, resp.Header.Revision, nil
}
