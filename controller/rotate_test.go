package controller_test

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"filippo.io/age"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/controllertest"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/rekey"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/seal"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// storeKVs returns every key and value of a stopped controller's
// embedded etcd.
func storeKVs(ctx context.Context, t *testing.T, dataDir string) map[string][]byte {
	t.Helper()
	emb, err := store.StartEmbedded(ctx, store.EmbeddedConfig{DataDir: filepath.Join(dataDir, "etcd"), ReadyTimeout: 20 * time.Second})
	require.NoError(t, err)
	defer emb.Close()
	cl, err := store.Dial(emb.Endpoints(), nil)
	require.NoError(t, err)
	defer cl.Close()
	return allKVs(ctx, t, cl)
}

func allKVs(ctx context.Context, t *testing.T, cl *clientv3.Client) map[string][]byte {
	t.Helper()
	resp, err := cl.Get(ctx, "", clientv3.WithFromKey())
	require.NoError(t, err)
	out := map[string][]byte{}
	for _, kv := range resp.Kvs {
		out[string(kv.Key)] = kv.Value
	}
	return out
}

// secretsOf keeps the sealed secrets of kvs.
func secretsOf(kvs map[string][]byte) map[string][]byte {
	out := map[string][]byte{}
	for k, v := range kvs {
		if strings.HasPrefix(k, store.SecretKey("")) {
			out[k] = v
		}
	}
	return out
}

// requireOpens checks that every secret opens with a controller started
// on the key files as they are now.
func requireOpens(t *testing.T, step, keyFile string, secrets map[string][]byte) {
	t.Helper()
	ring, err := seal.LoadKeyRing(keyFile)
	require.NoError(t, err, step)
	for k, v := range secrets {
		_, err := ring.Open(v, []byte(k))
		require.NoError(t, err, "%s: %s does not open with the key files left", step, k)
	}
}

// TestRotateSecretKey rotates the sealing key of a stopped controller,
// interrupted after the prepare step and again in the middle of the
// re-seal, checking after each that every secret opens with the key files
// as they are; run again, it finishes with the same new key. Afterwards
// every sealed value opens with the new key alone and none with the old
// key alone, and a controller started on the data directory serves the
// host's BMC password and the same CA.
func TestRotateSecretKey(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	env := controllertest.Start(t)
	rc := resourcesClient(t, env, "admin")
	const pw = "R0tation-BMC-Passw0rd"
	var hosts []*controllerv1.Resource
	for i := range 5 {
		hosts = append(hosts, host(fmt.Sprintf("rack1-%02d", i), fmt.Sprintf("%s-%d", pw, i)))
	}
	_, err := rc.Apply(ctx, &controllerv1.ApplyRequest{Resources: hosts})
	require.NoError(t, err)
	require.NoError(t, env.Store().PutSecret(ctx, "clusters/c1/admin.conf", []byte("kubeconfig")))
	env.Stop()
	caHash := env.CAHash
	cfg := datadir.Config{DataDir: env.DataDir}
	keyFile := filepath.Join(env.DataDir, "secret.key")
	oldKey, err := seal.ReadKeyFile(keyFile)
	require.NoError(t, err)

	before := secretsOf(storeKVs(ctx, t, env.DataDir))
	require.Len(t, before, 7, "sealed secrets before: the CA key, 5 BMC passwords, the cluster's")

	// A wrong key file changes nothing.
	other := filepath.Join(t.TempDir(), "other.key")
	_, err = seal.LoadOrCreateKey(other)
	require.NoError(t, err)
	_, err = rekey.Rotate(ctx, datadir.Config{DataDir: env.DataDir, SecretKeyFile: other}, rekey.Request{}, nil)
	require.True(t, errdefs.IsFailedPrecondition(err), "rotation with another controller's key file: %v", err)
	t.Logf("wrong key file: %v", err)
	st, err := seal.ReadRotation(other)
	require.NoError(t, err)
	require.Equal(t, seal.Idle, st, "a refused rotation touched the key files")

	// Interrupted after the new key is written.
	res, err := rekey.Rotate(ctx, cfg, rekey.Request{Phase: rekey.Prepare}, nil)
	require.NoError(t, err)
	newID := res.New
	require.True(t, res.Created)
	requireOpens(t, "prepared", keyFile, before)

	// Interrupted in the middle of the re-seal.
	ictx, icancel := context.WithCancel(ctx)
	resealed := 0
	_, err = rekey.Rotate(ictx, cfg, rekey.Request{Progress: func(string) {
		if resealed++; resealed == 2 {
			icancel()
		}
	}}, nil)
	icancel()
	require.Error(t, err, "an interrupted rotation reported success")
	t.Logf("interrupted: %v", err)
	st, err = seal.ReadRotation(keyFile)
	require.NoError(t, err)
	require.Equal(t, seal.Switched, st)
	mid := secretsOf(storeKVs(ctx, t, env.DataDir))
	requireOpens(t, "interrupted re-seal", keyFile, mid)
	under := map[bool]int{}
	for _, v := range mid {
		id, _, err := seal.SealedWith(v)
		require.NoError(t, err)
		under[id == newID]++
	}
	require.Positive(t, under[true], "the interruption came before any re-seal")
	require.Positive(t, under[false], "the interruption came after every re-seal")

	var out []string
	res, err = rekey.Rotate(ctx, cfg, rekey.Request{Progress: func(p string) { out = append(out, p) }}, nil)
	require.NoError(t, err)
	t.Logf("rotation: %+v, re-sealed %v", res, out)
	require.True(t, res.Resumed)
	require.False(t, res.Created)
	require.Equal(t, newID, res.New, "the re-run made another key")
	require.Equal(t, seal.IDOf(oldKey), res.Old)
	require.True(t, res.Retired)
	require.Equal(t, 7, res.Secrets)
	require.Equal(t, under[false], res.Resealed, "re-sealed count")
	st, err = seal.ReadRotation(keyFile)
	require.NoError(t, err)
	require.Equal(t, seal.Idle, st)

	newKey, err := seal.ReadKeyFile(keyFile)
	require.NoError(t, err)
	require.Equal(t, newID, seal.IDOf(newKey))
	onlyNew, err := seal.New(newKey)
	require.NoError(t, err)
	onlyOld, err := seal.New(oldKey)
	require.NoError(t, err)
	kvs := storeKVs(ctx, t, env.DataDir)
	after := secretsOf(kvs)
	require.Len(t, after, 7)
	for k, v := range after {
		pt, err := onlyNew.Open(v, []byte(k))
		require.NoError(t, err, "%s does not open with the new key alone", k)
		if k == store.SecretKey("bmc/rack1-03") {
			require.Equal(t, pw+"-3", string(pt))
		}
	}
	// No value anywhere in the store, secret or not, opens with the old
	// key: none was missed.
	for k, v := range kvs {
		if _, err := onlyOld.Open(v, []byte(k)); err == nil {
			t.Errorf("%s still opens with the old key", k)
		}
		if bytes.Contains(v, newKey) || bytes.Contains(v, oldKey) {
			t.Errorf("%s holds a sealing key in the clear", k)
		}
	}

	// A controller started after the rotation serves the same CA and
	// opens the BMC password; the rotation is in its audit log.
	env2 := controllertest.Start(t, controllertest.WithConfig(func(c *controller.Config) { c.DataDir = env.DataDir }))
	require.Equal(t, caHash, env2.CAHash)
	got, err := env2.Store().GetSecret(ctx, "bmc/rack1-00")
	require.NoError(t, err)
	require.Equal(t, pw+"-0", string(got))
	var audited []*controllerv1.AuditEntry
	require.NoError(t, env2.Store().ListAudit(ctx, time.Time{}, func() proto.Message { return &controllerv1.AuditEntry{} }, func(m proto.Message) bool {
		if e := m.(*controllerv1.AuditEntry); e.GetVerb() == "rotate-secret-key" {
			audited = append(audited, e)
		}
		return true
	}))
	require.Len(t, audited, 1)
	require.Equal(t, newID.String(), audited[0].GetName())
	t.Logf("audit: %s", audited[0].GetMessage())
	require.NotContains(t, env2.Logs(), pw)
}

