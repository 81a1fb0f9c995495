package api_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/controller/clusterexec"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// sealedKubeconfig stands in for what kubeadm init returns; the marker
// lets the test look for it in logs and events.
const sealedKubeconfig = "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: https://10.44.0.10:6443\nusers:\n- name: kubernetes-admin\n  user:\n    client-key-data: SECRET-MARKER-7f3a9c\n"

func TestGetKubeconfig(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	ctx := context.Background()
	env := controllertest.Start(t)
	admin := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "admin", "carol")))

	_, err := admin.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{{Kind: &controllerv1.Resource_Cluster{Cluster: &typesv1.Cluster{
		ApiVersion: "kiln.dev/v1", Kind: "Cluster",
		Metadata: &typesv1.ObjectMeta{Name: "lab"},
		Spec:     &typesv1.ClusterSpec{KubernetesVersion: "v1.34.4", PodCidr: "10.244.0.0/16", ServiceCidr: "10.96.0.0/12"},
	}}}}})
	require.NoError(t, err)

	t.Run("unknown cluster", func(t *testing.T) {
		_, err := admin.GetKubeconfig(ctx, &controllerv1.GetKubeconfigRequest{Cluster: "nope"})
		if status.Code(err) != codes.NotFound || status.Convert(err).Message() != "cluster nope not found" {
			t.Errorf("GetKubeconfig(nope) = %v, want NotFound \"cluster nope not found\"", err)
		}
		_, err = admin.GetKubeconfig(ctx, &controllerv1.GetKubeconfigRequest{})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("GetKubeconfig(\"\") = %v, want InvalidArgument", err)
		}
	})

	t.Run("not initialised yet", func(t *testing.T) {
		_, err := admin.GetKubeconfig(ctx, &controllerv1.GetKubeconfigRequest{Cluster: "lab"})
		want := "cluster lab has no kubeconfig yet: its first control plane has not finished kubeadm init; see kilnctl describe cluster lab"
		if status.Code(err) != codes.FailedPrecondition || status.Convert(err).Message() != want {
			t.Errorf("GetKubeconfig(lab) before init = %v, want FailedPrecondition %q", err, want)
		}
	})

	// Seal the credentials the way the cluster executor does after init.
	b, err := json.Marshal(clusterexec.Bootstrap{JoinToken: "abcdef.0123456789abcdef", CertificateKey: "00ff", Kubeconfig: sealedKubeconfig, APIServerEndpoint: "10.44.0.10:6443"})
	require.NoError(t, err)
	require.NoError(t, env.Store().PutSecret(ctx, clusterexec.BootstrapSecretPath("lab"), b))

	t.Run("admin gets the sealed bytes", func(t *testing.T) {
		resp, err := admin.GetKubeconfig(ctx, &controllerv1.GetKubeconfigRequest{Cluster: "lab"})
		require.NoError(t, err)
		if string(resp.GetKubeconfig()) != sealedKubeconfig {
			t.Errorf("GetKubeconfig(lab) = %q, want the sealed kubeconfig %q", resp.GetKubeconfig(), sealedKubeconfig)
		}
		evs, err := admin.ListEvents(ctx, &controllerv1.ListEventsRequest{ObjectKind: "Cluster", ObjectName: "lab"})
		require.NoError(t, err)
		var fetched []string
		for _, e := range evs.GetEvents() {
			if strings.Contains(e.String(), "SECRET-MARKER") {
				t.Errorf("event %v contains the kubeconfig", e)
			}
			if e.GetReason() == "KubeconfigFetched" {
				fetched = append(fetched, e.GetMessage())
			}
		}
		if len(fetched) != 1 || !strings.Contains(fetched[0], `admin "carol"`) {
			t.Errorf("KubeconfigFetched events on cluster lab = %q, want one naming admin \"carol\"", fetched)
		}
	})

	t.Run("readers, operators and agents are refused", func(t *testing.T) {
		for _, role := range []string{"reader", "operator"} {
			c := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, role, "dave")))
			_, err := c.GetKubeconfig(ctx, &controllerv1.GetKubeconfigRequest{Cluster: "lab"})
			msg := status.Convert(err).Message()
			if status.Code(err) != codes.PermissionDenied || !strings.Contains(msg, "role "+role+" (dave)") || !strings.HasSuffix(msg, "GetKubeconfig: it needs the admin role") {
				t.Errorf("GetKubeconfig as %s = %v, want PermissionDenied naming the admin role", role, err)
			}
		}

		keyPEM, csr, err := pki.NewKeyAndCSR("h1")
		require.NoError(t, err)
		enr, err := controllerv1.NewEnrollmentClient(env.DialAnonymous(t)).Enroll(ctx, &controllerv1.EnrollRequest{
			Token: env.Token(t, "h1", time.Hour), CsrDer: csr, Host: "h1",
			Facts: &typesv1.Facts{Hostname: "h1", AgentMode: "boot", BootSource: "pxe"},
		})
		require.NoError(t, err)
		agent := controllerv1.NewResourcesClient(env.DialCert(t, enr.GetCertificatePem(), keyPEM))
		_, err = agent.GetKubeconfig(ctx, &controllerv1.GetKubeconfigRequest{Cluster: "lab"})
		if status.Code(err) != codes.PermissionDenied {
			t.Errorf("GetKubeconfig as agent = %v, want PermissionDenied", err)
		}
		anon := controllerv1.NewResourcesClient(env.DialAnonymous(t))
		_, err = anon.GetKubeconfig(ctx, &controllerv1.GetKubeconfigRequest{Cluster: "lab"})
		if status.Code(err) != codes.PermissionDenied {
			t.Errorf("GetKubeconfig without a certificate = %v, want PermissionDenied", err)
		}
	})

	if strings.Contains(env.Logs(), "SECRET-MARKER") {
		t.Errorf("the controller logged the kubeconfig:\n%s", env.Logs())
	}
}
