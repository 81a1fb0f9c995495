package provision

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kilnhq/kiln/controller/hostlife"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// chattyBMC fails power on with the kind of error bmclib returns from a
// BMC that answers 500 with a page of HTML: the response body, verbatim.
type chattyBMC struct {
	BMC
	body string
}

func (b *chattyBMC) PowerOn(context.Context) error {
	return errors.New("power on: 500 Internal Server Error: " + b.body)
}

func (b *chattyBMC) Condition() *typesv1.Condition {
	return &typesv1.Condition{Type: "BMCReachable", Status: "False", Message: "GET /redfish/v1: " + b.body}
}

// TestBMCErrorBodiesAreSanitised is issue 12, hole 3: a BMC's error
// response body went verbatim into status.lastError, the BMCReachable
// condition and events, which every reader sees. What the executor hands
// the planner is one line, without control characters, at most
// maxMessage bytes with a note when cut.
func TestBMCErrorBodiesAreSanitised(t *testing.T) {
	body := "<html>\r\n<body>\x1b[31mstack trace\x1b[0m\n" + strings.Repeat("session=deadbeef; internal path /var/bmc/secret\n", 2000) + "</body></html>"
	b := &chattyBMC{body: body}
	e := New(Deps{BMCs: func(context.Context, *typesv1.Host) (BMC, error) { return b, nil }}, Config{}, nil)
	h := &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: "chatty"}}
	r := e.act(context.Background(), h, []hostlife.Action{{Kind: hostlife.ActPowerOn}}, 0)
	c := e.bmcCondition("chatty")
	for what, msg := range map[string]string{"Result.Err": r.Err, "BMCReachable message": c.GetMessage()} {
		t.Logf("%s (%d bytes): %.160s...", what, len(msg), msg)
		if len(msg) > maxMessage+len(" ...(truncated)") {
			t.Errorf("%s is %d bytes, want at most %d", what, len(msg), maxMessage)
		}
		if strings.ContainsAny(msg, "\r\n\x1b") {
			t.Errorf("%s holds line breaks or escapes: %q", what, msg[:min(len(msg), 120)])
		}
		if !strings.HasSuffix(msg, "(truncated)") {
			t.Errorf("%s does not say it was cut: ...%q", what, msg[max(0, len(msg)-40):])
		}
	}
	if got := sanitizeMessage("power on: refused"); got != "power on: refused" {
		t.Errorf("sanitizeMessage(short) = %q, want it unchanged", got)
	}
}
