package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	agelib "filippo.io/age"
	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func (a *app) moveCommand() *cobra.Command {
	var (
		target string
		resume bool
		status bool
	)
	cmd := &cobra.Command{
		Use:   "move --to-kilnconfig FILE",
		Short: "Move the whole fleet to another (fresh) controller",
		Long: `Move the whole fleet, every resource and secret (the CA, the clusters' CAs
and kubeconfigs, bootstrap tokens, BMC passwords), from this controller
(the source: --kilnconfig) to a fresh controller (the target:
--to-kilnconfig, an admin kilnconfig of the target), in six steps printed
as they happen:

  1. check that the target holds no resource (a move needs a fresh
     controller: a new data directory);
  2. pause the source: from then on it refuses every write (the API's and
     its reconcilers') with an error that says where the fleet moved, and
     its reconcilers stop; the pause is in its store (it survives
     restarts);
  3. copy: a backup of the source at one etcd revision, encrypted to a
     one-time age key made here (it never touches a disk);
  4. the target adopts it: it pauses itself, takes the source's CA and
     secrets (sealed again under its own key) and every resource;
  5. verify: the number of objects of each kind and a hash of them (of
     the secrets' names only) must match on both;
  6. resume the target, and mark the source moved.

The target then serves with the source's CA: agents keep their
certificates and operators their kilnconfigs (point their server at the
target). Agents reach the target at the address they enrolled with: move
that address (DNS name or VIP) to the target, or run the target there.
The source stays paused; describe it with kilnctl move --status. If a
move fails before step 6, run it again (each step is safe to repeat), or
give it up with kilnctl move --resume on the source. Only an admin may
move, pause or resume.`,
		Example: `  kilnctl --kilnconfig old-admin.yaml move --to-kilnconfig new-admin.yaml
  kilnctl --kilnconfig old-admin.yaml move --status
  kilnctl --kilnconfig old-admin.yaml move --resume     # give up a failed move`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			out := cmd.OutOrStdout()
			if _, err := a.client(ctx); err != nil {
				return err
			}
			src := controllerv1.NewMaintenanceClient(a.conn)
			switch {
			case status:
				st, err := src.GetPause(ctx, &controllerv1.GetPauseRequest{})
				if err != nil {
					return a.rpcError("move --status", err)
				}
				fmt.Fprintln(out, pauseLine(st))
				return nil
			case resume:
				if _, err := src.Resume(ctx, &controllerv1.ResumeRequest{}); err != nil {
					return a.rpcError("move --resume", err)
				}
				fmt.Fprintf(out, "resumed %s: it accepts writes and reconciles again\n", a.cfg.Server)
				return nil
			case target == "":
				return errdefs.InvalidArgument("move: --to-kilnconfig FILE (an admin kilnconfig of the target controller) is required")
			}
			return a.move(ctx, out, src, target)
		},
	}
	cmd.Flags().StringVar(&target, "to-kilnconfig", "", "admin kilnconfig of the target controller (a fresh one)")
	cmd.Flags().BoolVar(&resume, "resume", false, "resume this controller (give up a move that failed): writes and reconcilers start again")
	cmd.Flags().BoolVar(&status, "status", false, "say whether this controller is paused for a move, and to where")
	return cmd
}

func pauseLine(st *controllerv1.PauseStatus) string {
	switch {
	case !st.GetPaused():
		return "not paused"
	case st.GetFrom() != "":
		return fmt.Sprintf("paused: adopting the fleet of %s since %s", st.GetFrom(), st.GetSince().AsTime().UTC().Format(time.RFC3339))
	case st.GetMoved():
		return fmt.Sprintf("paused: MOVED to %s (by %s at %s): writes are refused; use the controller there", st.GetMovedTo(), st.GetBy(), st.GetSince().AsTime().UTC().Format(time.RFC3339))
	}
	return fmt.Sprintf("paused: moving to %s (by %s at %s), not finished: run kilnctl move again, or kilnctl move --resume to give it up", st.GetMovedTo(), st.GetBy(), st.GetSince().AsTime().UTC().Format(time.RFC3339))
}

