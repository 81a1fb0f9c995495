package validation

import (
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// dnsSubdomain returns "" when s is a DNS-1123 subdomain (lowercase
// letters, digits, '-' and '.', each label starting and ending with a
// letter or digit, at most 253 characters), else what is wrong with it.
func dnsSubdomain(s string) string {
	if len(s) > 253 {
		return fmt.Sprintf("is %d characters long: use at most 253", len(s))
	}
	for _, label := range strings.Split(s, ".") {
		if msg := dnsLabel(label); msg != "" {
			return msg
		}
	}
	return ""
}

func dnsLabel(l string) string {
	const rule = "is not a DNS-1123 name: use lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
	if l == "" || len(l) > 63 {
		return rule
	}
	for i, c := range l {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c == '-' && i != 0 && i != len(l)-1:
		default:
			if c >= 'A' && c <= 'Z' {
				return rule + " (" + strconv.Quote(strings.ToLower(l)) + " would do)"
			}
			return rule
		}
	}
	return ""
}

// checkLabels checks Kubernetes-style label keys ([prefix/]name) and values.
func checkLabels(p *problems, field string, labels map[string]string) {
	for k, v := range labels {
		if msg := labelKey(k); msg != "" {
			p.add(field, "key %q %s", k, msg)
		}
		if v != "" && !labelName(v) {
			p.add(field+"."+k, "value %q is not a label value: use at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit", v)
		}
	}
}

func labelKey(k string) string {
	prefix, name, ok := strings.Cut(k, "/")
	if !ok {
		name, prefix = prefix, ""
	} else if msg := dnsSubdomain(prefix); msg != "" {
		return "has a prefix that " + msg
	}
	if !labelName(name) {
		return "is not a label key: use at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit, with an optional DNS prefix and '/'"
	}
	return ""
}

func labelName(s string) bool {
	if s == "" || len(s) > 63 {
		return false
	}
	for i, c := range s {
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if alnum {
			continue
		}
		if (c == '-' || c == '_' || c == '.') && i != 0 && i != len(s)-1 {
			continue
		}
		return false
	}
	return true
}

const errCredentialsInURL = "carries credentials: put them in spec.bmc.username and spec.bmc.password instead"

// carriesCredentials reports whether address a has a user-info part
// ("user:password@host", "https://user@host/..."): '@' before the first
// '/', '?' or '#' after any scheme. Such an address is refused without
// being quoted, whether or not it parses.
func carriesCredentials(a string) bool {
	if _, rest, ok := strings.Cut(a, "://"); ok {
		a = rest
	}
	if i := strings.IndexAny(a, "/?#"); i >= 0 {
		a = a[:i]
	}
	return strings.Contains(a, "@")
}

// redfishAddress accepts a URL with scheme https, http, redfish+https or
// redfish+http and a host, or a bare host[:port] (https is assumed).
func redfishAddress(a string) string {
	if !strings.Contains(a, "://") {
		if msg := hostPort(a, false); msg != "" {
			return msg + ": use a URL such as https://10.0.0.5"
		}
		return ""
	}
	u, err := url.Parse(a)
	if err != nil {
		return "is not a URL: use a URL such as https://10.0.0.5"
	}
	if u.User != nil {
		return errCredentialsInURL
	}
	switch u.Scheme {
	case "https", "http", "redfish+https", "redfish+http":
	default:
		return fmt.Sprintf("has scheme %q: use https (or http, redfish+https, redfish+http)", u.Scheme)
	}
	if u.Hostname() == "" {
		return "has no host: use a URL such as https://10.0.0.5"
	}
	if p := u.Port(); p != "" {
		if msg := port(p); msg != "" {
			return msg
		}
	}
	if u.User != nil {
		return errCredentialsInURL
	}
	return ""
}

// ipmiAddress accepts host or host:port.
func ipmiAddress(a string) string {
	if strings.Contains(a, "://") {
		return "is a URL: IPMI takes host or host:port, e.g. 10.0.0.5:623"
	}
	if msg := hostPort(a, false); msg != "" {
		return msg + ": IPMI takes host or host:port, e.g. 10.0.0.5:623"
	}
	return ""
}

// hostPort checks host[:port] (portRequired makes the port mandatory).
// The host is an IP address or a DNS name; IPv6 needs brackets with a port.
func hostPort(a string, portRequired bool) string {
	host, p, err := net.SplitHostPort(a)
	if err != nil {
		if portRequired {
			return "is not host:port, e.g. 10.0.0.10:6443"
		}
		host, p = a, ""
		if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
			host = host[1 : len(host)-1]
		}
	}
	if host == "" {
		return "has no host"
	}
	if _, err := netip.ParseAddr(host); err != nil {
		if msg := dnsSubdomain(strings.ToLower(host)); msg != "" {
			return "has a host that is neither an IP address nor a DNS name"
		}
	}
	if p != "" {
		return port(p)
	}
	return ""
}

func port(p string) string {
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > 65535 {
		return fmt.Sprintf("has port %q: use a number from 1 to 65535", p)
	}
	return ""
}

func macAddress(m string) string {
	hw, err := net.ParseMAC(m)
	if err != nil || len(hw) != 6 {
		return "is not a MAC address: use the form 52:54:00:12:34:56"
	}
	return ""
}

func httpURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "is not a URL: use http://... or https://..."
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Sprintf("has scheme %q: images are fetched over http or https", u.Scheme)
	}
	if u.Host == "" {
		return "has no host: use a URL such as http://images.example/debian12-k8s1.34.4-20261202.raw.zst"
	}
	return ""
}

