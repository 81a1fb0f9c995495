// Package progress formats the byte progress of a long agent operation
// (an image lay, a wipe) for people: kilnctl's PROGRESS column and
// describe, and the lab's per-host progress lines. It reads no clock:
// callers pass now.
package progress

import (
	"fmt"
	"math"
	"strings"
	"time"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Bytes formats n in IEC units: "512 B", "1.5 KiB", "2.9 GiB".
func Bytes(n uint64) string {
	const unit = 1024
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB"}
	v, i := float64(n), 0
	for v >= unit && i < len(units)-1 {
		v /= unit
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s", v, units[i])
}

// Rate formats a rate in bytes per second ("85.3 MiB/s"); "" when it is
// not known (zero, negative, not a number).
func Rate(bps float64) string {
	if !(bps > 0) || math.IsInf(bps, 0) {
		return ""
	}
	return Bytes(uint64(math.Round(bps))) + "/s"
}

// ETA formats a time left like a countdown: "45s", "3m05s", "1h02m";
// "" when it is not known (zero, negative, not a number, or beyond a
// week, which a stalled rate gives and nobody can use).
func ETA(seconds float64) string {
	if !(seconds > 0) || seconds > 7*24*3600 {
		return ""
	}
	d := time.Duration(math.Ceil(seconds)) * time.Second
	h, m, s := int(d.Hours()), int(d.Minutes())%60, int(d.Seconds())%60
	switch {
	case h > 0:
		return fmt.Sprintf("%dh%02dm", h, m)
	case m > 0:
		return fmt.Sprintf("%dm%02ds", m, s)
	}
	return fmt.Sprintf("%ds", s)
}

// Known reports whether p says anything: a step or bytes.
func Known(p *typesv1.OperationProgress) bool {
	return p.GetStep() != "" || p.GetDoneBytes() > 0 || p.GetTotalBytes() > 0
}

// Short is the progress of p in a table cell: "fetch 42% 85.3 MiB/s ETA
// 20s", or with an unknown total "fetch 1.2 GiB 85.3 MiB/s"; "" when p
// says nothing.
func Short(p *typesv1.OperationProgress) string {
	if !Known(p) {
		return ""
	}
	parts := []string{}
	if p.GetStep() != "" {
		parts = append(parts, p.GetStep())
	}
	if p.GetTotalBytes() > 0 {
		parts = append(parts, fmt.Sprintf("%.0f%%", percent(p)))
	} else if p.GetDoneBytes() > 0 {
		parts = append(parts, Bytes(p.GetDoneBytes()))
	}
	if r := Rate(p.GetBytesPerSecond()); r != "" {
		parts = append(parts, r)
	}
	if e := ETA(p.GetEtaSeconds()); e != "" {
		parts = append(parts, "ETA "+e)
	}
	return strings.Join(parts, " ")
}

// Line is the progress of p in a sentence: "fetch: 1.2 GiB of 2.9 GiB
// (42%), 85.3 MiB/s, ETA 20s, reported 3s ago"; with an unknown total
// "fetch: 1.2 GiB of an unknown total, 85.3 MiB/s". The age of the report
// (p.updated, against now) is left out when unknown or under a second.
func Line(p *typesv1.OperationProgress, now time.Time) string {
	if !Known(p) {
		return ""
	}
	var b strings.Builder
	if p.GetStep() != "" {
		b.WriteString(p.GetStep() + ": ")
	}
	if p.GetTotalBytes() > 0 {
		fmt.Fprintf(&b, "%s of %s (%.0f%%)", Bytes(p.GetDoneBytes()), Bytes(p.GetTotalBytes()), percent(p))
	} else {
		fmt.Fprintf(&b, "%s of an unknown total", Bytes(p.GetDoneBytes()))
	}
	if r := Rate(p.GetBytesPerSecond()); r != "" {
		b.WriteString(", " + r)
	}
	if e := ETA(p.GetEtaSeconds()); e != "" {
		b.WriteString(", ETA " + e)
	}
	if u := p.GetUpdated(); u != nil {
		if ago := now.Sub(u.AsTime()).Truncate(time.Second); ago >= time.Second {
			fmt.Fprintf(&b, ", reported %s ago", ago)
		}
	}
	return b.String()
}

// percent is p's percent, from its bytes when it has none stored,
// capped at 100.
func percent(p *typesv1.OperationProgress) float64 {
	pct := p.GetPercent()
	if pct == 0 && p.GetTotalBytes() > 0 {
		pct = 100 * float64(p.GetDoneBytes()) / float64(p.GetTotalBytes())
	}
	return min(pct, 100)
}
