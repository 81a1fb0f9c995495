// Package transcript replays the transcript tests of Kiln's planners, in
// the style of etcd raft's datadriven tests: a file holds blocks of one
// command line, a "----" line and the expected output, separated by blank
// lines; lines starting with "#" are comments kept with the next block.
// With update set, the files are rewritten with the actual output, to be
// reviewed as a diff.
package transcript

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Exec runs one command of a transcript and returns its output, ending in a
// newline (or empty).
type Exec func(t *testing.T, cmd string) string

// Run replays every file matching pattern as a subtest, each with a fresh
// Exec from newExec.
func Run(t *testing.T, pattern string, update bool, newExec func(t *testing.T) Exec) {
	t.Helper()
	files, err := filepath.Glob(pattern)
	require.NoError(t, err)
	require.NotEmpty(t, files, "no transcripts match %s", pattern)
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".txt"), func(t *testing.T) {
			raw, err := os.ReadFile(f)
			require.NoError(t, err)
			blocks := parse(t, string(raw))
			exec := newExec(t)
			var out strings.Builder
			for i, b := range blocks {
				got := exec(t, b.cmd)
				if !update && got != b.want {
					t.Errorf("%s:%d: %s\n got:\n%s\nwant:\n%s", f, b.line, b.cmd, got, b.want)
				}
				if i > 0 {
					out.WriteString("\n")
				}
				out.WriteString(b.comments)
				fmt.Fprintf(&out, "%s\n----\n%s", b.cmd, got)
			}
			if update {
				require.NoError(t, os.WriteFile(f, []byte(out.String()), 0o644))
			}
		})
	}
}

type block struct {
	comments string
	cmd      string
	want     string
	line     int
}

func parse(t *testing.T, s string) []block {
	var blocks []block
	lines := strings.Split(s, "\n")
	for i := 0; i < len(lines); {
		var b block
		for i < len(lines) && (strings.TrimSpace(lines[i]) == "" || strings.HasPrefix(lines[i], "#")) {
			if strings.HasPrefix(lines[i], "#") {
				b.comments += lines[i] + "\n"
			}
			i++
		}
		if i >= len(lines) {
			break
		}
		b.cmd, b.line = lines[i], i+1
		i++
		require.True(t, i < len(lines) && lines[i] == "----", "line %d: want ---- after the command", i+1)
		i++
		var want strings.Builder
		for i < len(lines) && lines[i] != "" {
			want.WriteString(lines[i] + "\n")
			i++
		}
		b.want = want.String()
		blocks = append(blocks, b)
	}
	return blocks
}
