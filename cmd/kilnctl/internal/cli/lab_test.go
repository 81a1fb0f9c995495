package cli

import "testing"

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"512", 512, true},
		{"64K", 64 << 10, true},
		{"100m", 100 << 20, true},
		{"8G", 8 << 30, true},
		{"8GiB", 8 << 30, true},
		{"1T", 1 << 40, true},
		{"", 0, false},
		{"-1G", 0, false},
		{"lots", 0, false},
	}
	for _, tt := range tests {
		got, err := parseSize(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("parseSize(%q) = %d, %v, want %d (ok %v)", tt.in, got, err, tt.want, tt.ok)
		}
	}
}
