package lay

import (
	"context"

	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// Service adapts a Layer to the agent service's operation interfaces
// (agent/server ImageLayer and Wiper), which report through
// OperationEvents: each progress report becomes an event whose message is
// the step and whose progress is the report.
type Service struct {
	Layer *Layer
}

// LayImage lays the image; see Layer.Lay.
func (s Service) LayImage(ctx context.Context, req *agentv1.LayImageRequest, emit func(*agentv1.OperationEvent)) (*agentv1.LayImageResult, error) {
	return s.Layer.Lay(ctx, req, progressEvents(emit))
}

// Wipe wipes req.Target; see Layer.Wipe.
func (s Service) Wipe(ctx context.Context, req *agentv1.WipeRequest, emit func(*agentv1.OperationEvent)) error {
	return s.Layer.Wipe(ctx, req.GetTarget(), progressEvents(emit))
}

func progressEvents(emit func(*agentv1.OperationEvent)) func(*agentv1.Progress) {
	if emit == nil {
		return nil
	}
	return func(p *agentv1.Progress) {
		emit(&agentv1.OperationEvent{Message: p.GetStep(), Progress: p})
	}
}
