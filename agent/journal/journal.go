// Package journal runs the agent's long operations (prepare, kubeadm,
// image laying, wipe) at most once per operation id and records every event
// of each on disk, so that a controller that lost its stream can re-attach
// to the operation instead of starting it twice, and so that an operation
// cut short by an agent restart is reported INTERRUPTED rather than lost.
//
// Each operation is one JSON-lines file, <dir>/<id>.jsonl, one protojson
// OperationEvent per line, appended and fsync'd event by event. The last
// line of a finished operation has a terminal state (SUCCEEDED, FAILED or
// INTERRUPTED) and, on success, the result.
package journal

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// Emit records one progress event of a running operation. The journal
// fills in the operation id, kind, sequence, time and state (always
// RUNNING); an event that carries a result sets the result reported by the
// terminal event. Emit never blocks on followers.
type Emit func(*agentv1.OperationEvent)

// Func is the body of an operation. It runs under a context that is
// cancelled only when the journal is closed, not when the caller that
// started it goes away. Its return value decides the terminal state:
// nil is SUCCEEDED, an error is FAILED with the error's text.
type Func func(ctx context.Context, emit Emit) error

// Send delivers one event to a follower, typically a gRPC stream's Send.
type Send func(*agentv1.OperationEvent) error

const fileSuffix = ".jsonl"

// InterruptedMessage is the error text of an operation that was running
// when the agent stopped.
const InterruptedMessage = "the agent restarted while the operation ran; it did not complete"

// Journal runs operations and keeps their events under one directory.
type Journal struct {
	dir      string
	log      *slog.Logger
	now      func() time.Time
	observer Observer

	ctx    context.Context // parent of every operation; cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	running map[string]*operation // operations not yet finished
	closed  bool
}

// operation is a running operation's events, shared with its followers.
type operation struct {
	id, kind string
	f        *os.File

	mu      sync.Mutex
	events  []*agentv1.OperationEvent
	result  *agentv1.OperationEvent // last event carrying a result
	done    bool
	changed chan struct{} // closed and replaced on every append
}

// Open opens the journal in dir, creating it (0700) when missing. Every
// operation the journal finds still RUNNING, left by an agent that stopped
// while it ran, gets a terminal INTERRUPTED event. Open returns an error
// when dir cannot be created or read.
//
// opts add an Observer (WithObserver).
func Open(dir string, log *slog.Logger, opts ...Option) (*Journal, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("journal: create %s: %w", dir, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	j := &Journal{
		dir:     dir,
		log:     log.With("component", "journal"),
		now:     time.Now,
		ctx:     ctx,
		cancel:  cancel,
		running: map[string]*operation{},
	}
	for _, o := range opts {
		o(j)
	}
	if err := j.recover(); err != nil {
		cancel()
		return nil, err
	}
	return j, nil
}

// recover marks the operations left running by a previous agent
// INTERRUPTED.
func (j *Journal) recover() error {
	entries, err := os.ReadDir(j.dir)
	if err != nil {
		return fmt.Errorf("journal: read %s: %w", j.dir, err)
	}
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, fileSuffix) {
			continue
		}
		id := strings.TrimSuffix(name, fileSuffix)
		if err := j.recoverOne(id); err != nil {
			return err
		}
	}
	return nil
}

func (j *Journal) recoverOne(id string) error {
	path := j.path(id)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("journal: operation %q: %w", id, err)
	}
	defer f.Close()
	events, validLen, err := readEvents(f)
	if err != nil {
		return fmt.Errorf("journal: operation %q: %w", id, err)
	}
	// A crash in the middle of a write leaves a partial last line: cut it
	// so that the next line starts clean.
	if err := f.Truncate(validLen); err != nil {
		return fmt.Errorf("journal: operation %q: truncate partial line: %w", id, err)
	}
	var last *agentv1.OperationEvent
	if len(events) > 0 {
		last = events[len(events)-1]
		if isTerminal(last.GetState()) {
			return nil
		}
	}
	ev := &agentv1.OperationEvent{
		OperationId: id,
		State:       agentv1.OperationState_OPERATION_STATE_INTERRUPTED,
		Error:       InterruptedMessage,
		Time:        timestamppb.New(j.now()),
	}
	if last != nil {
		ev.Kind = last.GetKind()
		ev.Sequence = last.GetSequence() + 1
	}
	if _, err := f.Seek(validLen, io.SeekStart); err != nil {
		return fmt.Errorf("journal: operation %q: %w", id, err)
	}
	if err := appendEvent(f, ev); err != nil {
		return fmt.Errorf("journal: operation %q: mark interrupted: %w", id, err)
	}
	j.log.Warn("operation interrupted by agent restart", "operation", id, "kind", ev.GetKind())
	return nil
}

