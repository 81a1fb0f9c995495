package provision_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/provision"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestAgentPoolRedialsAChangedAgent: the pool keeps one connection per
// host while its agent stays the same, and dials again when the agent
// changed behind the same address: the boot agent rebooted into the
// installed agent (mode and certificate differ) or its certificate was
// renewed. Reusing the boot agent's connection failed the first call to
// the installed agent with "connection reset by peer".
func TestAgentPoolRedialsAChangedAgent(t *testing.T) {
	pool := provision.NewAgentPool(x509.NewCertPool, func() tls.Certificate { return tls.Certificate{} })
	defer pool.Close()
	host := func(addr, mode, serial string) *typesv1.Host {
		return &typesv1.Host{
			Metadata: &typesv1.ObjectMeta{Name: "h1"},
			Status:   &typesv1.HostStatus{Agent: &typesv1.AgentStatus{Address: addr, Mode: mode, CertificateSerial: serial}},
		}
	}
	ctx := context.Background()
	boot, err := pool.Dial(ctx, host("10.253.25.10:7441", "boot", "01"))
	require.NoError(t, err)
	again, err := pool.Dial(ctx, host("10.253.25.10:7441", "boot", "01"))
	require.NoError(t, err)
	require.True(t, boot == again, "the same agent got a new connection")

	installed, err := pool.Dial(ctx, host("10.253.25.10:7441", "installed", "02"))
	require.NoError(t, err)
	require.False(t, installed == boot, "the installed agent got the boot agent's connection")

	renewed, err := pool.Dial(ctx, host("10.253.25.10:7441", "installed", "03"))
	require.NoError(t, err)
	require.False(t, renewed == installed, "a renewed certificate kept the old connection")

	moved, err := pool.Dial(ctx, host("10.253.25.11:7441", "installed", "03"))
	require.NoError(t, err)
	require.False(t, moved == renewed, "a new address kept the old connection")
}
