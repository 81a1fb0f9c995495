package lay

import (
	"context"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

func TestServiceEmitsProgressEvents(t *testing.T) {
	img := makeImage(1<<20, 30)
	srv := newImageServer(t, img, nil)
	svc := Service{Layer: testLayer(t)}
	dst := tempTarget(t)

	var events []*agentv1.OperationEvent
	emit := func(e *agentv1.OperationEvent) { events = append(events, e) }
	res, err := svc.LayImage(context.Background(), &agentv1.LayImageRequest{Url: srv.url(), Sha256: hexsum(img), Target: dst}, emit)
	require.NoError(t, err)
	if res.GetSha256() != hexsum(img) {
		t.Errorf("LayImage() sha256 = %s, want %s", res.GetSha256(), hexsum(img))
	}
	require.NotEmpty(t, events)
	last := events[len(events)-1]
	if last.GetMessage() != StepDone || last.GetProgress().GetStep() != StepDone {
		t.Errorf("last LayImage event = %v, want step %q", last, StepDone)
	}

	events = nil
	require.NoError(t, svc.Wipe(context.Background(), &agentv1.WipeRequest{Target: dst}, emit))
	b, err := os.ReadFile(dst)
	require.NoError(t, err)
	require.Equal(t, make([]byte, len(b)), b, "target after Wipe")
	if len(events) == 0 || events[len(events)-1].GetMessage() != StepDone {
		t.Errorf("Wipe events = %v, want a last event with step %q", events, StepDone)
	}
}