// Close cancels the running operations' contexts and waits for them to
// return; their terminal events are recorded before Close returns. An
// operation that returns an error after Close cancelled it is recorded
// INTERRUPTED; one that completes anyway keeps its result.
func (j *Journal) Close() error {
	j.mu.Lock()
	j.closed = true
	j.mu.Unlock()
	j.cancel()
	j.wg.Wait()
	return nil
}

// Prune removes the files of finished operations last written before
// cutoff, and returns how many it removed. Running operations are kept.
// After Prune, re-attaching to a removed id is NotFound.
func (j *Journal) Prune(cutoff time.Time) (int, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	entries, err := os.ReadDir(j.dir)
	if err != nil {
		return 0, fmt.Errorf("journal: prune: %w", err)
	}
	n := 0
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), fileSuffix)
		if !ok || e.IsDir() || j.running[id] != nil {
			continue
		}
		info, err := e.Info()
		if err != nil || !info.ModTime().Before(cutoff) {
			continue
		}
		if err := os.Remove(filepath.Join(j.dir, e.Name())); err != nil {
			return n, fmt.Errorf("journal: prune: %w", err)
		}
		n++
	}
	return n, nil
}

// NewID returns a fresh random operation id.
func NewID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// ValidateID checks that id can name an operation: 1 to 128 characters
// from [A-Za-z0-9._-], not starting with a dot. It returns an
// errdefs.InvalidArgument error otherwise.
func ValidateID(id string) error {
	if id == "" || len(id) > 128 {
		return errdefs.InvalidArgument("operation id %q: must be 1 to 128 characters", id)
	}
	if id[0] == '.' {
		return errdefs.InvalidArgument("operation id %q: must not start with a dot", id)
	}
	for _, r := range id {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-'
		if !ok {
			return errdefs.InvalidArgument("operation id %q: only letters, digits, '.', '_' and '-' are allowed", id)
		}
	}
	return nil
}

// Start runs fn as operation id of the given kind, unless an operation
// with that id exists already (running or finished, in this agent's life
// or a previous one): then it re-attaches to it without running fn. Either
// way it then follows the operation like Follow, sending every event so far
// and every new one to send, and returns nil after the terminal event.
//
// Start blocks until the operation ends, ctx is done (the operation keeps
// running) or send fails. Errors: InvalidArgument for a bad id,
// FailedPrecondition when id names an operation of another kind,
// Unavailable when the journal is closed, and I/O errors.
func (j *Journal) Start(ctx context.Context, kind, id string, fn Func, send Send) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	op, err := j.startOrAttach(kind, id, fn)
	if err != nil {
		return err
	}
	if op != nil {
		return op.follow(ctx, send)
	}
	return j.followFile(ctx, id, kind, send)
}

// Follow re-attaches to operation id: it sends the events so far and
// follows the operation until its terminal event, which is sent last.
// Follow blocks until then, until ctx is done or until send fails.
// Errors: InvalidArgument for a bad id, NotFound for an unknown id, I/O
// errors.
func (j *Journal) Follow(ctx context.Context, id string, send Send) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	j.mu.Lock()
	op := j.running[id]
	j.mu.Unlock()
	if op != nil {
		return op.follow(ctx, send)
	}
	return j.followFile(ctx, id, "", send)
}

