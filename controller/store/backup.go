package store

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// A backup is a logical copy of every key under /kiln/v1/ (resources and
// sealed secrets; not election keys or events, which belong to leases)
// read at one etcd revision:
//
//	"KILNBAK1\n"  uvarint(revision)
//	{ uvarint(len(key)) key uvarint(len(value)) value } ...
//	uvarint(0)    uvarint(count)   sha256 of everything before (32 bytes)
//
// Secrets stay sealed: restoring them needs the same sealing key file.
const backupMagic = "KILNBAK1\n"

// MaxBackupSize bounds what Restore reads into memory before it checks
// the backup's checksum.
const MaxBackupSize = 1 << 30

// restoreBatch is the number of keys written per transaction (etcd's
// default limit is 128 operations).
const restoreBatch = 100

// BackupInfo describes a backup.
type BackupInfo struct {
	// Revision is the etcd revision the backup was read at.
	Revision int64
	// Keys is the number of keys in it.
	Keys int
}

// Backup writes every resource and sealed secret, as of one revision, to
// w. It does not block writers. It returns Unavailable when etcd does not
// answer, FailedPrecondition when the revision it reads at is compacted
// before it finishes (run it again), and w's errors.
func (s *Store) Backup(ctx context.Context, w io.Writer) (BackupInfo, error) {
	h := sha256.New()
	bw := bufio.NewWriter(io.MultiWriter(w, h))
	var info BackupInfo
	var buf [binary.MaxVarintLen64]byte
	putUvarint := func(v uint64) {
		n := binary.PutUvarint(buf[:], v)
		bw.Write(buf[:n])
	}
	end := clientv3.GetPrefixRangeEnd(Prefix)
	start := Prefix
	for {
		opts := []clientv3.OpOption{
			clientv3.WithRange(end),
			clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend),
			clientv3.WithLimit(1000),
		}
		if info.Revision > 0 {
			opts = append(opts, clientv3.WithRev(info.Revision))
		}
		resp, err := s.client.Get(ctx, start, opts...)
		if err != nil {
			if errors.Is(err, rpctypes.ErrCompacted) {
				return BackupInfo{}, errdefs.FailedPrecondition("backup: revision %d was compacted while reading; run the backup again", info.Revision)
			}
			return BackupInfo{}, etcdErr(ctx, "backup", err)
		}
		if info.Revision == 0 {
			info.Revision = resp.Header.Revision
			bw.WriteString(backupMagic)
			putUvarint(uint64(info.Revision))
		}
		for _, kv := range resp.Kvs {
			// Election keys belong to live leases; so do events, which
			// expire: restored without their lease they never would; so do
			// the registrations of live replicas. The pause of a move stays
			// with the controller it paused.
			if strings.HasPrefix(string(kv.Key), Prefix+electionKind+"/") || strings.HasPrefix(string(kv.Key), ReplicasPrefix) || kv.Lease != 0 || string(kv.Key) == pauseKey {
				continue
			}
			putUvarint(uint64(len(kv.Key)))
			bw.Write(kv.Key)
			putUvarint(uint64(len(kv.Value)))
			bw.Write(kv.Value)
			info.Keys++
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		start = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	putUvarint(0)
	putUvarint(uint64(info.Keys))
	if err := bw.Flush(); err != nil {
		return BackupInfo{}, fmt.Errorf("backup: write: %w", err)
	}
	if _, err := w.Write(h.Sum(nil)); err != nil {
		return BackupInfo{}, fmt.Errorf("backup: write: %w", err)
	}
	s.log.Info("backup written", "revision", info.Revision, "keys", info.Keys)
	return info, nil
}

// RestoreOptions controls Restore.
type RestoreOptions struct {
	// Replace deletes every existing resource and secret first. Without
	// it, Restore refuses a store that already holds any.
	Replace bool
}

type kv struct{ key, value []byte }

// Restore reads a backup made by Backup and writes its keys into this
// store's etcd. It checks the whole backup (format and checksum) before it
// changes anything and returns InvalidArgument for a damaged or truncated
// one. It returns FailedPrecondition when the store is not empty and
// opts.Replace is false. Keys are written in transactions of 100: if
// Restore fails part-way, run it again with Replace.
//
// Stop every controller (or at least the leader's reconcilers) before a
// restore; watchers see the restored keys as new writes.
func (s *Store) Restore(ctx context.Context, r io.Reader, opts RestoreOptions) (BackupInfo, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxBackupSize+1))
	if err != nil {
		return BackupInfo{}, fmt.Errorf("restore: read: %w", err)
	}
	if len(data) > MaxBackupSize {
		return BackupInfo{}, errdefs.InvalidArgument("restore: backup larger than %d bytes", MaxBackupSize)
	}
	info, kvs, err := parseBackup(data)
	if err != nil {
		return BackupInfo{}, err
	}

	existing, err := s.client.Get(ctx, Prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return BackupInfo{}, etcdErr(ctx, "restore", err)
	}
	var present []string
	for _, e := range existing.Kvs {
		if !strings.HasPrefix(string(e.Key), Prefix+electionKind+"/") {
			present = append(present, string(e.Key))
		}
	}
	if len(present) > 0 {
		if !opts.Replace {
			return BackupInfo{}, errdefs.FailedPrecondition("restore: store already holds %d keys (first %s); restore into an empty store or replace its contents", len(present), present[0])
		}
		for i := 0; i < len(present); i += restoreBatch {
			ops := make([]clientv3.Op, 0, restoreBatch)
			for _, k := range present[i:min(i+restoreBatch, len(present))] {
				ops = append(ops, clientv3.OpDelete(k))
			}
			if _, err := s.client.Txn(ctx).Then(ops...).Commit(); err != nil {
				return BackupInfo{}, etcdErr(ctx, "restore: delete existing keys", err)
			}
		}
	}
	for i := 0; i < len(kvs); i += restoreBatch {
		ops := make([]clientv3.Op, 0, restoreBatch)
		for _, e := range kvs[i:min(i+restoreBatch, len(kvs))] {
			ops = append(ops, clientv3.OpPut(string(e.key), string(e.value)))
		}
		if _, err := s.client.Txn(ctx).Then(ops...).Commit(); err != nil {
			return BackupInfo{}, etcdErr(ctx, fmt.Sprintf("restore: write keys %d-%d of %d", i+1, i+len(ops), len(kvs)), err)
		}
	}
	s.log.Info("backup restored", "backup_revision", info.Revision, "keys", info.Keys, "replaced", len(present))
	return info, nil
}

