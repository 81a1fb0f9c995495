package controller_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"filippo.io/age"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/restore"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// takeBackup calls Maintenance.Backup with the kilnconfig at configPath
// and returns the file's bytes and the trailer.
func takeBackup(ctx context.Context, t *testing.T, env *controllertest.Env, configPath string, recipients ...string) ([]byte, *controllerv1.BackupChunk, error) {
	t.Helper()
	stream, err := controllerv1.NewMaintenanceClient(env.Dial(t, configPath)).Backup(ctx, &controllerv1.BackupRequest{Recipients: recipients})
	if err != nil {
		return nil, nil, err
	}
	var buf bytes.Buffer
	var last *controllerv1.BackupChunk
	for {
		ch, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return buf.Bytes(), last, nil
		}
		if err != nil {
			return nil, nil, err
		}
		buf.Write(ch.GetData())
		last = ch
	}
}

// TestBackupRestoreRehearsal is the controller's disaster recovery as an
// operator would run it: a controller with a host (its BMC password
// sealed) and an enrolled agent is backed up, stopped, and its data
// directory given up; the backup is restored into a new data directory
// and a new controller started on it. The new controller has the same CA,
// every resource with its uid, the sealed password, and accepts the old
// admin kilnconfig and the agent's certificate as they were.
func TestBackupRestoreRehearsal(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	envA := controllertest.Start(t)
	rc := resourcesClient(t, envA, "admin")
	const pw = "R3hearsal-BMC-Passw0rd"
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{host("rack1-01", pw)}})
	require.NoError(t, err)
	hostA, err := rc.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "rack1-01"})
	require.NoError(t, err)
	ag, err := enroll(ctx, t, envA, envA.Token(t, "agent-a", time.Hour), "agent-a")
	require.NoError(t, err)

	id, err := age.GenerateX25519Identity()
	require.NoError(t, err)
	idFile := filepath.Join(t.TempDir(), "backup.key")
	require.NoError(t, os.WriteFile(idFile, []byte(id.String()+"\n"), 0o600))

	// Only an admin may take a backup; a backup names its recipients.
	for _, role := range []string{"reader", "operator"} {
		_, _, err := takeBackup(ctx, t, envA, envA.ConfigFor(t, role, "bk-"+role), id.Recipient().String())
		require.Equal(t, codes.PermissionDenied, code(err), "%s's backup: %v", role, err)
		t.Logf("%s: %v", role, err)
	}
	_, _, err = takeBackup(ctx, t, envA, envA.AdminConfigPath)
	require.Equal(t, codes.InvalidArgument, code(err), "backup without a recipient: %v", err)
	require.ErrorContains(t, err, "kilnctl backup keygen")

	file, trailer, err := takeBackup(ctx, t, envA, envA.AdminConfigPath, id.Recipient().String())
	require.NoError(t, err)
	require.NotNil(t, trailer)
	require.Positive(t, trailer.GetRevision())
	require.Positive(t, trailer.GetKeys())
	t.Logf("backup: %d bytes, %d keys at revision %d", len(file), trailer.GetKeys(), trailer.GetRevision())
	// Encrypted at rest: neither the password nor the sealing key is in it.
	keyA, err := seal.ReadKeyFile(filepath.Join(envA.DataDir, "secret.key"))
	require.NoError(t, err)
	require.NotContains(t, string(file), pw)
	require.False(t, bytes.Contains(file, keyA), "the sealing key is in the backup file in the clear")
	backupFile := filepath.Join(t.TempDir(), "kiln.kbak")
	require.NoError(t, os.WriteFile(backupFile, file, 0o600))

	// The controller is lost.
	envA.Stop()
	caHashA := envA.CAHash

	restoreTo := func(dir string, ids []age.Identity, data []byte, replace bool) error {
		_, err := restore.Run(ctx, datadir.Config{DataDir: dir}, restore.Request{From: bytes.NewReader(data), Identities: ids, Replace: replace}, nil)
		return err
	}
	dirB := filepath.Join(t.TempDir(), "controller-b")

	// Another identity does not open it, and nothing is written.
	other, err := age.GenerateX25519Identity()
	require.NoError(t, err)
	err = restoreTo(dirB, []age.Identity{other}, file, false)
	require.True(t, errdefs.IsPermissionDenied(err), "restore with another identity: %v", err)
	_, statErr := os.Stat(filepath.Join(dirB, "secret.key"))
	require.True(t, os.IsNotExist(statErr), "a refused restore wrote a key file: %v", statErr)
	// A damaged file is refused.
	damaged := bytes.Clone(file)
	damaged[len(damaged)-40] ^= 0xff
	err = restoreTo(dirB, []age.Identity{id}, damaged, false)
	require.Error(t, err, "a damaged backup restored")
	t.Logf("damaged: %v", err)
	// A data directory holding another controller's key is refused.
	dirC := filepath.Join(t.TempDir(), "controller-c")
	require.NoError(t, seal.WriteKeyFile(filepath.Join(dirC, "secret.key"), bytes.Repeat([]byte{7}, seal.KeySize)))
	err = restoreTo(dirC, []age.Identity{id}, file, false)
	require.True(t, errdefs.IsFailedPrecondition(err), "restore over another key: %v", err)
	t.Logf("other key: %v", err)

	ids, err := readIdentityFile(idFile)
	require.NoError(t, err)
	start := time.Now()
	require.NoError(t, restoreTo(dirB, ids, file, false))
	// Twice is refused: the store is not empty.
	err = restoreTo(dirB, ids, file, false)
	require.True(t, errdefs.IsFailedPrecondition(err), "second restore: %v", err)

	envB := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.DataDir = dirB }))
	t.Logf("restore to serving: %s", time.Since(start).Round(time.Millisecond))
	require.Equal(t, caHashA, envB.CAHash, "the restored controller has another CA")

	// The old admin kilnconfig works against the new controller.
	rcB := controllerv1.NewResourcesClient(envB.Dial(t, envA.AdminConfigPath))
	hostB, err := rcB.Get(ctx, &controllerv1.GetRequest{Kind: "hosts", Name: "rack1-01"})
	require.NoError(t, err)
	require.Equal(t, hostA.GetHost().GetMetadata().GetUid(), hostB.GetHost().GetMetadata().GetUid())
	require.Equal(t, hostA.GetHost().GetMetadata().GetGeneration(), hostB.GetHost().GetMetadata().GetGeneration())
	got, err := envB.Store().GetSecret(ctx, "bmc/rack1-01")
	require.NoError(t, err)
	require.Equal(t, pw, string(got), "the BMC password does not open on the restored controller")

	// The agent keeps its certificate.
	_, err = controllerv1.NewAgentsClient(envB.DialCert(t, ag.certPEM, ag.keyPEM)).Heartbeat(ctx, &controllerv1.HeartbeatRequest{AgentAddress: "127.0.0.1:7444", Version: "test"})
	require.NoError(t, err, "the agent's certificate is refused by the restored controller")

	// A restore under the running controller is refused.
	err = restoreTo(dirB, ids, file, true)
	require.True(t, errdefs.IsFailedPrecondition(err), "restore under a running controller: %v", err)
	t.Logf("running: %v", err)
}

func readIdentityFile(path string) ([]age.Identity, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return age.ParseIdentities(f)
}