// startOrAttach returns the running operation id, starting it when it is
// unknown; it returns nil when the operation is finished (its file is
// complete).
func (j *Journal) startOrAttach(kind, id string, fn Func) (*operation, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if op := j.running[id]; op != nil {
		if op.kind != kind {
			return nil, errdefs.FailedPrecondition("operation %q is a %s operation, not %s", id, op.kind, kind)
		}
		return op, nil
	}
	// Finished operations live only on disk. The runner writes the
	// terminal event before it leaves the running map (under j.mu), so a
	// file without a running entry is complete.
	if _, err := os.Stat(j.path(id)); err == nil {
		return nil, nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("journal: operation %q: %w", id, err)
	}
	if j.closed {
		return nil, errdefs.Unavailable("journal: closed, not starting operation %q", id)
	}
	f, err := os.OpenFile(j.path(id), os.O_WRONLY|os.O_CREATE|os.O_EXCL|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("journal: create operation %q: %w", id, err)
	}
	op := &operation{id: id, kind: kind, f: f, changed: make(chan struct{})}
	// The first event makes the operation visible on disk as RUNNING, so
	// that a crash from here on is reported INTERRUPTED.
	if err := op.append(&agentv1.OperationEvent{Message: "started"}, j.now()); err != nil {
		f.Close()
		os.Remove(j.path(id))
		return nil, fmt.Errorf("journal: operation %q: %w", id, err)
	}
	syncDir(j.dir)
	j.running[id] = op
	j.wg.Add(1)
	go j.run(op, fn)
	j.log.Info("operation started", "operation", id, "kind", kind)
	return op, nil
}

// Observer is told of every operation that ends (metrics): its kind,
// outcome ("success", "failure" or "interrupted") and duration. It must
// not block.
type Observer interface {
	ObserveOperation(kind, outcome string, d time.Duration)
}

// Option configures Open.
type Option func(*Journal)

// WithObserver reports every ended operation to o.
func WithObserver(o Observer) Option { return func(j *Journal) { j.observer = o } }

// run executes fn and records its terminal event.
func (j *Journal) run(op *operation, fn Func) {
	defer j.wg.Done()
	start := j.now()
	err := func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("operation panicked: %v", r)
			}
		}()
		return fn(j.ctx, func(ev *agentv1.OperationEvent) {
			if ev == nil {
				return
			}
			ev = proto.Clone(ev).(*agentv1.OperationEvent)
			ev.State = agentv1.OperationState_OPERATION_STATE_RUNNING
			ev.Error = ""
			if aerr := op.append(ev, j.now()); aerr != nil {
				j.log.Error("journal write failed", "operation", op.id, "error", aerr)
			}
		})
	}()
	final := &agentv1.OperationEvent{State: agentv1.OperationState_OPERATION_STATE_SUCCEEDED, Message: "succeeded"}
	switch {
	case err != nil && j.ctx.Err() != nil:
		// The agent is stopping and cut the operation short.
		final = &agentv1.OperationEvent{State: agentv1.OperationState_OPERATION_STATE_INTERRUPTED, Message: "interrupted", Error: "the agent stopped while the operation ran: " + err.Error()}
	case err != nil:
		final = &agentv1.OperationEvent{State: agentv1.OperationState_OPERATION_STATE_FAILED, Message: "failed", Error: err.Error()}
	default:
		op.mu.Lock()
		if op.result != nil {
			copyResult(final, op.result)
		}
		op.mu.Unlock()
	}
	if aerr := op.append(final, j.now()); aerr != nil {
		j.log.Error("journal write of terminal event failed", "operation", op.id, "error", aerr)
	}
	j.mu.Lock()
	delete(j.running, op.id)
	j.mu.Unlock()
	op.f.Close()
	if j.observer != nil {
		outcome := "success"
		switch final.GetState() {
		case agentv1.OperationState_OPERATION_STATE_INTERRUPTED:
			outcome = "interrupted"
		case agentv1.OperationState_OPERATION_STATE_FAILED:
			outcome = "failure"
		}
		j.observer.ObserveOperation(op.kind, outcome, j.now().Sub(start))
	}
	if err != nil {
		j.log.Warn("operation failed", "operation", op.id, "kind", op.kind, "error", err)
	} else {
		j.log.Info("operation succeeded", "operation", op.id, "kind", op.kind)
	}
}

