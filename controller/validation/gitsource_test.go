package validation

import (
	"strings"
	"testing"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func gitSource(spec *typesv1.GitSourceSpec) *controllerv1.Resource {
	return &controllerv1.Resource{Kind: &controllerv1.Resource_GitSource{GitSource: &typesv1.GitSource{
		Metadata: &typesv1.ObjectMeta{Name: "fleet"}, Spec: spec,
	}}}
}

func TestValidateGitSource(t *testing.T) {
	tests := []struct {
		name string
		spec *typesv1.GitSourceSpec
		want string // substring of the error; "" means valid
	}{
		{"https", &typesv1.GitSourceSpec{Url: "https://git.example.com/fleet.git", Branch: "main", Path: "clusters/prod", Interval: "5m"}, ""},
		{"file", &typesv1.GitSourceSpec{Url: "file:///srv/git/fleet"}, ""},
		{"git on loopback", &typesv1.GitSourceSpec{Url: "git://127.0.0.1:9418/fleet"}, ""},
		{"url missing", &typesv1.GitSourceSpec{}, "spec.url: is required"},
		{"git remote", &typesv1.GitSourceSpec{Url: "git://git.example.com/fleet"}, "neither authenticated nor encrypted"},
		{"http remote", &typesv1.GitSourceSpec{Url: "http://git.example.com/fleet"}, "neither authenticated nor encrypted"},
		{"credentials", &typesv1.GitSourceSpec{Url: "https://bob:hunter2@git.example.com/fleet.git"}, "carries credentials"},
		{"ssh", &typesv1.GitSourceSpec{Url: "ssh://git@git.example.com/fleet.git"}, `scheme "ssh" is not supported`},
		{"relative file", &typesv1.GitSourceSpec{Url: "file://srv/fleet"}, "file:///absolute/path"},
		{"path escapes", &typesv1.GitSourceSpec{Url: "file:///srv/fleet", Path: "../etc"}, "relative path inside the repository"},
		{"absolute path", &typesv1.GitSourceSpec{Url: "file:///srv/fleet", Path: "/etc"}, "relative path inside the repository"},
		{"bad branch", &typesv1.GitSourceSpec{Url: "file:///srv/fleet", Branch: "a..b"}, "is not a branch name"},
		{"bad interval", &typesv1.GitSourceSpec{Url: "file:///srv/fleet", Interval: "soon"}, "is not a duration"},
		{"short interval", &typesv1.GitSourceSpec{Url: "file:///srv/fleet", Interval: "100ms"}, "shorter than 1s"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Validate(gitSource(tt.spec))
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("Validate(%v) = %v, want nil", tt.spec, err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("Validate(%v) = %v, want an error containing %q", tt.spec, err, tt.want)
			}
			if err != nil && strings.Contains(err.Error(), "hunter2") {
				t.Fatalf("Validate error quotes the password: %v", err)
			}
		})
	}
}
