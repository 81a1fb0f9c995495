package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnhq/kiln/controller/controllertest"
)

// fleetFile writes n Redfish hosts to a file and returns its path.
func fleetFile(b *testing.B, n int) string {
	var s strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&s, "---\napiVersion: kiln.dev/v1\nkind: Host\nmetadata:\n  name: r%d-%02d\n  labels: {rack: r%d}\n"+
			"spec:\n  bmc: {protocol: redfish, address: \"https://127.0.0.%d\", username: admin, password: pw-%d}\n  bootMac: \"52:54:00:00:%02x:%02x\"\n",
			i/40, i%40, i/40, 1+i%250, i, i/256, i%256)
	}
	p := filepath.Join(b.TempDir(), "fleet.yaml")
	if err := os.WriteFile(p, []byte(s.String()), 0o600); err != nil {
		b.Fatal(err)
	}
	return p
}

func benchRun(b *testing.B, config string, args ...string) {
	opts := Options{Stdout: io.Discard, Stderr: io.Discard, Stdin: strings.NewReader(""),
		Getenv: func(k string) string { return map[string]string{"KILNCONFIG": config}[k] }}
	if err := Run(context.Background(), opts, args); err != nil {
		b.Fatalf("kilnctl %v: %v", args, err)
	}
}

// BenchmarkApply200HostsUnchanged is `kilnctl apply -f fleet.yaml` of 200
// hosts that are already stored: parse, validate, one Apply call, print.
func BenchmarkApply200HostsUnchanged(b *testing.B) {
	env := controllertest.Start(b)
	p := fleetFile(b, 200)
	benchRun(b, env.AdminConfigPath, "apply", "-f", p)
	for b.Loop() {
		benchRun(b, env.AdminConfigPath, "apply", "-f", p)
	}
}

// BenchmarkGet200Hosts is `kilnctl get hosts` of 200 hosts (table).
func BenchmarkGet200Hosts(b *testing.B) {
	env := controllertest.Start(b)
	benchRun(b, env.AdminConfigPath, "apply", "-f", fleetFile(b, 200))
	for b.Loop() {
		benchRun(b, env.AdminConfigPath, "get", "hosts")
	}
}
