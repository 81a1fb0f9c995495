package rootfs

import (
	"testing"
)

func TestKey(t *testing.T) {
	base := Spec{Packages: []string{"procps", "kmod"}}
	tests := []struct {
		name string
		spec Spec
		same bool
	}{
		{"package order", Spec{Packages: []string{"kmod", "procps"}}, true},
		{"duplicates", Spec{Packages: []string{"kmod", "procps", "kmod"}}, true},
		{"explicit defaults", Spec{Suite: "bookworm", Mirror: DefaultMirror, Packages: []string{"kmod", "procps"}}, true},
		{"cache dir", Spec{CacheDir: "/elsewhere", Packages: []string{"kmod", "procps"}}, true},
		{"other package", Spec{Packages: []string{"procps"}}, false},
		{"other suite", Spec{Suite: "trixie", Packages: []string{"kmod", "procps"}}, false},
		{"other mirror", Spec{Mirror: "http://127.0.0.1/debian", Packages: []string{"kmod", "procps"}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.spec.Key() == base.Key(); got != tt.same {
				t.Errorf("Key(%+v) == Key(%+v) = %v, want %v", tt.spec, base, got, tt.same)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		spec Spec
		ok   bool
	}{
		{Spec{}, true},
		{Spec{Packages: []string{"libstdc++6", "containerd"}}, true},
		{Spec{Packages: []string{"--allow-unauthenticated"}}, false},
		{Spec{Packages: []string{"a b"}}, false},
		{Spec{Packages: []string{"x;rm"}}, false},
		{Spec{Suite: "../x"}, false},
		{Spec{Mirror: "ftp://x"}, false},
	}
	for _, tt := range tests {
		if err := tt.spec.Validate(); (err == nil) != tt.ok {
			t.Errorf("Validate(%+v) = %v, want ok %v", tt.spec, err, tt.ok)
		}
	}
}
