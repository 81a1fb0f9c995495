package dashboard

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestConditionClass(t *testing.T) {
	for _, tc := range []struct{ status, severity, want string }{
		{"True", "", "ok"},
		{"False", "Error", "bad"},
		{"False", "", "bad"},
		// BootstrapOperation False/Succeeded: the operation ended well.
		{"False", "Info", "none"},
		{"Unknown", "", "busy"},
	} {
		if got := conditionClass(tc.status, tc.severity); got != tc.want {
			t.Errorf("conditionClass(%q, %q) = %q, want %q", tc.status, tc.severity, got, tc.want)
		}
	}
}

// TestEventsTable renders the events of a host page: an aggregated event
// shows its count, its last time as its age, and the drops before it;
// an event stored before aggregation (no count, no last time) shows 1 and
// its time.
func TestEventsTable(t *testing.T) {
	tpl, err := parseTemplates()
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	v := hostView{Events: []*typesv1.Event{
		{Time: timestamppb.New(now.Add(-20 * time.Second)), Type: "Normal", Reason: "Enrolled", Message: "agent enrolled"},
		{Time: timestamppb.New(now.Add(-10 * time.Minute)), LastTime: timestamppb.New(now.Add(-2 * time.Minute)), Count: 4, Dropped: 2,
			Type: "Warning", Reason: "StepTimedOut", Message: "PowerOn: no result within 3m"},
	}}
	var b strings.Builder
	if err := tpl.ExecuteTemplate(&b, "events", frame{V: v, Now: now}); err != nil {
		t.Fatal(err)
	}
	got := b.String()
	for _, want := range []string{
		"<th>Last seen</th><th>Type</th><th>Reason</th><th>Count</th><th>Message</th>",
		`<td title="2026-12-06T11:59:40Z">20s</td><td>Normal</td><td>Enrolled</td><td>1</td><td class="msg">agent enrolled</td>`,
		`<td title="2026-12-06T11:58:00Z">2m</td><td>Warning</td><td>StepTimedOut</td><td title="first 2026-12-06T11:50:00Z">4</td>` +
			`<td class="msg">PowerOn: no result within 3m (2 earlier events dropped by the rate limit)</td>`,
	} {
		if !strings.Contains(got, want) {
			t.Errorf("events table =\n%s\nwant it to contain\n%s", got, want)
		}
	}
}
