package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// labDir writes the state and credentials of a lab of one Redfish and one
// IPMI host, as the supervisor does, and returns its directory.
func labDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	st := rack.State{Name: "lab1", Backend: rack.BackendNetns, Phase: rack.PhaseReady, Hosts: []rack.Host{
		{Name: "h1", Resource: "lab1-h1", MAC: "52:54:00:aa:00:01", Disk: "/var/lib/kiln/lab/lab1/hosts/h1/disk.raw",
			BMC: rack.BMC{Protocol: rack.ProtocolRedfish, Address: "https://127.0.0.1:40001", Insecure: true}},
		// A state file from before hosts had resource names.
		{Name: "h2", MAC: "52:54:00:aa:00:02", Disk: "/var/lib/kiln/lab/lab1/hosts/h2/disk.raw",
			BMC: rack.BMC{Protocol: rack.ProtocolIPMI, Address: "127.0.0.1:40002"}},
	}}
	creds := map[string]rack.Credentials{"h1": {Username: "admin", Password: "0123456789abcdef"}, "h2": {Username: "admin", Password: "fedcba9876543210"}}
	for name, v := range map[string]any{rack.StateFile: st, rack.CredentialsFile: creds} {
		b, err := json.Marshal(v)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), b, 0o600))
	}
	return dir
}

func runLab(t *testing.T, stdin string, args ...string) (string, string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	env := map[string]string{"HOME": t.TempDir()}
	err := Run(context.Background(), Options{
		Stdin: strings.NewReader(stdin), Stdout: &out, Stderr: &errOut,
		Getenv: func(k string) string { return env[k] }, Lab: LabCommand(),
	}, args)
	return out.String(), errOut.String(), err
}

// TestLabHosts: `kilnctl lab hosts` prints one Host resource per lab host
// that kilnctl apply's loader accepts, with the lab's labels, BMC,
// credentials, boot MAC and disk.
func TestLabHosts(t *testing.T) {
	dir := labDir(t)
	out, stderr, err := runLab(t, "", "lab", "hosts", "--state-dir", dir)
	require.NoError(t, err, stderr)

	docs, err := validation.LoadManifests(strings.NewReader(out), "-")
	require.NoError(t, err, "kilnctl apply would refuse:\n%s", out)
	require.Len(t, docs, 2)
	want := []*typesv1.Host{
		{ApiVersion: "kiln.dev/v1", Kind: "Host",
			Metadata: &typesv1.ObjectMeta{Name: "lab1-h1", Labels: map[string]string{"lab": "true", "kiln.dev/lab": "lab1"}},
			Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish", Address: "https://127.0.0.1:40001", Username: "admin", Password: "0123456789abcdef", InsecureSkipVerify: true},
				BootMac: "52:54:00:aa:00:01", RootDiskHint: "/var/lib/kiln/lab/lab1/hosts/h1/disk.raw", Online: true}},
		{ApiVersion: "kiln.dev/v1", Kind: "Host",
			Metadata: &typesv1.ObjectMeta{Name: "lab1-h2", Labels: map[string]string{"lab": "true", "kiln.dev/lab": "lab1"}},
			Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "ipmi", Address: "127.0.0.1:40002", Username: "admin", Password: "fedcba9876543210"},
				BootMac: "52:54:00:aa:00:02", RootDiskHint: "/var/lib/kiln/lab/lab1/hosts/h2/disk.raw", Online: true}},
	}
	for i, d := range docs {
		if got := d.Resource.GetHost(); !proto.Equal(got, want[i]) {
			t.Errorf("host %d of kilnctl lab hosts =\n%v\nwant\n%v", i, got, want[i])
		}
	}

	// kilnctl apply takes the output as is: it gets past validation to
	// dialing the controller (there is none here).
	_, _, err = runLab(t, out, "apply", "-f", "-", "--dry-run")
	require.Error(t, err)
	if strings.Contains(err.Error(), "nothing applied") || errdefs.IsInvalidArgument(err) {
		t.Errorf("kilnctl apply -f - of kilnctl lab hosts = %v, want it to accept the resources", err)
	}

	names, _, err := runLab(t, "", "lab", "hosts", "--state-dir", dir, "-o", "name")
	require.NoError(t, err)
	if names != "host/lab1-h1\nhost/lab1-h2\n" {
		t.Errorf("kilnctl lab hosts -o name = %q", names)
	}
	js, _, err := runLab(t, "", "lab", "hosts", "--state-dir", dir, "-o", "json")
	require.NoError(t, err)
	var list []map[string]any
	require.NoError(t, json.Unmarshal([]byte(js), &list), js)
	require.Len(t, list, 2)

	if _, _, err := runLab(t, "", "lab", "hosts", "--state-dir", dir, "-o", "wide"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("kilnctl lab hosts -o wide = %v, want InvalidArgument", err)
	}
	if _, _, err := runLab(t, "", "lab", "hosts", "--state-dir", t.TempDir()); !errdefs.IsNotFound(err) {
		t.Errorf("kilnctl lab hosts of a directory without a lab = %v, want NotFound", err)
	}
}

// TestLabHostsQEMUDisk: a QEMU lab host's agent runs inside the VM, where
// its disk is /dev/vda, not the disk file's path on the lab machine.
func TestLabHostsQEMUDisk(t *testing.T) {
	rep := &rack.Report{State: &rack.State{Name: "lab1", Backend: rack.BackendQEMU, Hosts: []rack.Host{
		{Name: "h1", Resource: "lab1-h1", MAC: "52:54:00:4b:00:01", Disk: "/var/lib/kiln/lab/lab1/hosts/h1/disk.raw",
			BMC: rack.BMC{Protocol: rack.ProtocolRedfish, Address: "https://127.0.0.1:40001", Insecure: true}},
	}}}
	rs := LabHostResources(rep)
	require.Len(t, rs, 1)
	if got := rs[0].GetHost().GetSpec().GetRootDiskHint(); got != "/dev/vda" {
		t.Errorf("LabHostResources(qemu lab).rootDiskHint = %q, want /dev/vda", got)
	}
}
