package agentclient_test

import (
	"context"
	"crypto/tls"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/agent/agenttest"
	"github.com/kilnhq/kiln/agent/server"
	client "github.com/kilnhq/kiln/controller/agentclient"
	"github.com/kilnhq/kiln/internal/pki"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestDialChecksTheHost(t *testing.T) {
	a := agenttest.Start(t, server.Options{Facts: server.FactsFunc(func(context.Context) (*typesv1.Facts, error) {
		return &typesv1.Facts{Hostname: "host-a"}, nil
	})})
	certPEM, keyPEM, err := a.CA.Issue(pki.RoleController, pki.ControllerName, nil, time.Hour, time.Now())
	require.NoError(t, err)
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	require.NoError(t, err)

	tests := []struct {
		host string
		want codes.Code
		msg  string
	}{
		{"host-a", codes.OK, ""},
		{"host-b", codes.Unavailable, "the agent at this address is host"},
	}
	for _, tt := range tests {
		c, conn, err := client.Dial(a.Addr, tt.host, a.CA.Pool(), cert)
		require.NoError(t, err)
		_, err = c.Facts(context.Background(), &agentv1.FactsRequest{})
		conn.Close()
		if status.Code(err) != tt.want || !strings.Contains(status.Convert(err).Message(), tt.msg) {
			t.Errorf("Dial(%q).Facts() = %v, want %v containing %q", tt.host, err, tt.want, tt.msg)
		}
	}
	if _, _, err := client.Dial("", "host-a", a.CA.Pool(), cert); err == nil {
		t.Errorf("Dial with no address succeeded")
	}
}