// ReadBackupInfo checks a backup without restoring it and describes it.
func ReadBackupInfo(r io.Reader) (BackupInfo, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxBackupSize+1))
	if err != nil {
		return BackupInfo{}, fmt.Errorf("read backup: %w", err)
	}
	info, _, err := parseBackup(data)
	return info, err
}

func parseBackup(data []byte) (BackupInfo, []kv, error) {
	bad := func(what string) error {
		return errdefs.InvalidArgument("restore: not a valid Kiln backup: %s", what)
	}
	if len(data) < len(backupMagic)+sha256.Size || !bytes.HasPrefix(data, []byte(backupMagic)) {
		return BackupInfo{}, nil, bad("missing header")
	}
	body, sum := data[:len(data)-sha256.Size], data[len(data)-sha256.Size:]
	if want := sha256.Sum256(body); !bytes.Equal(want[:], sum) {
		return BackupInfo{}, nil, bad("checksum mismatch (damaged or truncated)")
	}
	rd := bytes.NewReader(body[len(backupMagic):])
	rev, err := binary.ReadUvarint(rd)
	if err != nil {
		return BackupInfo{}, nil, bad("no revision")
	}
	if rev > math.MaxInt64 {
		// etcd revisions are int64: this one was not written by Backup.
		return BackupInfo{}, nil, bad(fmt.Sprintf("revision %d out of range", rev))
	}
	readBytes := func() ([]byte, error) {
		n, err := binary.ReadUvarint(rd)
		if err != nil || n > uint64(rd.Len()) {
			return nil, bad("truncated record")
		}
		b := make([]byte, n)
		io.ReadFull(rd, b)
		return b, nil
	}
	var kvs []kv
	for {
		key, err := readBytes()
		if err != nil {
			return BackupInfo{}, nil, err
		}
		if len(key) == 0 {
			break
		}
		if !bytes.HasPrefix(key, []byte(Prefix)) {
			return BackupInfo{}, nil, bad(fmt.Sprintf("key %q outside %s", key, Prefix))
		}
		val, err := readBytes()
		if err != nil {
			return BackupInfo{}, nil, err
		}
		kvs = append(kvs, kv{key, val})
	}
	count, err := binary.ReadUvarint(rd)
	if err != nil || count != uint64(len(kvs)) || rd.Len() != 0 {
		return BackupInfo{}, nil, bad("key count does not match")
	}
	return BackupInfo{Revision: int64(rev), Keys: len(kvs)}, kvs, nil
}
