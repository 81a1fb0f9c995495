package manifest

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kilnhq/kiln/controller/validation"
)

// hostsYAML is a fleet file of n Redfish hosts.
func hostsYAML(n int) []byte {
	var b strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, `---
apiVersion: kiln.dev/v1
kind: Host
metadata:
  name: rack%d-%02d
  labels:
    rack: rack%d
    region: eu1
spec:
  bmc:
    protocol: redfish
    address: https://10.%d.%d.5
    username: admin
    password: change-me
  bootMac: "52:54:00:00:%02x:%02x"
  rootDiskHint: /dev/sda
  online: true
`, i/40, i%40, i/40, i/250, i%250, i/256, i%256)
	}
	return []byte(b.String())
}

// BenchmarkDecode1000Hosts measures parsing and checking a 1000-host file
// (what `kilnctl apply -f fleet.yaml` does before sending anything).
func BenchmarkDecode1000Hosts(b *testing.B) {
	data := hostsYAML(1000)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		docs, err := Decode("fleet.yaml", data)
		if err != nil || len(docs) != 1000 {
			b.Fatalf("Decode() = %d docs, %v", len(docs), err)
		}
		for _, d := range docs {
			if err := validation.Validate(d.Resource); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkMarshal1000Hosts measures `kilnctl get hosts -o yaml` output
// for 1000 hosts.
func BenchmarkMarshal1000Hosts(b *testing.B) {
	docs, err := Decode("fleet.yaml", hostsYAML(1000))
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		for _, d := range docs {
			if _, err := Marshal(d.Resource); err != nil {
				b.Fatal(err)
			}
		}
	}
}
