package validation_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/manifest"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// FuzzValidate checks resources of every kind, decoded from protobuf as
// the API receives them, with a fuzzed BMC address and password put on
// hosts. Properties:
//   - Validate never panics, and refuses only with a *validation.Error of
//     class InvalidArgument that names at least one field;
//   - the refusal never depends on the password's value (so it cannot
//     quote it): the same host with another non-empty password gets the
//     same message;
//   - an address carrying credentials (user:password@) is never quoted
//     back with them.
func FuzzValidate(f *testing.F) {
	files, err := filepath.Glob("../../examples/*.yaml")
	if err != nil || len(files) == 0 {
		f.Fatalf("no examples to seed from: %v", err)
	}
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		docs, err := manifest.Decode(p, b)
		if err != nil {
			f.Fatal(err)
		}
		for _, d := range docs {
			wire, err := proto.Marshal(d.Resource)
			if err != nil {
				f.Fatal(err)
			}
			bmc := d.Resource.GetHost().GetSpec().GetBmc()
			f.Add(wire, bmc.GetAddress(), bmc.GetPassword())
		}
	}
	f.Add([]byte{}, "https://admin:hunter2@10.0.0.5", "hunter2")
	f.Add([]byte{}, "admin:hunter2@10.0.0.5:623", "")
	f.Add([]byte{}, "https://admin:hunter%zz@10.0.0.5", "")

	f.Fuzz(func(t *testing.T, wire []byte, addr, password string) {
		r := &controllerv1.Resource{}
		if err := proto.Unmarshal(wire, r); err != nil {
			return
		}
		if h := r.GetHost(); h != nil || len(wire) == 0 {
			if h == nil {
				h = &typesv1.Host{Metadata: &typesv1.ObjectMeta{Name: "rack1-01"}, Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "redfish"}}}
				r.Kind = &controllerv1.Resource_Host{Host: h}
			}
			if h.Spec == nil {
				h.Spec = &typesv1.HostSpec{}
			}
			if h.Spec.Bmc == nil {
				h.Spec.Bmc = &typesv1.BMCSpec{}
			}
			h.Spec.Bmc.Address, h.Spec.Bmc.Password = addr, password
		}
		err := validation.Validate(r)
		if err == nil {
			return
		}
		var verr *validation.Error
		if !errors.As(err, &verr) {
			if r.GetKind() == nil {
				return // "resource has no kind"
			}
			t.Fatalf("Validate(%v) = %T %v, want *validation.Error", r, err, err)
		}
		if !errdefs.IsInvalidArgument(err) || len(verr.Fields) == 0 {
			t.Fatalf("Validate(%v) = %v: want class InvalidArgument naming a field", r, err)
		}
		msg := err.Error()
		h := r.GetHost()
		if h == nil {
			return
		}
		if pw := h.GetSpec().GetBmc().GetPassword(); pw != "" {
			other := proto.Clone(r).(*controllerv1.Resource)
			other.GetHost().Spec.Bmc.Password = "other-password"
			if pw == "other-password" {
				other.GetHost().Spec.Bmc.Password = "another-password"
			}
			if msg2 := errText(validation.Validate(other)); msg2 != msg {
				t.Fatalf("Validate's message depends on the password's value:\nwith %q: %s\nwith another: %s", pw, msg, msg2)
			}
		}
		if cred := addressCredentials(h.GetSpec().GetBmc().GetAddress()); cred != "" && strings.Contains(msg, cred) {
			t.Fatalf("Validate quotes the credentials %q of address %q: %s", cred, h.GetSpec().GetBmc().GetAddress(), msg)
		}
	})
}

// addressCredentials returns the user:password part of a BMC address
// ("https://admin:pw@host", "admin:pw@host:623"), or "".
func addressCredentials(addr string) string {
	_, rest, ok := strings.Cut(addr, "://")
	if !ok {
		rest = addr
	}
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		rest = rest[:i]
	}
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		return ""
	}
	userinfo := rest[:at]
	if _, pw, ok := strings.Cut(userinfo, ":"); ok && len(pw) >= 4 {
		return pw
	}
	return ""
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// FuzzParseVersion checks that a parsed version prints back to a string
// that parses to the same version, and that refusals say what to use.
func FuzzParseVersion(f *testing.F) {
	for _, s := range []string{"v1.34.4", "1.34.4", "v1.34", "v01.2.3", "v1.34.4-rc.1", "latest", "v9223372036854775807.0.0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		v, err := validation.ParseVersion(s)
		if err != nil {
			if !strings.Contains(err.Error(), "v1.34.4") && !strings.Contains(err.Error(), "missing the leading v") {
				t.Fatalf("ParseVersion(%q) error %q does not say what to use", s, err)
			}
			return
		}
		if v.String() != s {
			t.Fatalf("ParseVersion(%q).String() = %q: an accepted version prints differently", s, v.String())
		}
		if v.Major < 0 || v.Minor < 0 || v.Patch < 0 {
			t.Fatalf("ParseVersion(%q) = %+v: negative", s, v)
		}
		i, err := validation.ParseIntOrPercent(strings.TrimPrefix(s, "v"), validation.IntOrPercent{})
		if err == nil && (i.Value < 0 || i.Percent && i.Value > 100) {
			t.Fatalf("ParseIntOrPercent(%q) = %+v", s, i)
		}
	})
}