func sha256Hex(s string) string {
	if strings.HasPrefix(s, "sha256:") {
		return "has a sha256: prefix: give the 64 hex digits alone"
	}
	if len(s) != 64 {
		return fmt.Sprintf("has %d characters: a sha256 is 64 hex digits", len(s))
	}
	for _, c := range s {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
			return fmt.Sprintf("has %q: a sha256 is 64 hex digits", c)
		}
	}
	return ""
}

// checkCIDR parses a CIDR field; an empty value is an error only when
// required. The prefix must be the network address.
func checkCIDR(p *problems, field, s string, required bool) (netip.Prefix, bool) {
	if s == "" {
		if required {
			p.add(field, "required: a CIDR such as 10.244.0.0/16")
		}
		return netip.Prefix{}, false
	}
	pfx, err := netip.ParsePrefix(s)
	if err != nil {
		p.add(field, "%q is not a CIDR: use the form 10.244.0.0/16", s)
		return netip.Prefix{}, false
	}
	if m := pfx.Masked(); m != pfx {
		p.add(field, "%q has host bits set: use %s", s, m)
		return netip.Prefix{}, false
	}
	if pfx.Bits() == 0 {
		p.add(field, "%q covers every address, the nodes' and the internet's too: use a range of its own such as 10.244.0.0/16", s)
		return netip.Prefix{}, false
	}
	return pfx, true
}

func checkDuration(p *problems, field, s string, zeroOK bool) {
	d, err := time.ParseDuration(s)
	switch {
	case err != nil:
		p.add(field, "%q is not a duration: use a Go duration such as 90s, 5m or 1h30m", s)
	case d < 0:
		p.add(field, "%q is negative: use a positive duration such as 5m", s)
	case d == 0 && !zeroOK:
		p.add(field, "%q is zero: use a positive duration such as 5m", s)
	}
}

// IntOrPercent is a count ("1") or a percentage ("25%").
type IntOrPercent struct {
	Value   int
	Percent bool
}

// String returns the form it was written in.
func (v IntOrPercent) String() string {
	if v.Percent {
		return strconv.Itoa(v.Value) + "%"
	}
	return strconv.Itoa(v.Value)
}

// Scaled returns the count v stands for out of total, rounding a
// percentage up when roundUp (maxSurge) and down otherwise
// (maxUnavailable, maxUnhealthy), as Kubernetes does.
func (v IntOrPercent) Scaled(total int, roundUp bool) int {
	if !v.Percent {
		return v.Value
	}
	n := v.Value * total
	if roundUp {
		return (n + 99) / 100
	}
	return n / 100
}

// ParseIntOrPercent parses "3" or "25%"; empty yields def. It returns an
// error naming the accepted forms.
func ParseIntOrPercent(s string, def IntOrPercent) (IntOrPercent, error) {
	if s == "" {
		return def, nil
	}
	num, pct := strings.CutSuffix(s, "%")
	n, err := strconv.Atoi(num)
	if err != nil || num == "" || strings.Trim(num, "0123456789") != "" || (pct && n > 100) {
		return IntOrPercent{}, fmt.Errorf("%q is not a count or a percentage: use a number such as 1 or a percentage from 0%% to 100%% such as 25%%", s)
	}
	return IntOrPercent{Value: n, Percent: pct}, nil
}

func checkIntOrPercent(p *problems, field, s string, def IntOrPercent) (IntOrPercent, bool) {
	v, err := ParseIntOrPercent(s, def)
	if err != nil {
		p.add(field, "%v", err)
		return v, false
	}
	return v, true
}

// Version is a Kubernetes release version vMAJOR.MINOR.PATCH.
type Version struct {
	Major, Minor, Patch int
}

func (v Version) String() string { return fmt.Sprintf("v%d.%d.%d", v.Major, v.Minor, v.Patch) }

// MinorString returns "vMAJOR.MINOR".
func (v Version) MinorString() string { return fmt.Sprintf("v%d.%d", v.Major, v.Minor) }

// Compare returns -1, 0 or +1 as v is older than, equal to or newer than w.
func (v Version) Compare(w Version) int {
	for _, d := range [...]int{v.Major - w.Major, v.Minor - w.Minor, v.Patch - w.Patch} {
		switch {
		case d < 0:
			return -1
		case d > 0:
			return 1
		}
	}
	return 0
}

// ParseVersion parses a pinned Kubernetes version "v1.34.4". Pre-release
// and build suffixes, "stable" and "latest" are refused: Kiln pins
// versions.
func ParseVersion(s string) (Version, error) {
	bad := fmt.Errorf("%q is not a pinned Kubernetes version: use the form v1.34.4", s)
	rest, ok := strings.CutPrefix(s, "v")
	if !ok {
		if _, err := ParseVersion("v" + s); err == nil {
			return Version{}, fmt.Errorf("%q is missing the leading v: use v%s", s, s)
		}
		return Version{}, bad
	}
	parts := strings.Split(rest, ".")
	if len(parts) != 3 {
		return Version{}, bad
	}
	var n [3]int
	for i, part := range parts {
		x, err := strconv.Atoi(part)
		if err != nil || part == "" || strings.Trim(part, "0123456789") != "" || (len(part) > 1 && part[0] == '0') {
			return Version{}, bad
		}
		n[i] = x
	}
	return Version{Major: n[0], Minor: n[1], Patch: n[2]}, nil
}
