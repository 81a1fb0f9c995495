package cli

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// defaultEventLimit is how many of the newest events get events prints.
const defaultEventLimit = 50

func isEventsKind(k string) bool {
	switch strings.ToLower(k) {
	case "events", "event", "ev":
		return true
	}
	return false
}

// getEvents prints the newest events, of everything or of what of names
// (KIND or KIND/NAME), oldest first as a journal reads.
func (a *app) getEvents(ctx context.Context, out io.Writer, of []string, output string, limit int64) error {
	if output != "" && output != "json" && output != "wide" {
		return errdefs.InvalidArgument("output format %q: get events prints a table (or wide) or json", output)
	}
	if limit <= 0 {
		return errdefs.InvalidArgument("--limit %d: give how many of the newest events to show (1 or more)", limit)
	}
	req := &controllerv1.ListEventsRequest{Limit: limit}
	if len(of) > 0 {
		if len(of) > 1 {
			return errdefs.InvalidArgument("get events %s: name one object as KIND/NAME (host/%s), or a kind", strings.Join(of, " "), of[1])
		}
		kind, name, _ := strings.Cut(of[0], "/")
		k, err := lookupKind(kind)
		if err != nil {
			return err
		}
		req.ObjectKind, req.ObjectName = k.Name, name
	}
	c, err := a.client(ctx)
	if err != nil {
		return err
	}
	cctx, cancel := a.call(ctx)
	defer cancel()
	resp, err := c.ListEvents(cctx, req)
	if err != nil {
		return a.rpcError("get events", err)
	}
	if output == "json" {
		b, err := protojson.MarshalOptions{Multiline: true}.Marshal(resp)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(out, string(b))
		return err
	}
	return writeEventList(out, resp.GetEvents(), a.opts.Now())
}

// writeEventList writes events as a table: LAST SEEN TYPE REASON OBJECT
// COUNT MESSAGE (the message says how many earlier events of the object
// the controller's rate limit dropped).
func writeEventList(out io.Writer, events []*typesv1.Event, now time.Time) error {
	if len(events) == 0 {
		_, err := fmt.Fprintln(out, "No events.")
		return err
	}
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "LAST SEEN\tTYPE\tREASON\tOBJECT\tCOUNT\tMESSAGE")
	for _, e := range events {
		last := e.GetLastTime()
		if last == nil {
			last = e.GetTime()
		}
		msg := clean(e.GetMessage())
		if d := e.GetDropped(); d > 0 {
			msg += fmt.Sprintf(" (%d earlier events of this object dropped by the rate limit)", d)
		}
		obj := clean(singular(e.GetObjectKind()) + "/" + e.GetObjectName())
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%s\n", age(last, now), dash(e.GetType()), dash(clean(e.GetReason())), obj, max(e.GetCount(), 1), msg)
	}
	return w.Flush()
}

// singular is the lower-case singular of an event's object kind (events
// name their objects by the store's plural: "hosts").
func singular(plural string) string {
	if k, err := lookupKind(plural); err == nil {
		return k.lower()
	}
	return plural
}
