package enrollment

import (
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/kilnhq/kiln/controller/validation"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// bootTokenRE and bootHostRE are what the boot server puts on a kernel
// command line (controller/bootserver tokenRE and hostRE).
var (
	bootTokenRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,256}$`)
	bootHostRE  = regexp.MustCompile(`^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$`)
)

// FuzzParseToken checks the enrollment token format: a token ParseToken
// accepts prints back as given and is one the boot server can put on a
// kernel command line; a refusal never quotes the input (it may be a
// mistyped secret).
func FuzzParseToken(f *testing.F) {
	for _, s := range []string{"abcdef.0123456789abcdef", "ABCDEF.0123456789abcdef", "abcdef.0123456789abcdef\n", "abcdef.0123456789abcdef rd.break", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tok, err := ParseToken(s)
		if err != nil {
			if len(s) >= 6 && strings.Contains(err.Error(), s) {
				t.Fatalf("ParseToken(%q) error quotes the input: %v", s, err)
			}
			return
		}
		if tok.String() != s || !bootTokenRE.MatchString(s) || len(tok.SecretHash()) != 64 {
			t.Fatalf("ParseToken(%q) = %+v: does not print back, or the boot server could not serve it", s, tok)
		}
	})
}

// FuzzCheckHostName checks that a host name enrollment accepts is one the
// API accepts as a Host's name and the boot server can boot, and the
// other way round: the three checks agree.
func FuzzCheckHostName(f *testing.F) {
	for _, s := range []string{"rack1-01", "a", "a.b-c.d", "-a", "a..b", "A", strings.Repeat("a", 64), strings.Repeat("a.", 127) + "a", "x_y"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		enrolls := checkHostName(name) == nil
		r := &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: &typesv1.Host{
			Metadata: &typesv1.ObjectMeta{Name: name}, Spec: &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: "none"}},
		}}}
		applies := true
		var verr *validation.Error
		if err := validation.Validate(r); errors.As(err, &verr) {
			for _, fe := range verr.Fields {
				if fe.Field == "metadata.name" {
					applies = false
				}
			}
		}
		if enrolls != applies {
			t.Fatalf("host name %q: enrollment accepts it %v, apply accepts it %v", name, enrolls, applies)
		}
		if enrolls && !bootHostRE.MatchString(name) {
			t.Fatalf("host name %q enrolls but the boot server refuses it", name)
		}
	})
}