// append numbers, stamps, writes (fsync'd) and publishes ev. A write error
// is returned, but the event is still published to followers: the
// operation goes on even when the disk is full.
func (op *operation) append(ev *agentv1.OperationEvent, now time.Time) error {
	op.mu.Lock()
	defer op.mu.Unlock()
	if op.done {
		return nil
	}
	ev.OperationId = op.id
	ev.Kind = op.kind
	ev.Sequence = uint64(len(op.events))
	if ev.Time == nil {
		ev.Time = timestamppb.New(now)
	}
	if ev.State == agentv1.OperationState_OPERATION_STATE_UNSPECIFIED {
		ev.State = agentv1.OperationState_OPERATION_STATE_RUNNING
	}
	if ev.GetResult() != nil && ev.State == agentv1.OperationState_OPERATION_STATE_RUNNING {
		op.result = ev
	}
	err := appendEvent(op.f, ev)
	op.events = append(op.events, ev)
	op.done = isTerminal(ev.State)
	close(op.changed)
	op.changed = make(chan struct{})
	return err
}

// follow sends op's events from the first on until the terminal one.
func (op *operation) follow(ctx context.Context, send Send) error {
	next := 0
	for {
		op.mu.Lock()
		pending := op.events[next:]
		done := op.done
		changed := op.changed
		op.mu.Unlock()
		for _, ev := range pending {
			if err := send(ev); err != nil {
				return err
			}
			next++
		}
		if done {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// followFile sends the events of a finished operation from its file.
func (j *Journal) followFile(ctx context.Context, id, kind string, send Send) error {
	f, err := os.Open(j.path(id))
	if errors.Is(err, fs.ErrNotExist) {
		return errdefs.NotFound("operation %q not found", id)
	}
	if err != nil {
		return fmt.Errorf("journal: operation %q: %w", id, err)
	}
	defer f.Close()
	events, _, err := readEvents(f)
	if err != nil {
		return fmt.Errorf("journal: operation %q: %w", id, err)
	}
	if kind != "" && len(events) > 0 && events[0].GetKind() != "" && events[0].GetKind() != kind {
		return errdefs.FailedPrecondition("operation %q is a %s operation, not %s", id, events[0].GetKind(), kind)
	}
	for _, ev := range events {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := send(ev); err != nil {
			return err
		}
	}
	return nil
}

func (j *Journal) path(id string) string { return filepath.Join(j.dir, id+fileSuffix) }

// appendEvent writes ev as one line and fsyncs the file.
func appendEvent(f *os.File, ev *agentv1.OperationEvent) error {
	b, err := protojson.Marshal(ev)
	if err != nil {
		return fmt.Errorf("encode event: %w", err)
	}
	b = append(b, '\n')
	if _, err := f.Write(b); err != nil {
		return fmt.Errorf("write event: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("fsync: %w", err)
	}
	return nil
}

// readEvents decodes the complete lines of r. It returns the events and
// the length of the prefix holding complete, valid lines; a partial or
// undecodable tail (a crash mid-write) is left out.
func readEvents(r io.Reader) ([]*agentv1.OperationEvent, int64, error) {
	br := bufio.NewReader(r)
	var events []*agentv1.OperationEvent
	var valid int64
	for {
		line, err := br.ReadBytes('\n')
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, 0, err
		}
		if len(line) == 0 || line[len(line)-1] != '\n' {
			return events, valid, nil // EOF, possibly after a partial line
		}
		ev := &agentv1.OperationEvent{}
		if uerr := protojson.Unmarshal(bytes.TrimSpace(line), ev); uerr != nil {
			return events, valid, nil
		}
		events = append(events, ev)
		valid += int64(len(line))
	}
}

func isTerminal(s agentv1.OperationState) bool {
	switch s {
	case agentv1.OperationState_OPERATION_STATE_SUCCEEDED,
		agentv1.OperationState_OPERATION_STATE_FAILED,
		agentv1.OperationState_OPERATION_STATE_INTERRUPTED:
		return true
	}
	return false
}

// copyResult copies the result oneof of src into dst.
func copyResult(dst, src *agentv1.OperationEvent) {
	switch r := src.GetResult().(type) {
	case *agentv1.OperationEvent_Prepare:
		dst.Result = &agentv1.OperationEvent_Prepare{Prepare: r.Prepare}
	case *agentv1.OperationEvent_KubeadmInit:
		dst.Result = &agentv1.OperationEvent_KubeadmInit{KubeadmInit: r.KubeadmInit}
	case *agentv1.OperationEvent_LayImage:
		dst.Result = &agentv1.OperationEvent_LayImage{LayImage: r.LayImage}
	}
}

// syncDir fsyncs a directory so that a new file's entry survives a crash.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
}
