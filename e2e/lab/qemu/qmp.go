package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// QMP is a client of the QEMU Machine Protocol over a unix socket. It is
// safe for concurrent use; commands run one at a time.
type QMP struct {
	mu   sync.Mutex
	conn net.Conn
	r    *bufio.Reader
	// events are the asynchronous events seen so far (SHUTDOWN, RESET, ...).
	events []Event
}

// Event is an asynchronous QMP event.
type Event struct {
	Name string          `json:"event"`
	Data json.RawMessage `json:"data"`
}

// QMPError is an error answer of QEMU.
type QMPError struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

func (e *QMPError) Error() string { return e.Class + ": " + e.Desc }

type qmpMessage struct {
	QMP    json.RawMessage `json:"QMP"`
	Return json.RawMessage `json:"return"`
	Error  *QMPError       `json:"error"`
	Event  string          `json:"event"`
	Data   json.RawMessage `json:"data"`
}

// DialQMP connects to the QMP socket at path, retrying until it accepts
// or ctx ends, reads the greeting and leaves capabilities negotiation mode.
// Equivalent to: `socat - UNIX-CONNECT:PATH` and `{"execute":"qmp_capabilities"}`.
func DialQMP(ctx context.Context, path string) (*QMP, error) {
	var d net.Dialer
	for {
		conn, err := d.DialContext(ctx, "unix", path)
		if err == nil {
			q := &QMP{conn: conn, r: bufio.NewReaderSize(conn, 64<<10)}
			if err := q.handshake(ctx); err != nil {
				conn.Close()
				return nil, err
			}
			return q, nil
		}
		select {
		case <-ctx.Done():
			return nil, errdefs.Unavailable("qmp %s: %v", path, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (q *QMP) handshake(ctx context.Context) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.deadline(ctx)
	var greeting qmpMessage
	if err := q.read(&greeting); err != nil {
		return fmt.Errorf("qmp greeting: %w", err)
	}
	if greeting.QMP == nil {
		return fmt.Errorf("qmp: unexpected greeting")
	}
	return q.executeLocked(ctx, "qmp_capabilities", nil, nil)
}

func (q *QMP) deadline(ctx context.Context) {
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(30 * time.Second)
	}
	_ = q.conn.SetDeadline(dl)
}

func (q *QMP) read(m *qmpMessage) error {
	line, err := q.r.ReadBytes('\n')
	if err != nil {
		return err
	}
	return json.Unmarshal(line, m)
}

// Execute runs a QMP command with arguments (nil for none) and decodes its
// return value into result (nil to ignore it). Events that arrive in the
// meantime are kept (Events).
func (q *QMP) Execute(ctx context.Context, command string, arguments, result any) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.executeLocked(ctx, command, arguments, result)
}

func (q *QMP) executeLocked(ctx context.Context, command string, arguments, result any) error {
	q.deadline(ctx)
	req := map[string]any{"execute": command}
	if arguments != nil {
		req["arguments"] = arguments
	}
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	if _, err := q.conn.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("qmp %s: %w", command, err)
	}
	for {
		var m qmpMessage
		if err := q.read(&m); err != nil {
			return fmt.Errorf("qmp %s: %w", command, err)
		}
		switch {
		case m.Event != "":
			q.events = append(q.events, Event{Name: m.Event, Data: m.Data})
		case m.Error != nil:
			return fmt.Errorf("qmp %s: %w", command, m.Error)
		case m.Return != nil:
			if result != nil {
				if err := json.Unmarshal(m.Return, result); err != nil {
					return fmt.Errorf("qmp %s: decode: %w", command, err)
				}
			}
			return nil
		}
	}
}

// Events returns the asynchronous events seen so far.
func (q *QMP) Events() []Event {
	q.mu.Lock()
	defer q.mu.Unlock()
	return append([]Event(nil), q.events...)
}

// Status is the answer of query-status.
type Status struct {
	Running bool `json:"running"`
	// Status is "running", "paused", "shutdown", "prelaunch", ...
	Status string `json:"status"`
}

// QueryStatus returns the VM's run state.
func (q *QMP) QueryStatus(ctx context.Context) (Status, error) {
	var s Status
	err := q.Execute(ctx, "query-status", nil, &s)
	return s, err
}

// Close closes the connection.
func (q *QMP) Close() error { return q.conn.Close() }
