package controller_test

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/operatorcert"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// TestAuditVerbs drives each write the audit log covers besides apply
// (TestAudit in kilnctl): token creation, delete, a failed apply, and an
// operator certificate issued from the data directory, and reads each
// back as the admin, with no token secret in the log.
func TestAuditVerbs(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	ctx := context.Background()
	env := controllertest.Start(t)
	admin := controllerv1.NewResourcesClient(env.Dial(t, env.AdminConfigPath))
	op := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "operator", "olga")))

	tok, err := op.CreateToken(ctx, &controllerv1.CreateTokenRequest{Ttl: "1h", Host: "edge-01"})
	require.NoError(t, err)
	img := &controllerv1.Resource{Kind: &controllerv1.Resource_Image{Image: &typesv1.Image{
		Metadata: &typesv1.ObjectMeta{Name: "debian12"},
		Spec:     &typesv1.ImageSpec{Url: "http://127.0.0.1:8080/images/debian12.raw", Sha256: strings.Repeat("ab", 32), Format: "raw"},
	}}}
	_, err = op.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{img}})
	require.NoError(t, err, "apply image")
	_, err = op.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{img}, DryRun: true})
	require.NoError(t, err, "apply image --dry-run")
	_, err = op.Delete(ctx, &controllerv1.DeleteRequest{Kind: "image", Name: "debian12"})
	require.NoError(t, err)
	_, err = op.Delete(ctx, &controllerv1.DeleteRequest{Kind: "image", Name: "debian12"})
	require.Error(t, err, "second delete")
	bad := &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: "Not A DNS Name"}}}}
	_, err = op.Apply(ctx, &controllerv1.ApplyRequest{Resources: []*controllerv1.Resource{bad}})
	require.Error(t, err, "apply invalid host")

	_, err = enroll(ctx, t, env, tok.GetToken(), "edge-01")
	require.NoError(t, err, "enroll edge-01")

	require.NoError(t, operatorcert.Write(ctx, datadir.Config{DataDir: env.DataDir}, operatorcert.Request{
		Role: "operator", Name: "oscar", Out: filepath.Join(t.TempDir(), "oscar.yaml"),
	}, nil))

	resp, err := admin.ListAudit(ctx, &controllerv1.ListAuditRequest{Since: nil})
	require.NoError(t, err)
	find := func(verb, kind, name, result string) *controllerv1.AuditEntry {
		for _, e := range resp.GetEntries() {
			if e.GetVerb() == verb && e.GetKind() == kind && e.GetName() == name && e.GetResult() == result {
				return e
			}
		}
		t.Errorf("no audit entry %s %s/%s %s in %v", verb, kind, name, result, resp.GetEntries())
		return nil
	}
	id, secret, _ := strings.Cut(tok.GetToken(), ".")
	if e := find("create-token", "Token", id, "ok"); e != nil && (e.GetUser() != "olga" || e.GetRole() != "operator") {
		t.Errorf("create-token entry = %v, want user olga, role operator", e)
	}
	if e := find("enroll", "Host", "edge-01", "ok"); e != nil && e.GetUser() != "token:"+id {
		t.Errorf("enroll entry = %v, want user token:%s", e, id)
	}
	if e := find("delete", "Image", "debian12", "ok"); e != nil && (e.GetGenerationBefore() != 1 || e.GetGenerationAfter() != 0) {
		t.Errorf("delete entry = %v, want generation 1 -> 0", e)
	}
	if e := find("delete", "Image", "debian12", "failed"); e != nil && !strings.Contains(e.GetMessage(), "not found") {
		t.Errorf("second delete entry = %v, want a not found message", e)
	}
	find("apply", "Host", "Not A DNS Name", "failed")
	if e := find("issue-operator-cert", "Certificate", "oscar", "ok"); e != nil && (!strings.HasPrefix(e.GetUser(), "local") || !strings.Contains(e.GetMessage(), "role operator, serial ")) {
		t.Errorf("operator certificate entry = %v, want a local issuer and the role and serial", e)
	}
	for _, e := range resp.GetEntries() {
		if strings.Contains(e.String(), secret) {
			t.Errorf("audit entry %v holds the token's secret", e)
		}
	}

	// Filters: by user and kind, and a since after everything.
	byUser, err := admin.ListAudit(ctx, &controllerv1.ListAuditRequest{User: "olga", Kind: "images"})
	require.NoError(t, err)
	for _, e := range byUser.GetEntries() {
		if e.GetUser() != "olga" || e.GetKind() != "Image" {
			t.Errorf("ListAudit(user olga, kind images) returned %v", e)
		}
	}
	require.Len(t, byUser.GetEntries(), 3, "olga's image entries: apply, delete, failed delete (no dry run)")
}

// TestAuditBoundsRefusalRecords: a reader hammering Apply, which it may
// not call, gets its first refusals recorded and then no more, so the
// flood cannot push real entries out of the log through retention; the
// operator's write after it is recorded.
func TestAuditBoundsRefusalRecords(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	ctx := context.Background()
	env := controllertest.Start(t)
	admin := controllerv1.NewResourcesClient(env.Dial(t, env.AdminConfigPath))
	mallory := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "reader", "mallory")))
	for range 100 {
		_, err := mallory.Delete(ctx, &controllerv1.DeleteRequest{Kind: "hosts", Name: "rack1-01"})
		require.Error(t, err)
	}
	op := controllerv1.NewResourcesClient(env.Dial(t, env.ConfigFor(t, "operator", "olga")))
	_, err := op.CreateToken(ctx, &controllerv1.CreateTokenRequest{Ttl: "1h"})
	require.NoError(t, err)

	resp, err := admin.ListAudit(ctx, &controllerv1.ListAuditRequest{User: "mallory"})
	require.NoError(t, err)
	n := len(resp.GetEntries())
	t.Logf("100 refused deletes of mallory: %d recorded", n)
	// 30 at once, then one per 10 s: a slow machine may add a few.
	if n < 30 || n > 40 {
		t.Errorf("refused deletes recorded = %d, want the burst of 30 (up to 40 on a slow machine)", n)
	}
	for _, e := range resp.GetEntries() {
		if e.GetResult() != "refused" || e.GetVerb() != "delete" || e.GetRole() != "reader" {
			t.Errorf("mallory's entry = %v, want a refused delete by a reader", e)
		}
	}
	resp, err = admin.ListAudit(ctx, &controllerv1.ListAuditRequest{User: "olga"})
	require.NoError(t, err)
	require.Len(t, resp.GetEntries(), 1, "olga's token after the flood")
}