func (a *app) move(ctx context.Context, out io.Writer, src controllerv1.MaintenanceClient, targetFile string) error {
	start := time.Now()
	step := func(format string, args ...any) {
		fmt.Fprintf(out, "move: [%5.1fs] %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, args...))
	}
	tcfg, err := kilnconfig.Load(targetFile)
	if err != nil {
		return fmt.Errorf("move: target kilnconfig: %w", err)
	}
	if tcfg.Server == a.cfg.Server {
		return errdefs.InvalidArgument("move: the target (%s) is the source: --to-kilnconfig names another controller", tcfg.Server)
	}
	tconn, err := kilnconfig.Dial(ctx, tcfg)
	if err != nil {
		return fmt.Errorf("move: target %s: %w", tcfg.Server, err)
	}
	defer tconn.Close()
	dst := controllerv1.NewMaintenanceClient(tconn)
	from, to := a.cfg.Server, tcfg.Server
	// Only an admin of the source may move it: asked first, so that no
	// one else learns anything of the target either.
	if _, err := src.GetPause(ctx, &controllerv1.GetPauseRequest{}); err != nil {
		return a.rpcError("move: source "+from, err)
	}
	step("from %s to %s", from, to)

	// 1. The target must be fresh (or adopting from this source: a move
	// run again).
	tst, err := dst.GetPause(ctx, &controllerv1.GetPauseRequest{})
	if err != nil {
		return a.rpcError("move: target "+to, err)
	}
	inv, err := dst.Inventory(ctx, &controllerv1.InventoryRequest{})
	if err != nil {
		return a.rpcError("move: target "+to, err)
	}
	if n := resourceCount(inv); n > 0 && tst.GetFrom() != from {
		return errdefs.FailedPrecondition("move: the target %s holds %d resources: a move needs a fresh controller (start kiln-controller run on a new data directory); nothing was changed", to, n)
	}
	step("target %s is fresh", to)

	// 2. Pause the source.
	pst, err := src.Pause(ctx, &controllerv1.PauseRequest{MovedTo: to})
	if err != nil {
		return a.rpcError("move: pause the source", err)
	}
	step("source %s paused (since %s): it refuses writes, its reconcilers stop", from, pst.GetSince().AsTime().UTC().Format(time.TimeOnly))
	failed := func(err error) error {
		return fmt.Errorf("%w\nthe source %s stays paused: run the move again, or give it up with kilnctl move --resume", err, from)
	}

	// 3. and 4. The copy, streamed from the source into the target.
	id, err := agelib.GenerateX25519Identity()
	if err != nil {
		return failed(err)
	}
	bs, err := src.Backup(ctx, &controllerv1.BackupRequest{Recipients: []string{id.Recipient().String()}})
	if err != nil {
		return failed(a.rpcError("move: copy", err))
	}
	as, err := dst.Adopt(ctx)
	if err != nil {
		return failed(a.rpcError("move: target "+to, err))
	}
	first := true
	var size int64
	var last *controllerv1.BackupChunk
	for {
		ch, err := bs.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return failed(a.rpcError("move: copy", err))
		}
		last = ch
		if len(ch.GetData()) == 0 {
			continue
		}
		msg := &controllerv1.AdoptChunk{Data: ch.GetData()}
		if first {
			msg.Identity, msg.From, first = id.String(), from, false
		}
		if err := as.Send(msg); err != nil {
			if _, rerr := as.CloseAndRecv(); rerr != nil {
				err = rerr
			}
			return failed(a.rpcError("move: target "+to, err))
		}
		size += int64(len(ch.GetData()))
	}
	if last == nil || last.GetRevision() == 0 {
		return failed(errdefs.Unavailable("move: the source ended the copy before its end"))
	}
	step("copy of %s taken at etcd revision %d: %d keys, %d bytes (encrypted to a one-time key)", from, last.GetRevision(), last.GetKeys(), size)
	ar, err := as.CloseAndRecv()
	if err != nil {
		return failed(a.rpcError("move: target "+to+" adopts the copy", err))
	}
	step("target %s adopted it: %d keys, %d secrets sealed again under its own key", to, ar.GetKeys(), ar.GetSecrets())

	// The target serves with the source's CA now: verify and resume it
	// through a connection made with the source's credentials, as every
	// operator and agent will reach it.
	adopted, err := a.dialAdopted(ctx, to)
	if err != nil {
		return failed(err)
	}
	defer adopted.Close()
	dst = controllerv1.NewMaintenanceClient(adopted)
	step("target %s serves with the source's CA: the source's kilnconfig works against it", to)

	// 5. Verify.
	sinv, err := src.Inventory(ctx, &controllerv1.InventoryRequest{})
	if err != nil {
		return failed(a.rpcError("move: verify on the source", err))
	}
	tinv, err := dst.Inventory(ctx, &controllerv1.InventoryRequest{})
	if err != nil {
		return failed(a.rpcError("move: verify on the target", err))
	}
	summary, err := compareInventories(sinv, tinv)
	if err != nil {
		return failed(err)
	}
	step("verified (count and sha256 of each kind on both): %s", summary)

	// 6. Resume the target, mark the source moved.
	if _, err := dst.Resume(ctx, &controllerv1.ResumeRequest{}); err != nil {
		return failed(a.rpcError("move: resume the target", err))
	}
	step("target %s resumed: it reconciles the fleet now", to)
	if _, err := src.Pause(ctx, &controllerv1.PauseRequest{MovedTo: to, Moved: true}); err != nil {
		return a.rpcError("move: mark the source moved (the fleet is on the target already)", err)
	}
	step("source %s marked moved to %s: it stays paused and refuses writes (kilnctl move --status)", from, to)
	fmt.Fprintf(out, "done: the target serves with the source's CA: kilnconfigs of the source work against it with server: %s\n", to)
	return nil
}

