package kubeadm

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/kilnhq/kiln/internal/errdefs"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

// splitDocuments splits a YAML stream at its "---" lines.
func splitDocuments(b []byte) []string {
	return strings.Split("\n"+string(b), "\n---\n")
}

// FuzzConfig generates kubeadm init and join configurations from any
// cluster fields the controller could send. Properties:
//   - a refusal is InvalidArgument and never quotes the join token or
//     the certificate key;
//   - an accepted configuration is exactly the documents Kiln writes
//     (four for init, one for join), each of which decodes strictly into
//     its type with every field as given: no value can add a key or a
//     document (no YAML injection).
func FuzzConfig(f *testing.F) {
	c := labCluster()
	f.Add(c.Name, c.KubernetesVersion, c.PodCidr, c.ServiceCidr, c.ControlPlaneEndpoint, c.DnsDomain, c.CgroupDriver, c.NodeName, c.AdvertiseAddress, "",
		"abcdef.0123456789abcdef", strings.Repeat("ab", 32), "sha256:"+strings.Repeat("0", 64), true)
	f.Add("lab\n---\nkind: Evil", "v1.34.4", "", "", "10.0.0.1:6443\nfoo: bar", "cluster.local", "", "", "", "registry.lab/k8s # x",
		"abcdef.0123456789abcdef", "", "sha256:"+strings.Repeat("0", 64), false)
	f.Add("lab", "latest", "10.244.0.0/16", "x", "", "", "systemd", "Node_1", "fe80::1%eth0", "", "abcdef.0123456789ABCDEF", "zz", "sha256:x", true)
	f.Fuzz(func(t *testing.T, name, version, podCIDR, serviceCIDR, endpoint, dnsDomain, driver, nodeName, advertise, repo, token, certKey, caHash string, controlPlane bool) {
		c := &agentv1.ClusterConfig{
			Name: name, KubernetesVersion: version, PodCidr: podCIDR, ServiceCidr: serviceCIDR,
			ControlPlaneEndpoint: endpoint, DnsDomain: dnsDomain, CgroupDriver: driver, Role: RoleControlPlane,
			NodeName: nodeName, AdvertiseAddress: advertise, ImageRepository: repo,
		}
		secretIn := func(what string, err error) {
			for _, s := range []string{token, certKey} {
				if len(s) >= 8 && strings.Contains(err.Error(), s) {
					t.Fatalf("%s error quotes a secret %q: %v", what, s, err)
				}
			}
		}
		strict := func(doc string, into any) {
			if err := yaml.UnmarshalStrict([]byte(doc), into); err != nil {
				t.Fatalf("generated document does not decode strictly into %T: %v\n%s", into, err, doc)
			}
		}

		if b, err := InitConfig(c, certKey, ""); err != nil {
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("InitConfig() = %v, want InvalidArgument", err)
			}
			secretIn("InitConfig", err)
		} else {
			docs := splitDocuments(b)
			if len(docs) != 4 {
				t.Fatalf("InitConfig() wrote %d documents, want 4:\n%s", len(docs), b)
			}
			var ic initConfiguration
			var cc clusterConfiguration
			var kc kubeletConfiguration
			var pc kubeProxyConfiguration
			strict(docs[0], &ic)
			strict(docs[1], &cc)
			strict(docs[2], &kc)
			strict(docs[3], &pc)
			if ic.Kind != "InitConfiguration" || cc.Kind != "ClusterConfiguration" || kc.Kind != "KubeletConfiguration" || pc.Kind != "KubeProxyConfiguration" {
				t.Fatalf("InitConfig() kinds %q %q %q %q", ic.Kind, cc.Kind, kc.Kind, pc.Kind)
			}
			if cc.ClusterName != name || cc.ControlPlaneEndpoint != endpoint || cc.ImageRepository != repo || cc.KubernetesVersion != version ||
				cc.Networking.PodSubnet != podCIDR || cc.Networking.ServiceSubnet != serviceCIDR ||
				ic.NodeRegistration.Name != nodeName || ic.CertificateKey != certKey {
				t.Fatalf("InitConfig() does not carry the fields as given:\n%s", b)
			}
			if dnsDomain != "" && cc.Networking.DNSDomain != dnsDomain {
				t.Fatalf("InitConfig() dnsDomain %q, want %q", cc.Networking.DNSDomain, dnsDomain)
			}
		}

		r := JoinRequest{APIServerEndpoint: endpoint, Token: token, CAHash: caHash, ControlPlane: controlPlane, CertificateKey: certKey}
		b, err := JoinConfig(c, r)
		if err != nil {
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("JoinConfig() = %v, want InvalidArgument", err)
			}
			secretIn("JoinConfig", err)
			return
		}
		docs := splitDocuments(b)
		if len(docs) != 1 {
			t.Fatalf("JoinConfig() wrote %d documents, want 1:\n%s", len(docs), b)
		}
		var jc joinConfiguration
		strict(docs[0], &jc)
		d := jc.Discovery.BootstrapToken
		if jc.Kind != "JoinConfiguration" || d.APIServerEndpoint != endpoint || d.Token != token || len(d.CACertHashes) != 1 || d.CACertHashes[0] != caHash ||
			(jc.ControlPlane != nil) != controlPlane || controlPlane && jc.ControlPlane.CertificateKey != certKey {
			t.Fatalf("JoinConfig() does not carry the request as given:\n%s", b)
		}
	})
}

