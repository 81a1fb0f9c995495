package filelock

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func skipWithoutFlock(t *testing.T) {
	t.Helper()
	if runtime.GOOS == "windows" || runtime.GOOS == "plan9" {
		t.Skipf("no flock(2) on %s", runtime.GOOS)
	}
}

// TestLockWaitsForTheHolder: a second locker waits for the first, its
// context ends the wait, and it gets the lock once the first releases it.
func TestLockWaitsForTheHolder(t *testing.T) {
	skipWithoutFlock(t)
	p := filepath.Join(t.TempDir(), "k.lock")
	unlock, err := Lock(context.Background(), p)
	require.NoError(t, err)
	fi, err := os.Stat(p)
	require.NoError(t, err, "Lock() creates the lock file")
	require.True(t, fi.Mode().IsRegular())

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := Lock(ctx, p); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "waiting for "+p) {
		t.Fatalf("Lock(%q) while held = %v, want the wait for it ended by ctx", p, err)
	}

	got := make(chan error, 1)
	go func() {
		u, err := Lock(context.Background(), p)
		if err == nil {
			u()
		}
		got <- err
	}()
	unlock()
	select {
	case err := <-got:
		require.NoError(t, err, "Lock(%q) after the holder released it", p)
	case <-time.After(10 * time.Second):
		t.Fatalf("Lock(%q) still waiting 10s after the holder released it", p)
	}
}

// TestLockIsPerPath: locks on two files do not wait for each other.
func TestLockIsPerPath(t *testing.T) {
	skipWithoutFlock(t)
	dir := t.TempDir()
	ua, err := Lock(context.Background(), filepath.Join(dir, "a.lock"))
	require.NoError(t, err)
	defer ua()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ub, err := Lock(ctx, filepath.Join(dir, "b.lock"))
	if err != nil {
		t.Fatalf("Lock(b.lock) while a.lock is held = %v, want nil", err)
	}
	ub()
}

func TestLockMissingDirectory(t *testing.T) {
	skipWithoutFlock(t)
	p := filepath.Join(t.TempDir(), "missing", "k.lock")
	if _, err := Lock(context.Background(), p); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Lock(%q) = %v, want os.ErrNotExist", p, err)
	}
}
