package journal

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// collect returns a Send that appends to a slice, and the slice.
func collect() (Send, func() []*agentv1.OperationEvent) {
	var mu sync.Mutex
	var got []*agentv1.OperationEvent
	return func(ev *agentv1.OperationEvent) error {
			mu.Lock()
			defer mu.Unlock()
			got = append(got, ev)
			return nil
		}, func() []*agentv1.OperationEvent {
			mu.Lock()
			defer mu.Unlock()
			return append([]*agentv1.OperationEvent(nil), got...)
		}
}

func openJournal(t *testing.T, dir string) *Journal {
	t.Helper()
	j, err := Open(dir, nil)
	require.NoError(t, err)
	t.Cleanup(func() { j.Close() })
	return j
}

func last(evs []*agentv1.OperationEvent) *agentv1.OperationEvent {
	if len(evs) == 0 {
		return nil
	}
	return evs[len(evs)-1]
}

func TestConcurrentStartRunsOnce(t *testing.T) {
	j := openJournal(t, t.TempDir())
	var runs atomic.Int32
	release := make(chan struct{})
	fn := func(ctx context.Context, emit Emit) error {
		runs.Add(1)
		emit(&agentv1.OperationEvent{Message: "working", Progress: &agentv1.Progress{Step: "one", Percent: 50}})
		<-release
		emit(&agentv1.OperationEvent{Result: &agentv1.OperationEvent_Prepare{Prepare: &agentv1.PrepareResult{Changed: true}}})
		return nil
	}
	const callers = 8
	var wg sync.WaitGroup
	results := make([][]*agentv1.OperationEvent, callers)
	errs := make([]error, callers)
	started := make(chan struct{}, callers)
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			send, got := collect()
			errs[i] = j.Start(context.Background(), "prepare", "op-1", fn, func(ev *agentv1.OperationEvent) error {
				if ev.GetSequence() == 0 {
					started <- struct{}{}
				}
				return send(ev)
			})
			results[i] = got()
		}()
	}
	for range callers {
		<-started
	}
	close(release)
	wg.Wait()

	require.Equal(t, int32(1), runs.Load(), "fn ran %d times for one id, want 1", runs.Load())
	for i := range callers {
		require.NoError(t, errs[i])
		evs := results[i]
		require.Len(t, evs, 4, "caller %d events: %v", i, evs)
		for k, ev := range evs {
			if ev.GetSequence() != uint64(k) {
				t.Errorf("caller %d: event %d has sequence %d", i, k, ev.GetSequence())
			}
		}
		term := last(evs)
		if term.GetState() != agentv1.OperationState_OPERATION_STATE_SUCCEEDED {
			t.Errorf("caller %d: terminal state = %v, want SUCCEEDED", i, term.GetState())
		}
		if !term.GetPrepare().GetChanged() {
			t.Errorf("caller %d: terminal event has no prepare result: %v", i, term)
		}
	}
}

func TestReattachAfterCompletion(t *testing.T) {
	dir := t.TempDir()
	j := openJournal(t, dir)
	var runs atomic.Int32
	fn := func(ctx context.Context, emit Emit) error {
		runs.Add(1)
		emit(&agentv1.OperationEvent{Result: &agentv1.OperationEvent_LayImage{LayImage: &agentv1.LayImageResult{BytesWritten: 4096, Sha256: "abc"}}})
		return nil
	}
	send, _ := collect()
	require.NoError(t, j.Start(context.Background(), "lay-image", "lay-1", fn, send))

	check := func(name string, follow func(Send) error) {
		t.Helper()
		send, got := collect()
		require.NoError(t, follow(send), name)
		term := last(got())
		if term.GetState() != agentv1.OperationState_OPERATION_STATE_SUCCEEDED || term.GetLayImage().GetBytesWritten() != 4096 {
			t.Errorf("%s: terminal event = %v, want SUCCEEDED with 4096 bytes written", name, term)
		}
	}
	check("Follow", func(s Send) error { return j.Follow(context.Background(), "lay-1", s) })
	check("Start again", func(s Send) error { return j.Start(context.Background(), "lay-image", "lay-1", fn, s) })

	// A restarted agent still knows the finished operation and its result.
	j.Close()
	j2 := openJournal(t, dir)
	check("Follow after restart", func(s Send) error { return j2.Follow(context.Background(), "lay-1", s) })
	check("Start after restart", func(s Send) error { return j2.Start(context.Background(), "lay-image", "lay-1", fn, s) })
	require.Equal(t, int32(1), runs.Load(), "fn ran %d times, want 1", runs.Load())
}

