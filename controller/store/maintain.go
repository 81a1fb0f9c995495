package store

import (
	"context"
	"errors"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/server/v3/storage/mvcc"
)

// Compaction says how much history (old revisions of keys) an embedded
// member keeps: a watch or a paged read can resume from any revision
// kept; one that asks for a compacted revision gets FailedPrecondition
// and lists again (Cache does that by itself). The history kept is the
// shortest of three: every change younger than Retention, no more than
// MaxRevisions changes, and no more than MaxHistoryBytes of database.
// Time alone grows with the write rate (a wave of 100,000 hosts writes
// about 4,000 object versions a second, 1-2 KiB each); revisions alone
// keep hours of a quiet fleet's history, and with the store's group
// commit one revision holds up to a group's writes (about 20 in a wave),
// so only the bytes bound holds the database to a size during a wave.
type Compaction struct {
	// Retention keeps every change younger than this (unless
	// MaxRevisions or MaxHistoryBytes cuts it); 0 means DefaultCompactionRetention, < 0 no
	// time bound.
	Retention time.Duration
	// MaxRevisions keeps at most this many revisions of history; 0 means
	// DefaultCompactionMaxRevisions, < 0 no bound. With both bounds off
	// nothing is compacted and the database grows until etcd's quota.
	MaxRevisions int64
	// MaxHistoryBytes compacts when the database in use has grown this
	// much since the last compaction (the growth is history, or new
	// objects, which a compaction leaves), keeping about one look's
	// (tick's) history; 0 means DefaultCompactionMaxHistoryBytes, < 0 no
	// bound.
	MaxHistoryBytes int64
}

// The default history: the same 5 minutes the Kubernetes API server
// keeps (it compacts its etcd every 5 minutes), at most 500,000
// revisions (a quiet fleet's bound), and at most 128 MiB of database
// grown since the last compaction, which keeps a 100,000-host wave's
// database file near 540 MiB, all of it mapped into the process (256
// MiB: 670-690 MiB, and the wave no faster; 64 MiB: 520 MiB, the wave
// 20 s slower; docs/scale.md, session 18).
const (
	DefaultCompactionRetention       = 5 * time.Minute
	DefaultCompactionMaxRevisions    = 500_000
	DefaultCompactionMaxHistoryBytes = 128 << 20
)

func (c Compaction) withDefaults() Compaction {
	if c.Retention == 0 {
		c.Retention = DefaultCompactionRetention
	}
	if c.MaxRevisions == 0 {
		c.MaxRevisions = DefaultCompactionMaxRevisions
	}
	if c.MaxHistoryBytes == 0 {
		c.MaxHistoryBytes = DefaultCompactionMaxHistoryBytes
	}
	return c
}

// tick is how often the compactor looks: a tenth of Retention, between
// 10 ms and 10 s.
func (c Compaction) tick() time.Duration {
	if c.Retention <= 0 {
		return 10 * time.Second
	}
	return min(max(c.Retention/10, 10*time.Millisecond), 10*time.Second)
}

// revAt is the member's revision at a moment.
type revAt struct {
	at  time.Time
	rev int64
}

// target returns the revision to compact to (every older revision goes),
// or 0 when nothing is due: samples are the member's revisions at earlier
// moments, oldest first, the last one now's; cur is its revision now,
// compacted the revision of the last compaction, and grown how much the
// database in use has grown since.
func (c Compaction) target(samples []revAt, now time.Time, cur, compacted, grown int64) int64 {
	var t int64
	if c.MaxHistoryBytes > 0 && grown >= c.MaxHistoryBytes && len(samples) > 1 {
		// Keep the history since the previous look: a watch that
		// fell further behind than that lists again.
		t = samples[len(samples)-2].rev
	}
	if c.Retention > 0 {
		for _, s := range samples {
			if now.Sub(s.at) < c.Retention {
				break
			}
			t = max(t, s.rev)
		}
	}
	if c.MaxRevisions > 0 {
		t = max(t, cur-c.MaxRevisions)
	}
	if t <= compacted {
		return 0
	}
	return t
}

// The defragmentation policy. etcd's database file never shrinks by
// itself: a compaction frees pages that later writes reuse, and the file
// stays at its largest size. Defragmenting rewrites it without the free
// pages but blocks the member (every read and write waits) meanwhile, so
// the member does it only when it gives back a lot: at start (before any
// client), and while running at most once per DefragInterval, when at
// least defragMinFree and half the file is free, or when the file has
// reached quotaWarnPercent of the quota (etcd's quota counts the file,
// free pages included).
const (
	defragMinFree    = 64 << 20
	quotaWarnPercent = 80
	// DefaultDefragInterval is the least time between two defragmentations
	// of a running member.
	DefaultDefragInterval = time.Hour
	// DefaultQuotaBytes is etcd's default quota of a member's database.
	DefaultQuotaBytes = 2 << 30
	// maintainEvery is how often the member's size is looked at.
	maintainEvery = time.Minute
)

// defragDue reports whether a member whose file is size bytes, inUse of
// them in use, should defragment now, last defragmented at last.
func defragDue(size, inUse, quota int64, last, now time.Time, every time.Duration) bool {
	free := size - inUse
	if every < 0 || now.Sub(last) < every || free < defragMinFree {
		return false
	}
	return 2*free >= size || nearQuota(size, quota)
}

