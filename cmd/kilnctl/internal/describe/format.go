// Package describe is how kilnctl shows resources to a person: ages like
// kubectl's, host states by their short names, and the cluster tree of
// `kilnctl describe cluster`. The CLI writes it as text; `kilnctl
// dashboard` renders the same tree as HTML.
package describe

import (
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// HostState shows HOST_STATE_PROVISIONING as Provisioning, and
// HOST_STATE_UNSPECIFIED as "-".
func HostState(s typesv1.HostState) string {
	if s == typesv1.HostState_HOST_STATE_UNSPECIFIED {
		return "-"
	}
	name := strings.TrimPrefix(s.String(), "HOST_STATE_")
	return name[:1] + strings.ToLower(name[1:])
}

// Age formats the time since ts like kubectl: 42s, 5m, 3h, 2d; "-" when
// unknown. now is the injected clock.
func Age(ts *timestamppb.Timestamp, now time.Time) string {
	if ts == nil {
		return "-"
	}
	d := now.Sub(ts.AsTime())
	switch {
	case d < 0:
		return "0s"
	case d < 2*time.Minute:
		return strconv.Itoa(int(d.Seconds())) + "s"
	case d < 2*time.Hour:
		return strconv.Itoa(int(d.Minutes())) + "m"
	case d < 48*time.Hour:
		return strconv.Itoa(int(d.Hours())) + "h"
	}
	return strconv.Itoa(int(d.Hours()/24)) + "d"
}

// Dash is s, or "-" when s is empty.
func Dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// Clean puts s on one line: newlines and tabs become spaces.
func Clean(s string) string {
	return strings.NewReplacer("\n", " ", "\t", " ").Replace(s)
}