func ageRecipient(t *testing.T) string {
	t.Helper()
	id, err := age.GenerateX25519Identity()
	require.NoError(t, err)
	return id.Recipient().String()
}

// TestRotateSecretKeyUnderARunningController rotates the key of a
// running controller (through its embedded etcd) while it keeps writing
// secrets: no write is lost, each opens with its latest value, and all
// end up under the new key, which the running controller seals with.
func TestRotateSecretKeyUnderARunningController(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	env := controllertest.Start(t)
	st := env.Store()
	for i := range 50 {
		require.NoError(t, st.PutSecret(ctx, fmt.Sprintf("load/s%02d", i), []byte("v0")))
	}
	keyFile := filepath.Join(env.DataDir, "secret.key")

	// A backup holds one key: it is refused while the rotation is under
	// way (here prepared), and the rotation then carries on.
	_, err := rekey.Rotate(ctx, datadir.Config{DataDir: env.DataDir}, rekey.Request{Phase: rekey.Prepare}, nil)
	require.NoError(t, err)
	_, _, err = takeBackup(ctx, t, env, env.AdminConfigPath, ageRecipient(t))
	require.Equal(t, codes.FailedPrecondition, code(err), "backup during a rotation: %v", err)
	require.ErrorContains(t, err, "rotate-secret-key")

	// The controller keeps rewriting secrets while the rotation runs.
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		latest = map[string]string{}
	)
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 1; ; n++ {
			select {
			case <-stop:
				return
			default:
			}
			p := fmt.Sprintf("load/s%02d", n%50)
			v := fmt.Sprintf("v%d", n)
			if err := st.PutSecret(ctx, p, []byte(v)); err != nil {
				t.Errorf("PutSecret during the rotation: %v", err)
				return
			}
			mu.Lock()
			latest[p] = v
			mu.Unlock()
		}
	}()
	res, err := rekey.Rotate(ctx, datadir.Config{DataDir: env.DataDir}, rekey.Request{}, nil)
	close(stop)
	wg.Wait()
	require.NoError(t, err)
	t.Logf("rotation under load: %+v, %d secrets rewritten meanwhile", res, len(latest))
	require.True(t, res.Retired)
	require.GreaterOrEqual(t, res.Secrets, 51)
	_, _, err = takeBackup(ctx, t, env, env.AdminConfigPath, ageRecipient(t))
	require.NoError(t, err, "backup after the rotation")

	// After the rotation the running controller seals under the new key.
	require.NoError(t, st.PutSecret(ctx, "load/after", []byte("after")))
	kvs := secretsOf(allKVs(ctx, t, st.Client()))
	newKey, err := seal.ReadKeyFile(keyFile)
	require.NoError(t, err)
	onlyNew, err := seal.New(newKey)
	require.NoError(t, err)
	for k, v := range kvs {
		pt, err := onlyNew.Open(v, []byte(k))
		require.NoError(t, err, "%s does not open with the new key alone", k)
		path := strings.TrimPrefix(k, store.SecretKey(""))
		mu.Lock()
		want, ok := latest[path]
		mu.Unlock()
		if ok && string(pt) != want {
			t.Errorf("secret %s = %q after the rotation, want the last write %q", path, pt, want)
		}
	}
	require.Contains(t, kvs, store.SecretKey("load/after"))
}