func TestFailureAndPanic(t *testing.T) {
	j := openJournal(t, t.TempDir())
	tests := []struct {
		id      string
		fn      Func
		wantErr string
	}{
		{"fails", func(ctx context.Context, emit Emit) error { return errors.New("disk /dev/vdz: no such device") }, "disk /dev/vdz: no such device"},
		{"panics", func(ctx context.Context, emit Emit) error { panic("boom") }, "operation panicked: boom"},
	}
	for _, tt := range tests {
		t.Run(tt.id, func(t *testing.T) {
			send, got := collect()
			require.NoError(t, j.Start(context.Background(), "wipe", tt.id, tt.fn, send))
			term := last(got())
			if term.GetState() != agentv1.OperationState_OPERATION_STATE_FAILED || term.GetError() != tt.wantErr {
				t.Errorf("Start(%q) terminal = %v %q, want FAILED %q", tt.id, term.GetState(), term.GetError(), tt.wantErr)
			}
		})
	}
}

func TestCallerGoneOperationContinues(t *testing.T) {
	j := openJournal(t, t.TempDir())
	release := make(chan struct{})
	fn := func(ctx context.Context, emit Emit) error {
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	err := j.Start(ctx, "wipe", "w1", fn, func(ev *agentv1.OperationEvent) error {
		cancel() // the controller's stream breaks after the first event
		return nil
	})
	require.ErrorIs(t, err, context.Canceled)
	close(release)

	send, got := collect()
	require.NoError(t, j.Follow(context.Background(), "w1", send))
	if term := last(got()); term.GetState() != agentv1.OperationState_OPERATION_STATE_SUCCEEDED {
		t.Errorf("Follow(%q) terminal = %v, want SUCCEEDED", "w1", term)
	}
}

func TestErrors(t *testing.T) {
	j := openJournal(t, t.TempDir())
	nop := func(ctx context.Context, emit Emit) error { return nil }
	send, _ := collect()
	require.NoError(t, j.Start(context.Background(), "wipe", "w1", nop, send))

	tests := []struct {
		name string
		err  error
		is   func(error) bool
	}{
		{"follow unknown", j.Follow(context.Background(), "nope", send), errdefs.IsNotFound},
		{"kind mismatch", j.Start(context.Background(), "prepare", "w1", nop, send), errdefs.IsFailedPrecondition},
		{"bad id", j.Start(context.Background(), "wipe", "../etc/passwd", nop, send), errdefs.IsInvalidArgument},
	}
	for _, tt := range tests {
		if !tt.is(tt.err) {
			t.Errorf("%s: err = %v, wrong class", tt.name, tt.err)
		}
	}
}

func TestValidateID(t *testing.T) {
	tests := []struct {
		id   string
		want bool
	}{
		{"prep-1", true},
		{"a.b_c-D9", true},
		{"", false},
		{".hidden", false},
		{"a/b", false},
		{"../x", false},
		{"sp ace", false},
		{string(make([]byte, 129)), false},
	}
	for _, tt := range tests {
		if got := ValidateID(tt.id) == nil; got != tt.want {
			t.Errorf("ValidateID(%q) ok = %v, want %v", tt.id, got, tt.want)
		}
	}
}

// TestRestartMarksInterrupted kills a real agent-like process (this test
// binary re-executed) in the middle of an operation, then opens the
// journal again as a restarted agent would.
func TestRestartMarksInterrupted(t *testing.T) {
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$")
	cmd.Env = append(os.Environ(), "KILN_JOURNAL_HELPER_DIR="+dir)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err, "helper did not report its operation running")
	require.Equal(t, "running\n", line)
	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()

	j := openJournal(t, dir)
	send, got := collect()
	require.NoError(t, j.Follow(context.Background(), "prep-7", send))
	evs := got()
	term := last(evs)
	if term.GetState() != agentv1.OperationState_OPERATION_STATE_INTERRUPTED {
		t.Fatalf("Follow(%q) after restart: terminal = %v, want INTERRUPTED", "prep-7", term)
	}
	if term.GetKind() != "prepare" || term.GetError() != InterruptedMessage {
		t.Errorf("interrupted event = %v, want kind prepare and error %q", term, InterruptedMessage)
	}
	require.Len(t, evs, 3, "events: started, progress, interrupted")

	// Re-starting the same id does not run it again: the controller must
	// pick a new id to retry.
	var ran bool
	require.NoError(t, j.Start(context.Background(), "prepare", "prep-7", func(ctx context.Context, emit Emit) error { ran = true; return nil }, send))
	if ran {
		t.Errorf("Start(%q) ran an interrupted operation again", "prep-7")
	}
	// A second restart does not add another INTERRUPTED event.
	j.Close()
	j3 := openJournal(t, dir)
	send3, got3 := collect()
	require.NoError(t, j3.Follow(context.Background(), "prep-7", send3))
	require.Len(t, got3(), 3)
}

