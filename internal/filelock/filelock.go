// Package filelock serialises processes on an exclusive advisory lock on
// a file (flock(2)): builders and fetchers that share a cache directory
// (two kiln-imagebuilder runs, parallel test binaries) take one before
// they fill an entry. The wait ends with the caller's context.
package filelock

import (
	"context"
	"time"
)

// pollInterval is how often Lock retries a held lock. flock(2) has no
// wait that a context can end, so Lock polls with LOCK_NB.
const pollInterval = 200 * time.Millisecond

// Lock takes an exclusive lock on path, creating the file (mode 0644)
// when it is missing, and returns the function that releases it. It
// blocks until the lock is free or ctx is done; then the error wraps
// ctx.Err() and says which lock it waited for. The lock is held by the
// open file: it ends with unlock, or with the process.
//
// Equivalent to: `flock --exclusive PATH`.
//
// Where flock(2) is missing the error is errdefs.NotSupported.
func Lock(ctx context.Context, path string) (unlock func(), err error) {
	return lock(ctx, path)
}