// FuzzOutput feeds kubeadm output lines through the redactor and the
// error summary, as the agent streams them to the controller's events.
// Properties: no redacted line, and no error summary, contains the join
// token or certificate key the agent passed; the summary is made of the
// redacted lines; advertisedEndpoint returns "" or a host:port read from
// the manifest.
func FuzzOutput(f *testing.F) {
	for _, l := range []string{
		"[preflight] Running pre-flight checks",
		"error execution phase wait-control-plane: the API server did not become healthy",
		"error execution phase preflight: couldn't validate the identity of the API Server: none of the public keys \"sha256:00\" are pinned",
		"kubeadm join 10.0.0.2:6443 --token abcdef.0123456789abcdef --discovery-token-ca-cert-hash sha256:00 --control-plane --certificate-key " + strings.Repeat("ab", 32),
		"[upload-certs] Using certificate key:\n" + strings.Repeat("ab", 32),
	} {
		f.Add(l, "abcdef.0123456789abcdef", strings.Repeat("ab", 32), "    kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint: 10.0.0.2:6443\n")
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, output, tokenSeed, certKeySeed, manifest string) {
		// The secrets the agent holds have these shapes (ValidateToken,
		// certKeyRE); the output is free.
		token := shape(tokenSeed, "abcdefghijklmnopqrstuvwxyz0123456789", 22)
		token = token[:6] + "." + token[6:]
		certKey := shape(certKeySeed, "0123456789abcdef", 64)
		red := newRedactor(token, certKey)
		var tail []string
		for _, l := range strings.Split(output, "\n") {
			l = red.redact(l)
			for _, s := range []string{token, certKey} {
				if s != "" && strings.Contains(l, s) {
					t.Fatalf("redact() = %q still holds secret %q", l, s)
				}
			}
			tail = append(tail, l)
		}
		sum := errorLines(tail)
		for _, s := range []string{token, certKey} {
			if s != "" && strings.Contains(sum, s) {
				t.Fatalf("errorLines() = %q holds secret %q", sum, s)
			}
		}
		p := filepath.Join(dir, "kube-apiserver.yaml")
		if err := os.WriteFile(p, []byte(manifest), 0o600); err != nil {
			t.Fatal(err)
		}
		if ep := advertisedEndpoint(p); ep != "" {
			if err := validateEndpoint(ep); err != nil || !strings.Contains(manifest, ep) {
				t.Fatalf("advertisedEndpoint(%q) = %q: not a host:port from the manifest", manifest, ep)
			}
		}
	})
}

// shape maps seed onto n characters of alphabet (cycling the seed).
func shape(seed, alphabet string, n int) string {
	if seed == "" {
		seed = "0"
	}
	b := make([]byte, n)
	for i := range b {
		b[i] = alphabet[int(seed[i%len(seed)]+byte(i/len(seed)))%len(alphabet)]
	}
	return string(b)
}