func TestHelperProcess(t *testing.T) {
	dir := os.Getenv("KILN_JOURNAL_HELPER_DIR")
	if dir == "" {
		// Deliberate, not an environment gap: it only runs as that test's child.
		t.Skip("helper process for TestRestartMarksInterrupted")
	}
	j, err := Open(dir, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	_ = j.Start(context.Background(), "prepare", "prep-7", func(ctx context.Context, emit Emit) error {
		emit(&agentv1.OperationEvent{Message: "swap off"})
		fmt.Println("running")
		select {}
	}, func(*agentv1.OperationEvent) error { return nil })
}

func TestPartialLineIsCut(t *testing.T) {
	dir := t.TempDir()
	j := openJournal(t, dir)
	send, _ := collect()
	require.NoError(t, j.Start(context.Background(), "wipe", "w1", func(ctx context.Context, emit Emit) error { return nil }, send))
	j.Close()
	// Simulate a crash of a later operation mid-write.
	path := filepath.Join(dir, "w2.jsonl")
	require.NoError(t, os.WriteFile(path, []byte(`{"operationId":"w2","kind":"wipe","state":"OPERATION_STATE_RUNNING"}`+"\n"+`{"operationId":"w2","ki`), 0o600))

	j2 := openJournal(t, dir)
	send2, got := collect()
	require.NoError(t, j2.Follow(context.Background(), "w2", send2))
	evs := got()
	require.Len(t, evs, 2)
	if term := last(evs); term.GetState() != agentv1.OperationState_OPERATION_STATE_INTERRUPTED || term.GetSequence() != 1 {
		t.Errorf("Follow(%q) terminal = %v, want INTERRUPTED with sequence 1", "w2", term)
	}
}

func BenchmarkOperation(b *testing.B) {
	j, err := Open(b.TempDir(), nil)
	require.NoError(b, err)
	defer j.Close()
	fn := func(ctx context.Context, emit Emit) error {
		for range 10 {
			emit(&agentv1.OperationEvent{Progress: &agentv1.Progress{DoneBytes: 1}})
		}
		return nil
	}
	send := func(*agentv1.OperationEvent) error { return nil }
	for i := 0; b.Loop(); i++ {
		if err := j.Start(context.Background(), "bench", fmt.Sprintf("op-%d", i), fn, send); err != nil {
			b.Fatal(err)
		}
	}
}

func TestCloseInterruptsRunning(t *testing.T) {
	dir := t.TempDir()
	j, err := Open(dir, nil)
	require.NoError(t, err)
	started := make(chan struct{})
	go j.Start(context.Background(), "lay-image", "l1", func(ctx context.Context, emit Emit) error {
		close(started)
		<-ctx.Done()
		return ctx.Err()
	}, func(*agentv1.OperationEvent) error { return nil })
	<-started
	require.NoError(t, j.Close())

	j2 := openJournal(t, dir)
	send, got := collect()
	require.NoError(t, j2.Follow(context.Background(), "l1", send))
	if term := last(got()); term.GetState() != agentv1.OperationState_OPERATION_STATE_INTERRUPTED {
		t.Errorf("Follow(%q) after Close = %v, want INTERRUPTED", "l1", term)
	}
}

func TestPrune(t *testing.T) {
	dir := t.TempDir()
	j := openJournal(t, dir)
	send, _ := collect()
	nop := func(ctx context.Context, emit Emit) error { return nil }
	require.NoError(t, j.Start(context.Background(), "wipe", "old", nop, send))
	require.NoError(t, j.Start(context.Background(), "wipe", "new", nop, send))
	past := time.Now().Add(-30 * 24 * time.Hour)
	require.NoError(t, os.Chtimes(filepath.Join(dir, "old.jsonl"), past, past))

	n, err := j.Prune(time.Now().Add(-14 * 24 * time.Hour))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	if err := j.Follow(context.Background(), "old", send); !errdefs.IsNotFound(err) {
		t.Errorf("Follow(%q) after Prune = %v, want NotFound", "old", err)
	}
	require.NoError(t, j.Follow(context.Background(), "new", send))
}
