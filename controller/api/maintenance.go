package api

import (
	"io"

	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/controller/backup"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/seal"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// backupChunk is the size of the chunks a backup is streamed in.
const backupChunk = 256 << 10

// RegisterMaintenance registers the admin's Maintenance service: backups
// of st, with the sealing key read from keyFile at each backup.
func RegisterMaintenance(srv *grpc.Server, st *store.Store, keyFile string) {
	controllerv1.RegisterMaintenanceServer(srv, &maintenanceServer{store: st, keyFile: keyFile})
}

type maintenanceServer struct {
	controllerv1.UnimplementedMaintenanceServer
	store   *store.Store
	keyFile string
}

// Backup encrypts on the controller: the sealing key and the secrets are
// never sent in the clear, even to an admin.
func (s *maintenanceServer) Backup(req *controllerv1.BackupRequest, stream controllerv1.Maintenance_BackupServer) error {
	recipients, err := backup.ParseRecipients(req.GetRecipients())
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	// A backup holds one key: mid-rotation some secrets are sealed under
	// another, which a restore would not open.
	if st, err := seal.ReadRotation(s.keyFile); err != nil {
		return errgrpc.ToGRPC(err)
	} else if st != seal.Idle {
		return errgrpc.ToGRPC(errdefs.FailedPrecondition("backup: a secret key rotation is under way (%s): finish it with kiln-controller rotate-secret-key, then take the backup", st))
	}
	key, err := seal.ReadKeyFile(s.keyFile)
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	cw := &chunkWriter{send: func(b []byte) error { return stream.Send(&controllerv1.BackupChunk{Data: b}) }}
	w, err := backup.NewWriter(cw, recipients, key)
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	info, err := s.store.Backup(stream.Context(), w)
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	if err := w.Close(); err != nil {
		return errgrpc.ToGRPC(err)
	}
	if err := cw.flush(); err != nil {
		return err
	}
	return stream.Send(&controllerv1.BackupChunk{Revision: info.Revision, Keys: int32(info.Keys)})
}

// chunkWriter buffers writes into chunks of backupChunk bytes.
type chunkWriter struct {
	buf  []byte
	send func([]byte) error
}

var _ io.Writer = (*chunkWriter)(nil)

func (c *chunkWriter) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		take := min(backupChunk-len(c.buf), len(p))
		c.buf = append(c.buf, p[:take]...)
		p = p[take:]
		if len(c.buf) == backupChunk {
			if err := c.flush(); err != nil {
				return 0, err
			}
		}
	}
	return n, nil
}

func (c *chunkWriter) flush() error {
	if len(c.buf) == 0 {
		return nil
	}
	err := c.send(c.buf)
	c.buf = nil
	return err
}
