package store

import (
	"context"
	"errors"
)

// DBStatus is the size of an etcd member's database.
type DBStatus struct {
	// Endpoint is the client URL of the member that answered.
	Endpoint string
	// Size is the database file, free pages included: what etcd's quota
	// counts.
	Size int64
	// InUse is the part of Size holding data; the rest was freed by
	// compactions and is reused by later writes (a defragmentation gives
	// it back to the file system).
	InUse int64
	// Quota is the size past which the member refuses writes (alarm
	// NOSPACE).
	Quota int64
}

// DBStatus asks every member the client connects to for its database
// size and returns the largest (the first to reach its quota stops every
// write). It fails only when no member answers; it blocks until they do
// or ctx ends.
func (s *Store) DBStatus(ctx context.Context) (DBStatus, error) {
	var best DBStatus
	var errs []error
	for _, ep := range s.client.Endpoints() {
		resp, err := s.client.Status(ctx, ep)
		if err != nil {
			errs = append(errs, etcdErr(ctx, "status of "+ep, err))
			continue
		}
		if resp.DbSize >= best.Size {
			best = DBStatus{Endpoint: ep, Size: resp.DbSize, InUse: resp.DbSizeInUse, Quota: resp.DbSizeQuota}
		}
	}
	if best.Endpoint == "" {
		return DBStatus{}, errors.Join(errs...)
	}
	return best, nil
}