// dialAdopted connects to the target at addr with the source's
// kilnconfig, waiting up to 30 s for the target to take up the source's
// CA after adopting it.
func (a *app) dialAdopted(ctx context.Context, addr string) (*grpc.ClientConn, error) {
	cfg := *a.cfg
	cfg.Server = addr
	deadline := time.Now().Add(30 * time.Second)
	for {
		conn, err := kilnconfig.Dial(ctx, &cfg)
		if err == nil {
			if _, err = controllerv1.NewMaintenanceClient(conn).GetPause(ctx, &controllerv1.GetPauseRequest{}); err == nil {
				return conn, nil
			}
			conn.Close()
		}
		if time.Now().After(deadline) {
			return nil, a.rpcError(fmt.Sprintf("move: the target %s does not serve with the source's CA 30s after adopting its fleet", addr), err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func resourceCount(inv *controllerv1.InventoryResponse) int {
	n := 0
	for _, k := range inv.GetKinds() {
		// The controller's own CA and secrets are no fleet.
		if k.GetKind() != "secrets" && k.GetKind() != "pki" {
			n += int(k.GetCount())
		}
	}
	return n
}

// compareInventories checks that both sides hold the same kinds with the
// same counts and hashes, and summarises them ("hosts 4, secrets 9").
func compareInventories(src, dst *controllerv1.InventoryResponse) (string, error) {
	have := map[string]*controllerv1.KindInventory{}
	for _, k := range dst.GetKinds() {
		have[k.GetKind()] = k
	}
	var parts, bad []string
	for _, k := range src.GetKinds() {
		d := have[k.GetKind()]
		delete(have, k.GetKind())
		switch {
		case d == nil:
			bad = append(bad, fmt.Sprintf("%s: %d on the source, none on the target", k.GetKind(), k.GetCount()))
		case d.GetCount() != k.GetCount() || d.GetSha256() != k.GetSha256():
			bad = append(bad, fmt.Sprintf("%s: %d (sha256 %.12s) on the source, %d (sha256 %.12s) on the target", k.GetKind(), k.GetCount(), k.GetSha256(), d.GetCount(), d.GetSha256()))
		default:
			parts = append(parts, fmt.Sprintf("%s %d", k.GetKind(), k.GetCount()))
		}
	}
	for kind, d := range have {
		bad = append(bad, fmt.Sprintf("%s: none on the source, %d on the target", kind, d.GetCount()))
	}
	if len(bad) > 0 {
		return "", errdefs.FailedPrecondition("move: the copy on the target differs: %s", strings.Join(bad, "; "))
	}
	return strings.Join(parts, ", "), nil
}
