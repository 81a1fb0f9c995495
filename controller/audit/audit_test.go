package audit

import (
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestChanged(t *testing.T) {
	base := &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: "rack1-01", Labels: map[string]string{"rack": "1"}, Generation: 3},
		Spec: &typesv1.HostSpec{BootMac: "52:54:00:00:01:01", Bmc: &typesv1.BMCSpec{
			Protocol: "redfish", Address: "redfish+http://10.0.0.1", Username: "admin", PasswordSet: true,
		}},
	}
	edit := func(f func(h *typesv1.Host)) *typesv1.Host {
		h := proto.Clone(base).(*typesv1.Host)
		f(h)
		return h
	}
	tests := []struct {
		name          string
		before, after *typesv1.Host
		want          []string
	}{
		{"same", base, edit(func(h *typesv1.Host) {}), nil},
		{"address", base, edit(func(h *typesv1.Host) { h.Spec.Bmc.Address = "redfish+http://10.0.0.2" }), []string{"spec.bmc.address"}},
		{"labels and mac", base, edit(func(h *typesv1.Host) { h.Metadata.Labels["rack"] = "2"; h.Spec.BootMac = "52:54:00:00:01:02" }), []string{"metadata.labels", "spec.bootMac"}},
		{"bmc removed", base, edit(func(h *typesv1.Host) { h.Spec.Bmc = nil }), []string{"spec.bmc.address", "spec.bmc.passwordSet", "spec.bmc.protocol", "spec.bmc.username"}},
		{"generation is not compared", base, edit(func(h *typesv1.Host) { h.Metadata.Generation = 4 }), nil},
		{"creation", nil, base, []string{"metadata.labels", "spec.bmc.address", "spec.bmc.passwordSet", "spec.bmc.protocol", "spec.bmc.username", "spec.bootMac"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var before proto.Message
			if tt.before != nil {
				before = tt.before
			}
			got := Changed(before, tt.after, "spec", "metadata.labels", "metadata.annotations")
			if !slices.Equal(got, tt.want) {
				t.Errorf("Changed(%s) = %q, want %q", tt.name, got, tt.want)
			}
		})
	}
}
