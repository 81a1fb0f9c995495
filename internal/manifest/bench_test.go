package manifest

import (
	"fmt"
	"strings"
	"testing"
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
