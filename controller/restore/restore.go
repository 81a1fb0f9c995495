// Package restore makes a data directory (or an external etcd and a secret
// key file) the controller a backup was taken from (kiln-controller
// restore; docs/controller.md, "Backup and restore"). The backup's format
// is controller/backup's.
package restore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"

	"filippo.io/age"

	"github.com/kilnhq/kiln/controller/backup"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/controller/trust"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
)

// Request asks for a backup to be restored.
type Request struct {
	// From is the backup (as written by kilnctl backup).
	From io.Reader
	// Identities open it (the age identities of one of its recipients).
	Identities []age.Identity
	// Replace deletes what the store already holds first. Without it a
	// store that holds any resource or secret is refused.
	Replace bool
}

// Run makes cfg's data directory (or external etcd and secret key
// file) the controller the backup was taken from: it writes the backup's
// sealing key as the secret key file, then every resource and sealed
// secret into the store, and checks that the restored CA key opens. Start
// `kiln-controller run` on it afterwards: agents keep their certificates
// and operators their kilnconfigs (the CA is the same), and nothing is
// reprovisioned (hosts keep their status).
//
// The controller must not be running on cfg's data directory. Run
// refuses a secret key file holding another key (a data directory in use
// by another controller) with FailedPrecondition.
func Run(ctx context.Context, cfg datadir.Config, req Request, log *slog.Logger) (store.BackupInfo, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.DataDir == "" {
		return store.BackupInfo{}, errdefs.InvalidArgument("restore: data directory is required")
	}
	key, body, err := backup.Open(req.From, req.Identities)
	if err != nil {
		return store.BackupInfo{}, err
	}
	keyFile := cfg.KeyFile()
	switch have, err := seal.ReadKeyFile(keyFile); {
	case errors.Is(err, fs.ErrNotExist):
		if err := seal.WriteKeyFile(keyFile, key); err != nil {
			return store.BackupInfo{}, fmt.Errorf("restore: %w", err)
		}
	case err != nil:
		return store.BackupInfo{}, fmt.Errorf("restore: %w", err)
	case !bytes.Equal(have, key):
		return store.BackupInfo{}, errdefs.FailedPrecondition("restore: %s holds another sealing key than the backup's: restore into a new data directory (or remove the key of a controller that is gone)", keyFile)
	}
	sealer, err := seal.New(key)
	if err != nil {
		return store.BackupInfo{}, err
	}
	if len(cfg.EtcdEndpoints) == 0 {
		if cl := datadir.DialRunning(ctx, cfg.DataDir); cl != nil {
			cl.Close()
			return store.BackupInfo{}, errdefs.FailedPrecondition("restore: a controller is running on %s: stop it first (restore writes the whole store)", cfg.DataDir)
		}
	}
	client, done, err := datadir.Open(ctx, cfg, log)
	if err != nil {
		return store.BackupInfo{}, err
	}
	defer done()
	st := store.New(client, store.WithSealer(sealer), store.WithLogger(log))
	info, err := st.Restore(ctx, body, store.RestoreOptions{Replace: req.Replace})
	if err != nil {
		return store.BackupInfo{}, err
	}
	if _, err := st.GetSecret(ctx, trust.KeySecret); err != nil {
		return info, fmt.Errorf("restore: the restored CA key does not open (%w): the backup is damaged", err)
	}
	log.Info("restored", "revision", info.Revision, "keys", info.Keys, "data_dir", cfg.DataDir)
	return info, nil
}
