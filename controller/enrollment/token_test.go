package enrollment

import (
	"strings"
	"testing"
)

func TestParseToken(t *testing.T) {
	tests := []struct {
		in   string
		ok   bool
		id   string
		secr string
	}{
		{"abcdef.0123456789abcdef", true, "abcdef", "0123456789abcdef"},
		{"ABCDEF.0123456789abcdef", false, "", ""},
		{"abcdef.0123456789abcde", false, "", ""},
		{"abcdef0123456789abcdef", false, "", ""},
		{"abcdef.0123456789abcdef\n", false, "", ""},
		{"", false, "", ""},
	}
	for _, tt := range tests {
		got, err := ParseToken(tt.in)
		if (err == nil) != tt.ok || got.ID != tt.id || got.Secret != tt.secr {
			t.Errorf("ParseToken(%q) = %+v, %v; want ok=%v id=%q", tt.in, got, err, tt.ok, tt.id)
		}
		if err != nil && tt.in != "" && strings.Contains(err.Error(), tt.in) {
			t.Errorf("ParseToken(%q) error repeats the token: %v", tt.in, err)
		}
	}
}

func TestNewTokenRoundTrips(t *testing.T) {
	seen := map[string]bool{}
	for range 200 {
		tok, err := NewToken()
		if err != nil {
			t.Fatalf("NewToken() error %v", err)
		}
		back, err := ParseToken(tok.String())
		if err != nil || back != tok {
			t.Fatalf("ParseToken(NewToken().String()) = %+v, %v; want %+v", back, err, tok)
		}
		if seen[tok.String()] {
			t.Fatalf("NewToken() repeated %s", tok.ID)
		}
		seen[tok.String()] = true
		if !tok.matches(tok.SecretHash()) {
			t.Fatalf("token does not match its own hash")
		}
		if tok.matches(Token{Secret: "0000000000000000"}.SecretHash()) {
			t.Fatalf("token matches another secret's hash")
		}
	}
}

func TestCheckHostName(t *testing.T) {
	tests := []struct {
		in string
		ok bool
	}{
		{"rack1-01", true},
		{"node.example.com", true},
		{"Rack1", false},
		{"-rack", false},
		{"rack_1", false},
		{"", false},
		{"a..b", false},
		{strings.Repeat("a", 64), false},
	}
	for _, tt := range tests {
		if err := checkHostName(tt.in); (err == nil) != tt.ok {
			t.Errorf("checkHostName(%q) = %v, want ok=%v", tt.in, err, tt.ok)
		}
	}
}
