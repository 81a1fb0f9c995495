package api

import (
	"bytes"
	"context"
	"errors"
	"io"
	"time"

	"filippo.io/age"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/authz"
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
// of st, with the sealing key read from keyFile at each backup, and the
// pause of a move (its time from now).
func RegisterMaintenance(srv *grpc.Server, st *store.Store, keyFile string, now func() time.Time) {
	controllerv1.RegisterMaintenanceServer(srv, &maintenanceServer{store: st, keyFile: keyFile, now: now})
}

type maintenanceServer struct {
	controllerv1.UnimplementedMaintenanceServer
	store   *store.Store
	keyFile string
	now     func() time.Time
}

// Pause records the pause of a move, or marks it moved.
func (s *maintenanceServer) Pause(ctx context.Context, req *controllerv1.PauseRequest) (*controllerv1.PauseStatus, error) {
	if req.GetMovedTo() == "" {
		return nil, errgrpc.ToGRPC(errdefs.InvalidArgument("pause: moved_to (the API address of the controller the fleet moves to) is required"))
	}
	p, err := s.store.Pause(ctx, store.Pause{MovedTo: req.GetMovedTo(), By: authz.CallerFrom(ctx).Name, Since: s.now()})
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	if p.MovedTo != req.GetMovedTo() {
		return nil, errgrpc.ToGRPC(errdefs.FailedPrecondition("pause: already paused for a move to %s (by %s): resume it first (kilnctl move --resume)", p.MovedTo, p.By))
	}
	if req.GetMoved() && !p.Moved {
		if p, err = s.store.MarkMoved(ctx); err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
	}
	return pauseStatus(&p), nil
}

// Resume removes the pause.
func (s *maintenanceServer) Resume(ctx context.Context, _ *controllerv1.ResumeRequest) (*controllerv1.PauseStatus, error) {
	if err := s.store.Resume(ctx); err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &controllerv1.PauseStatus{}, nil
}

// GetPause says whether the controller is paused.
func (s *maintenanceServer) GetPause(ctx context.Context, _ *controllerv1.GetPauseRequest) (*controllerv1.PauseStatus, error) {
	p, err := s.store.Paused(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return pauseStatus(p), nil
}

func pauseStatus(p *store.Pause) *controllerv1.PauseStatus {
	if p == nil {
		return &controllerv1.PauseStatus{}
	}
	return &controllerv1.PauseStatus{Paused: true, MovedTo: p.MovedTo, By: p.By, Since: timestamppb.New(p.Since), Moved: p.Moved, From: p.From}
}

// Adopt receives another controller's backup and makes this controller
// its fleet's home (store.Adopt). The one-time identity never leaves
// this call.
func (s *maintenanceServer) Adopt(stream controllerv1.Maintenance_AdoptServer) error {
	var (
		buf      bytes.Buffer
		identity string
		from     string
	)
	for {
		ch, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if identity == "" {
			identity, from = ch.GetIdentity(), ch.GetFrom()
		}
		if buf.Len()+len(ch.GetData()) > store.MaxBackupSize+1<<20 {
			return errgrpc.ToGRPC(errdefs.InvalidArgument("adopt: backup larger than %d bytes", store.MaxBackupSize))
		}
		buf.Write(ch.GetData())
	}
	if identity == "" || from == "" {
		return errgrpc.ToGRPC(errdefs.InvalidArgument("adopt: the first chunk must carry the identity that opens the backup and the address it comes from"))
	}
	id, err := age.ParseX25519Identity(identity)
	if err != nil {
		// The identity is a secret: the parser's message is not repeated.
		return errgrpc.ToGRPC(errdefs.InvalidArgument("adopt: the identity is not an age X25519 identity (AGE-SECRET-KEY-1...)"))
	}
	key, body, err := backup.Open(&buf, []age.Identity{id})
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	fromSealer, err := seal.New(key)
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	info, err := s.store.Adopt(stream.Context(), body, fromSealer, from, s.now())
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	return stream.SendAndClose(&controllerv1.AdoptResponse{Revision: info.Revision, Keys: int32(info.Keys), Secrets: int32(info.Secrets)})
}

// Inventory counts and hashes the store's kinds.
func (s *maintenanceServer) Inventory(ctx context.Context, _ *controllerv1.InventoryRequest) (*controllerv1.InventoryResponse, error) {
	kinds, rev, err := s.store.Inventory(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	out := &controllerv1.InventoryResponse{Revision: rev}
	for _, k := range kinds {
		out.Kinds = append(out.Kinds, &controllerv1.KindInventory{Kind: k.Kind, Count: int32(k.Count), Sha256: k.SHA256})
	}
	return out, nil
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
