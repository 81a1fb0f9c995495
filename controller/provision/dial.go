package provision

import (
	"context"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

var _ BMC = (*bmc.BMC)(nil)

// SecretReader reads sealed secrets (*store.Store).
type SecretReader interface {
	GetSecret(ctx context.Context, path string) ([]byte, error)
}

// ManagerDialer is the production BMCDialer: the host's BMC from m, with
// the password read from the host's sealed secret (resources.BMCSecretPath).
// A changed endpoint or password gets a fresh BMC from the Manager.
func ManagerDialer(m *bmc.Manager, secrets SecretReader) BMCDialer {
	return func(ctx context.Context, h *typesv1.Host) (BMC, error) {
		name := h.GetMetadata().GetName()
		spec := h.GetSpec().GetBmc()
		if spec == nil || spec.GetProtocol() == "" || spec.GetProtocol() == "none" {
			return nil, errdefs.FailedPrecondition("host %s has no BMC", name)
		}
		ep := bmc.EndpointFromSpec(spec)
		if spec.GetPasswordSet() {
			pw, err := secrets.GetSecret(ctx, resources.BMCSecretPath(name))
			if err != nil && !errdefs.IsNotFound(err) {
				return nil, err
			}
			ep.Password = string(pw)
		}
		return m.Dial(ctx, name, ep)
	}
}
