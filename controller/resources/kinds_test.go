package resources

import (
	"testing"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestLookupKind(t *testing.T) {
	tests := []struct {
		in, want string
	}{
		{"hosts", "hosts"}, {"Host", "hosts"}, {"host", "hosts"}, {"HOSTS", "hosts"},
		{"MachineDeployment", "machinedeployments"}, {"healthchecks", "healthchecks"},
		{"controlplane", "controlplanes"}, {"gadget", ""}, {"", ""}, {"secrets", ""}, {"tokens", ""},
	}
	for _, tt := range tests {
		k, err := LookupKind(tt.in)
		if k.Plural != tt.want || (err == nil) != (tt.want != "") {
			t.Errorf("LookupKind(%q) = %q, %v; want %q", tt.in, k.Plural, err, tt.want)
		}
	}
}

func TestUnwrapAndHelpers(t *testing.T) {
	r := &controllerv1.Resource{Kind: &controllerv1.Resource_Image{Image: &typesv1.Image{
		Metadata: &typesv1.ObjectMeta{Name: "deb12"},
		Spec:     &typesv1.ImageSpec{Url: "http://x"},
		Status:   &typesv1.ImageStatus{Conditions: []*typesv1.Condition{{Type: "Ready"}}},
	}}}
	k, obj, err := Unwrap(r)
	if err != nil || k.Plural != "images" {
		t.Fatalf("Unwrap(image) = %q, %v; want images", k.Plural, err)
	}
	if got := Meta(obj).GetName(); got != "deb12" {
		t.Errorf("Meta(image).Name = %q, want deb12", got)
	}
	clearStatus(obj)
	if obj.(*typesv1.Image).GetStatus() != nil {
		t.Errorf("clearStatus left a status")
	}
	setHeader(obj, k)
	if !headerOK(obj, k) {
		t.Errorf("headerOK after setHeader = false")
	}
	other := k.New()
	setSpec(other, obj)
	if !specEqual(other, obj) {
		t.Errorf("specEqual after setSpec = false")
	}
	if _, _, err := Unwrap(&controllerv1.Resource{}); err == nil {
		t.Errorf("Unwrap(empty) = nil error, want InvalidArgument")
	}
}
