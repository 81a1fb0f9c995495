// Package promtest helps tests read Prometheus metrics the way a user's
// Prometheus does: scrape over HTTP, parse with the official text parser
// (prometheus/common/expfmt), look values up by name and labels, and lint
// the exposition with `promtool check metrics` when promtool is installed
// (Debian's prometheus package; hack/deps.sh installs it).
package promtest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kilnhq/kiln/internal/testenv"
)

// Scrape is one scrape: the exposition text and its parsed families.
type Scrape struct {
	Text     []byte
	Families map[string]*dto.MetricFamily
}

// Get scrapes url (http://host:port/metrics) as Prometheus would, asking
// for the text format, and parses the answer. It fails the test on any
// error.
func Get(t testing.TB, url string) *Scrape {
	t.Helper()
	return GetWith(t, http.DefaultClient, url)
}

// GetWith is Get through client (an mTLS client for an https:// url).
func GetWith(t testing.TB, client *http.Client, url string) *Scrape {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: HTTP %d: %s", url, resp.StatusCode, body)
	}
	return Parse(t, body)
}

// Parse parses exposition text.
func Parse(t testing.TB, text []byte) *Scrape {
	t.Helper()
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(text))
	if err != nil {
		t.Fatalf("parse metrics: %v\n%s", err, text)
	}
	return &Scrape{Text: text, Families: fams}
}

// Value is the value of the series of name whose labels include labels
// (pairs: "state", "Registering"), and whether there is exactly one such
// series. For a histogram it is the sample count.
func (s *Scrape) Value(name string, labels ...string) (float64, bool) {
	var found []float64
	for _, m := range s.Families[name].GetMetric() {
		if matches(m, labels) {
			found = append(found, value(m))
		}
	}
	if len(found) != 1 {
		return 0, false
	}
	return found[0], true
}

// Sum is the sum of the values of every series of name whose labels
// include labels (0 when none).
func (s *Scrape) Sum(name string, labels ...string) float64 {
	var sum float64
	for _, m := range s.Families[name].GetMetric() {
		if matches(m, labels) {
			sum += value(m)
		}
	}
	return sum
}

// Names are the metric family names of the scrape, sorted.
func (s *Scrape) Names() []string {
	var n []string
	for k := range s.Families {
		n = append(n, k)
	}
	sort.Strings(n)
	return n
}

func matches(m *dto.Metric, labels []string) bool {
	for i := 0; i+1 < len(labels); i += 2 {
		ok := false
		for _, l := range m.GetLabel() {
			if l.GetName() == labels[i] && l.GetValue() == labels[i+1] {
				ok = true
			}
		}
		if !ok {
			return false
		}
	}
	return true
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Histogram != nil:
		return float64(m.GetHistogram().GetSampleCount())
	case m.Summary != nil:
		return float64(m.GetSummary().GetSampleCount())
	}
	return m.GetUntyped().GetValue()
}

// Known are the series names s serves: its families' names, and the
// _bucket, _sum and _count series of its histograms, plus those of the
// histograms named in histograms (a histogram without an observation has
// no series in the text format, yet rules and dashboards may name it).
func (s *Scrape) Known(histograms ...string) map[string]bool {
	known := map[string]bool{}
	for n, f := range s.Families {
		known[n] = true
		if f.GetType() == dto.MetricType_HISTOGRAM {
			histograms = append(histograms, n)
		}
	}
	for _, n := range histograms {
		for _, suffix := range []string{"", "_bucket", "_sum", "_count"} {
			known[n+suffix] = true
		}
	}
	return known
}

var kilnNameRE = regexp.MustCompile(`\b(kiln_[a-z0-9_]+)`)

// Unknown are the kiln_* metric names in text (alert rules, a dashboard's
// queries) that are not in known, sorted.
func Unknown(text string, known map[string]bool) []string {
	seen := map[string]bool{}
	for _, m := range kilnNameRE.FindAllStringSubmatch(text, -1) {
		if !known[m[1]] {
			seen[m[1]] = true
		}
	}
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Promtool returns the path of promtool, or skips the test saying how to
// get it.
func Promtool(t testing.TB) string {
	t.Helper()
	return testenv.RequireTool(t, "promtool", "--no-install-recommends prometheus; hack/deps.sh does")
}

// CheckMetrics runs `promtool check metrics` on the exposition text and
// returns its output; it fails the test when promtool reports a problem.
// It skips when promtool is missing.
func CheckMetrics(t testing.TB, text []byte) string {
	t.Helper()
	out, err := run(Promtool(t), text, "check", "metrics")
	if err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
	return out
}

// CheckRules runs `promtool check rules` on the rule files; it fails the
// test when promtool refuses them. It skips when promtool is missing.
func CheckRules(t testing.TB, files ...string) string {
	t.Helper()
	out, err := run(Promtool(t), nil, append([]string{"check", "rules"}, files...)...)
	if err != nil {
		t.Errorf("promtool check rules: %v\n%s", err, out)
	}
	return out
}

func run(path string, stdin []byte, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w", path, strings.Join(args, " "), err)
	}
	return string(out), nil
}