// nearQuota reports whether a file of size bytes has reached
// quotaWarnPercent of quota.
func nearQuota(size, quota int64) bool {
	return size*100 >= quota*quotaWarnPercent
}

// maintain compacts and defragments the member until ctx ends. It
// blocks.
func (e *Embedded) maintain(ctx context.Context, c Compaction, quota int64, defragEvery, lookEvery time.Duration) {
	srv := e.etcd.Server
	var samples []revAt
	var compacted int64
	// base is the database in use after the last compaction (-1: take it
	// at the next look, once etcd has counted the pages freed).
	base := srv.Backend().SizeInUse()
	start := time.Now()
	lastDefrag, lastLook, warned := start, start, time.Time{}
	tick := time.NewTicker(min(c.tick(), lookEvery))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		now := time.Now()
		cur := srv.KV().Rev()
		samples = append(samples, revAt{now, cur})
		// Keep the newest sample older than Retention and the ones after,
		// and the previous look's always (the bytes bound's target).
		for len(samples) > 2 && now.Sub(samples[1].at) >= c.Retention {
			samples = samples[1:]
		}
		// Only the leader compacts: a compaction goes through raft to
		// every member.
		inUse := srv.Backend().SizeInUse()
		if base < 0 {
			base = inUse
		}
		if t := c.target(samples, now, cur, compacted, inUse-base); t > 0 && srv.Leader() == srv.MemberID() {
			_, err := srv.Compact(ctx, &pb.CompactionRequest{Revision: t, Physical: true})
			switch {
			case err == nil || errors.Is(err, mvcc.ErrCompacted):
				compacted, base = t, -1
			case ctx.Err() == nil:
				e.log.Warn("embedded etcd: compaction failed, retrying", "revision", t, "err", err)
			}
		}
		if now.Sub(lastLook) < lookEvery {
			continue
		}
		lastLook = now
		be := srv.Backend()
		size, inUse := be.Size(), be.SizeInUse()
		if defragDue(size, inUse, quota, lastDefrag, now, defragEvery) {
			e.log.Info("embedded etcd: defragmenting (the member serves nothing meanwhile)", "db_bytes", size, "in_use_bytes", inUse)
			if err := srv.Defragment(); err != nil {
				e.log.Warn("embedded etcd: defragmentation failed", "err", err)
			} else {
				e.log.Info("embedded etcd: defragmented", "took", time.Since(now).Round(time.Millisecond), "db_bytes", srv.Backend().Size())
			}
			lastDefrag = time.Now()
			size, inUse = srv.Backend().Size(), srv.Backend().SizeInUse()
		}
		if nearQuota(size, quota) && now.Sub(warned) >= time.Hour {
			warned = now
			e.log.Warn("embedded etcd: database near its quota; at the quota etcd refuses every write (alarm NOSPACE) until compacted, defragmented and disarmed: keep less history (--etcd-compaction-retention, --etcd-compaction-max-revisions, --etcd-compaction-max-history-bytes) or raise --etcd-quota-bytes",
				"db_bytes", size, "in_use_bytes", inUse, "quota_bytes", quota)
		}
		for _, a := range srv.Alarms() {
			if a.Alarm == pb.AlarmType_NOSPACE {
				e.log.Error("embedded etcd: database quota exceeded (alarm NOSPACE): etcd refuses every write; restart the controller with a larger --etcd-quota-bytes, or compact, defragment and disarm with etcdctl (docs/scale.md)",
					"db_bytes", size, "quota_bytes", quota)
			}
		}
	}
}

// configureMaintenance sets what etcd itself does about history and
// size: no compaction of its own (maintain does it), the quota, and a
// defragmentation at start when it frees defragMinFree or more.
func configureMaintenance(ec *embed.Config, quota int64) {
	ec.AutoCompactionMode = embed.CompactorModePeriodic
	ec.AutoCompactionRetention = "0"
	ec.QuotaBackendBytes = quota
	ec.BootstrapDefragThresholdMegabytes = defragMinFree >> 20
}

// The raft log a member alone keeps in memory: etcd holds every entry
// since its last snapshot plus SnapshotCatchUpEntries for slow
// followers, 10,000 + 5,000 by default, sized for Kubernetes' one write
// per entry. With the store's group commit an entry carries a group (up
// to MaxBatchOps writes; about 11 KiB on average in a 100,000-host wave,
// 160 MiB of heap for 15,000 entries). A member alone has no follower
// to catch up, so it snapshots every 2,000 entries and keeps 500:
// entries are on disk in the WAL either way; a snapshot of a member's
// raft state is small (its membership), not a copy of the database.
// Members of a cluster keep etcd's defaults: a follower more than the
// catch-up entries behind needs the whole database sent.
const (
	aloneSnapshotCount          = 2_000
	aloneSnapshotCatchUpEntries = 500
)

func configureRaftLogAlone(ec *embed.Config) {
	ec.SnapshotCount = aloneSnapshotCount
	ec.SnapshotCatchUpEntries = aloneSnapshotCatchUpEntries
}
