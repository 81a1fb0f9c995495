package bmc

import (
	"context"
	"testing"

	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestNormalisePower(t *testing.T) {
	tests := []struct {
		raw, want string
	}{
		{"Chassis Power is on\n", PowerOn},
		{"Chassis Power is off", PowerOff},
		{"On", PowerOn},
		{"Off", PowerOff},
		{"PoweringOn", PowerUnknown},
		{"", PowerUnknown},
	}
	for _, tt := range tests {
		if got := NormalisePower(tt.raw); got != tt.want {
			t.Errorf("NormalisePower(%q) = %q, want %q", tt.raw, got, tt.want)
		}
	}
}

func TestVerifyBoot(t *testing.T) {
	tests := []struct {
		asked, reported string
		ok              bool
		class           func(error) bool
	}{
		{"cdrom", "virtualmedia", true, nil},
		{"pxe", "pxe", true, nil},
		{"disk", "disk", true, nil},
		{"pxe", "disk", false, errdefs.IsFailedPrecondition},
		{"cdrom", "unknown", false, errdefs.IsFailedPrecondition},
		{"floppy", "disk", false, errdefs.IsInvalidArgument},
	}
	for _, tt := range tests {
		err := VerifyBoot(tt.asked, tt.reported)
		if (err == nil) != tt.ok || (err != nil && !tt.class(err)) {
			t.Errorf("VerifyBoot(%q, %q) = %v, want ok=%v", tt.asked, tt.reported, err, tt.ok)
		}
	}
}

func TestSplitRedfishAddress(t *testing.T) {
	tests := []struct {
		addr, want string
		ok         bool
	}{
		{"https://10.0.0.5", "https://10.0.0.5:443", true},
		{"10.0.0.5", "https://10.0.0.5:443", true},
		{"redfish+http://127.0.0.1:8000", "http://127.0.0.1:8000", true},
		{"http://[::1]:8000", "http://[::1]:8000", true},
		{"https://admin:pw@10.0.0.5", "", false},
		{"ftp://10.0.0.5", "", false},
		{"https://", "", false},
	}
	for _, tt := range tests {
		scheme, host, port, err := splitRedfishAddress(tt.addr)
		got := scheme + "://" + host + ":" + port
		if (err == nil) != tt.ok || (tt.ok && got != tt.want) {
			t.Errorf("splitRedfishAddress(%q) = %q, %v, want %q ok=%v", tt.addr, got, err, tt.want, tt.ok)
		}
	}
}

func TestSplitIPMIAddress(t *testing.T) {
	tests := []struct {
		addr, host, port string
		ok               bool
	}{
		{"10.0.0.5", "10.0.0.5", "623", true},
		{"10.0.0.5:6230", "10.0.0.5", "6230", true},
		{"ipmi://127.0.0.1:9001", "127.0.0.1", "9001", true},
		{"", "", "", false},
		{"http://x/y", "", "", false},
	}
	for _, tt := range tests {
		h, p, err := splitIPMIAddress(tt.addr)
		if (err == nil) != tt.ok || h != tt.host || p != tt.port {
			t.Errorf("splitIPMIAddress(%q) = %q, %q, %v, want %q, %q ok=%v", tt.addr, h, p, err, tt.host, tt.port, tt.ok)
		}
	}
}

func TestDialRejects(t *testing.T) {
	tests := []struct {
		name string
		ep   Endpoint
	}{
		{"no protocol", Endpoint{Address: "10.0.0.5"}},
		{"none", Endpoint{Protocol: "none"}},
		{"unknown protocol", Endpoint{Protocol: "amt", Address: "10.0.0.5"}},
		{"credentials in url", Endpoint{Protocol: ProtocolRedfish, Address: "https://root:hunter22@10.0.0.5", Password: "hunter22"}},
	}
	for _, tt := range tests {
		_, err := Dial(context.Background(), tt.ep, Options{})
		if !errdefs.IsInvalidArgument(err) {
			t.Errorf("Dial(%s) = %v, want InvalidArgument", tt.name, err)
		}
		if err != nil && tt.ep.Password != "" && contains(err.Error(), tt.ep.Password) {
			t.Errorf("Dial(%s) error shows the password: %v", tt.name, err)
		}
	}
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

func TestEndpointFromSpec(t *testing.T) {
	ep := EndpointFromSpec(&typesv1.BMCSpec{Protocol: "redfish", Address: "https://h", Username: "u", Password: "p", SystemId: "S1", InsecureSkipVerify: true})
	want := Endpoint{Protocol: "redfish", Address: "https://h", Username: "u", Password: "p", SystemID: "S1", InsecureSkipVerify: true}
	if ep != want {
		t.Errorf("EndpointFromSpec() = %+v, want %+v", ep, want)
	}
	if s := ep.String(); contains(s, "p@") || s != "redfish https://h" {
		t.Errorf("Endpoint.String() = %q", s)
	}
}

func TestRedact(t *testing.T) {
	basic := "Basic " + "a2lsbi1hZG1pbjpw" // base64("kiln-admin:p")
	tests := []struct {
		s, secret, want string
	}{
		// The password stands as a credential: removed.
		{`{"UserName":"kiln-admin","Password":"s3cret"}`, "s3cret", `{"UserName":"kiln-admin","Password":"<redacted>"}`},
		{`{"password" : "a\"b"}`, `a"b`, `{"password" : "<redacted>"}`},
		{`[{"error":"500: {\"Password\":\"s3cret\"}"}]`, "s3cret", `[{"error":"500: {\"Password\":\"<redacted>\"}"}]`},
		{"user=kiln-admin&password=s3cret&x=1", "s3cret", "user=kiln-admin&password=<redacted>&x=1"},
		{"https://root:s3cret@10.0.0.5/redfish/v1", "s3cret", "https://root:<redacted>@10.0.0.5/redfish/v1"},
		{"request was: {} basic=kiln-admin:s3cret", "s3cret", "request was: {} basic=kiln-admin:<redacted>"},
		{"Authorization: " + basic, "p", "Authorization: Basic <redacted>"},
		// The password is a substring of other words: left alone.
		{"Get https://127.0.0.1/redfish/v1/Systems: 401", "p", "Get https://127.0.0.1/redfish/v1/Systems: 401"},
		{"no resource at /redfish/v1/Managers", "redfish", "no resource at /redfish/v1/Managers"},
		{"401: invalid username or password", "password", "401: invalid username or password"},
		{"password=password", "password", "password=<redacted>"},
	}
	for _, tt := range tests {
		if got := redact(tt.s, "kiln-admin", tt.secret); got != tt.want {
			t.Errorf("redact(%q, %q) = %q, want %q", tt.s, tt.secret, got, tt.want)
		}
	}
}
