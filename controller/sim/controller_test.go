package sim_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/sim"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestControllerSimulate runs the controller daemon with --simulate: its
// leader creates the simulated hosts and provisions them.
func TestControllerSimulate(t *testing.T) {
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
		c.Simulate = 3
		c.HeartbeatInterval = time.Second
	}))
	st := env.Controller.Store()
	deadline := time.Now().Add(2 * time.Minute)
	for i := 1; i <= 3; i++ {
		name := sim.HostName("sim", i)
		for {
			h := &typesv1.Host{}
			_, err := st.Get(context.Background(), "hosts", name, h)
			if err == nil && h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_PROVISIONED {
				require.Equal(t, int64(1), h.GetStatus().GetImageLays(), "host %s image_lays", name)
				break
			}
			require.NotEqual(t, typesv1.HostState_HOST_STATE_ERROR, h.GetStatus().GetState(), "host %s: %s", name, h.GetStatus().GetErrorReason())
			require.True(t, time.Now().Before(deadline), "host %s not Provisioned: %v", name, h.GetStatus())
			time.Sleep(200 * time.Millisecond)
		}
	}
}
