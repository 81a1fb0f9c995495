package cli

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
)

func auditHostYAML(password string) string {
	return `apiVersion: kiln.dev/v1
kind: Host
metadata:
  name: rack1-01
spec:
  bmc:
    protocol: redfish
    address: redfish+http://127.0.0.1:8001
    username: admin
    password: ` + password + `
  bootMac: "52:54:00:00:01:01"
`
}

// auditRow returns the table row of user's verb on object, "" when none.
func auditRow(table, user, verb, object string) string {
	for _, line := range strings.Split(table, "\n") {
		f := strings.Fields(line)
		if len(f) >= 5 && f[1] == user && f[3] == verb && f[4] == object {
			return line
		}
	}
	return ""
}

// TestAudit applies a host twice as an operator, the second time with a
// new BMC password, has a reader try to change it and to read the audit
// log, and reads the log as the admin: the password change shows as the
// field spec.bmc.password, the reader's attempts show as refused, and no
// byte of the audit log in etcd holds either password.
func TestAudit(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) {
		c.AuditReaders = []string{"reader:auditor"}
	}))
	admin := env.AdminConfigPath
	operator := env.ConfigFor(t, "operator", "olga")
	reader := env.ConfigFor(t, "reader", "rita")
	auditor := env.ConfigFor(t, "reader", "auditor")

	const pw1, pw2 = "first-bmc-password-4711", "second-bmc-password-0815"
	dir := t.TempDir()
	v1, v2 := filepath.Join(dir, "v1.yaml"), filepath.Join(dir, "v2.yaml")
	require.NoError(t, os.WriteFile(v1, []byte(auditHostYAML(pw1)), 0o600))
	require.NoError(t, os.WriteFile(v2, []byte(auditHostYAML(pw2)), 0o600))

	mustKilnctl(t, operator, "apply", "-f", v1)
	mustKilnctl(t, operator, "apply", "-f", v2)
	mustKilnctl(t, operator, "apply", "-f", v2) // unchanged

	_, err := kilnctl(t, reader, "apply", "-f", v1)
	require.Error(t, err, "a reader's apply must be refused")

	t.Run("a reader may not read the audit log", func(t *testing.T) {
		_, err := kilnctl(t, reader, "audit")
		if !errdefs.IsPermissionDenied(err) || !strings.Contains(err.Error(), "needs the admin role or an audit-log grant") {
			t.Fatalf("kilnctl audit as a reader = %v, want PermissionDenied naming the admin role or an audit-log grant", err)
		}
		t.Logf("kilnctl audit as reader rita: %v", err)
	})

	table := mustKilnctl(t, admin, "audit")
	t.Logf("kilnctl audit:\n%s", table)

	t.Run("a changed password is named, not shown", func(t *testing.T) {
		created := auditRow(table, "olga", "apply", "host/rack1-01")
		require.NotEmpty(t, created, "no apply row of olga")
		require.Contains(t, created, "operator")
		var changedRow string
		for _, line := range strings.Split(table, "\n") {
			if strings.Contains(line, "olga") && strings.Contains(line, " 1->2 ") {
				changedRow = line
			}
		}
		if changedRow == "" || !strings.Contains(changedRow, " ok ") || !strings.Contains(changedRow, "spec.bmc.password") {
			t.Errorf("audit row of the second apply = %q, want generation 1->2, ok, and spec.bmc.password in CHANGED", changedRow)
		}
		if !strings.Contains(table, " unchanged ") {
			t.Errorf("audit table has no unchanged apply:\n%s", table)
		}
		for _, pw := range []string{pw1, pw2} {
			if strings.Contains(table, pw) {
				t.Errorf("the audit table shows a BMC password")
			}
		}
		yaml := mustKilnctl(t, admin, "audit", "-o", "yaml", "--user", "olga")
		if !strings.Contains(yaml, "spec.bmc.password") || strings.Contains(yaml, pw1) || strings.Contains(yaml, pw2) || strings.Contains(yaml, "rita") {
			t.Errorf("kilnctl audit -o yaml --user olga =\n%s\nwant olga's entries naming spec.bmc.password and no password", yaml)
		}
	})

	t.Run("the raw etcd bytes hold no password", func(t *testing.T) {
		resp, err := env.Controller.Store().Client().Get(context.Background(), store.AuditPrefix, clientv3.WithPrefix())
		require.NoError(t, err)
		require.NotEmpty(t, resp.Kvs, "no audit keys in etcd")
		for _, kv := range resp.Kvs {
			for _, pw := range []string{pw1, pw2} {
				if strings.Contains(string(kv.Key)+string(kv.Value), pw) {
					t.Errorf("audit key %s holds a BMC password", kv.Key)
				}
			}
		}
	})

	t.Run("refused calls are recorded as refused", func(t *testing.T) {
		apply := auditRow(table, "rita", "apply", "host/rack1-01")
		if !strings.Contains(apply, "reader") || !strings.Contains(apply, " refused") {
			t.Errorf("audit row of rita's apply = %q, want role reader and result refused", apply)
		}
		if row := auditRow(table, "rita", "list-audit", "auditlog"); !strings.Contains(row, " refused") {
			t.Errorf("audit row of rita's kilnctl audit = %q, want refused", row)
		}
	})

	t.Run("a backup is recorded", func(t *testing.T) {
		dir := t.TempDir()
		pub := strings.TrimSpace(mustKilnctl(t, admin, "backup", "keygen", "-o", filepath.Join(dir, "key.txt")))
		mustKilnctl(t, admin, "backup", "-o", filepath.Join(dir, "backup.age"), "--recipient", pub)
		out := mustKilnctl(t, admin, "audit", "--kind", "controller")
		if !strings.Contains(out, " backup ") || !strings.Contains(out, " ok ") {
			t.Errorf("kilnctl audit --kind controller after a backup =\n%s\nwant a backup row", out)
		}
	})

	t.Run("a granted reader may read it", func(t *testing.T) {
		out, err := kilnctl(t, auditor, "audit", "--kind", "host", "--since", "1h")
		require.NoError(t, err)
		if auditRow(out, "olga", "apply", "host/rack1-01") == "" {
			t.Errorf("kilnctl audit --kind host as the granted reader =\n%s\nwant olga's applies", out)
		}
	})
}

// TestApplyTooLargeSaysSo: a file larger than the controller's message
// limit is refused with a message and a hint saying what to do.
func TestApplyTooLargeSaysSo(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a controller with embedded etcd")
	}
	env := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.MaxMessageBytes = 4 << 10 }))
	var b strings.Builder
	for i := range 200 {
		fmt.Fprintf(&b, "---\napiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: big-%03d\nspec:\n  bmc:\n    protocol: none\n  bootMac: \"52:54:00:00:%02x:%02x\"\n", i, i/256, i%256)
	}
	file := filepath.Join(t.TempDir(), "hosts.yaml")
	require.NoError(t, os.WriteFile(file, []byte(b.String()), 0o600))
	_, err := kilnctl(t, env.AdminConfigPath, "apply", "-f", file)
	t.Logf("kilnctl apply of %d bytes with a 4 KiB limit: %v", b.Len(), err)
	if err == nil || !strings.Contains(err.Error(), "larger than max") || !strings.Contains(err.Error(), "--max-message-size") {
		t.Errorf("kilnctl apply of a file over the limit = %v, want the refusal and a hint naming --max-message-size", err)
	}
}
