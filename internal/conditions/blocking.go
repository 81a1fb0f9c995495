package conditions

import (
	"sort"
	"strings"
	"unicode/utf8"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Negative reports whether condition type t names a problem, so that
// True is the bad status: "BootstrapFailed", "ImagePullError".
func Negative(t string) bool {
	return strings.HasSuffix(t, "Failed") || strings.HasSuffix(t, "Error")
}

// IsBlocking reports whether c says its object cannot progress: False,
// or True for a Negative type. Unknown is not blocking: nothing is known
// to be wrong yet.
func IsBlocking(c *typesv1.Condition) bool {
	if Negative(c.GetType()) {
		return c.GetStatus() == True
	}
	return c.GetStatus() == False
}

// Blocking returns the blocking conditions of list, the most telling
// first: by severity (Error, Warning, then the rest), and within one
// severity the specific conditions before Ready, which only sums them
// up; otherwise in list order. It returns nil when nothing blocks.
func Blocking(list []*typesv1.Condition) []*typesv1.Condition {
	var out []*typesv1.Condition
	for _, c := range list {
		if IsBlocking(c) {
			out = append(out, c)
		}
	}
	rank := func(c *typesv1.Condition) int {
		r := 0
		switch c.GetSeverity() {
		case "Error":
		case "Warning":
			r = 2
		default:
			r = 4
		}
		if c.GetType() == "Ready" {
			r++
		}
		return r
	}
	sort.SliceStable(out, func(i, j int) bool { return rank(out[i]) < rank(out[j]) })
	return out
}

// Summary returns "Reason: message" of c with the message cut to max
// runes (an ellipsis marks the cut; max <= 0 keeps it whole), on one
// line. A condition without a reason is named "Type=Status". Summary(nil)
// is "".
func Summary(c *typesv1.Condition, max int) string {
	if c == nil {
		return ""
	}
	reason := c.GetReason()
	if reason == "" {
		reason = c.GetType() + "=" + c.GetStatus()
	}
	msg := strings.Join(strings.Fields(c.GetMessage()), " ")
	if msg == "" {
		return reason
	}
	if max > 0 && utf8.RuneCountInString(msg) > max {
		r := []rune(msg)
		msg = strings.TrimRight(string(r[:max-1]), " ") + "…"
	}
	return reason + ": " + msg
}
