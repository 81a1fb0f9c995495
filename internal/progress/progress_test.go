package progress_test

import (
	"math"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/progress"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

func TestBytesRateETA(t *testing.T) {
	for _, tc := range []struct {
		n    uint64
		want string
	}{{0, "0 B"}, {1023, "1023 B"}, {1536, "1.5 KiB"}, {3 << 30, "3.0 GiB"}} {
		if got := progress.Bytes(tc.n); got != tc.want {
			t.Errorf("Bytes(%d) = %q, want %q", tc.n, got, tc.want)
		}
	}
	for _, tc := range []struct {
		bps  float64
		want string
	}{{0, ""}, {-1, ""}, {math.NaN(), ""}, {math.Inf(1), ""}, {512, "512 B/s"}, {85.3 * (1 << 20), "85.3 MiB/s"}} {
		if got := progress.Rate(tc.bps); got != tc.want {
			t.Errorf("Rate(%v) = %q, want %q", tc.bps, got, tc.want)
		}
	}
	for _, tc := range []struct {
		s    float64
		want string
	}{{0, ""}, {-3, ""}, {math.NaN(), ""}, {8 * 24 * 3600, ""}, {0.2, "1s"}, {45, "45s"}, {185, "3m05s"}, {3720, "1h02m"}} {
		if got := progress.ETA(tc.s); got != tc.want {
			t.Errorf("ETA(%v) = %q, want %q", tc.s, got, tc.want)
		}
	}
}

func TestShortAndLine(t *testing.T) {
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name      string
		p         *typesv1.OperationProgress
		short     string
		line      string
		wantEmpty bool
	}{
		{name: "nothing", p: nil, wantEmpty: true},
		{name: "empty", p: &typesv1.OperationProgress{}, wantEmpty: true},
		{
			name:  "fetch with total, rate and ETA",
			p:     &typesv1.OperationProgress{Step: "fetch", DoneBytes: 1288490189, TotalBytes: 3113851290, Percent: 41.4, BytesPerSecond: 85.3 * (1 << 20), EtaSeconds: 20.4, Updated: timestamppb.New(now.Add(-3 * time.Second))},
			short: "fetch 41% 85.3 MiB/s ETA 21s",
			line:  "fetch: 1.2 GiB of 2.9 GiB (41%), 85.3 MiB/s, ETA 21s, reported 3s ago",
		},
		{
			name:  "unknown total",
			p:     &typesv1.OperationProgress{Step: "fetch", DoneBytes: 5 << 20, BytesPerSecond: 1 << 20, Updated: timestamppb.New(now)},
			short: "fetch 5.0 MiB 1.0 MiB/s",
			line:  "fetch: 5.0 MiB of an unknown total, 1.0 MiB/s",
		},
		{
			name:  "rate not known yet",
			p:     &typesv1.OperationProgress{Step: "open"},
			short: "open",
			line:  "open: 0 B of an unknown total",
		},
		{
			name:  "done: percent from bytes, no rate at the step's start",
			p:     &typesv1.OperationProgress{Step: "done", DoneBytes: 8 << 20, TotalBytes: 8 << 20},
			short: "done 100%",
			line:  "done: 8.0 MiB of 8.0 MiB (100%)",
		},
		{
			name:  "more done than total is capped",
			p:     &typesv1.OperationProgress{Step: "sync", DoneBytes: 9 << 20, TotalBytes: 8 << 20, Percent: 112.5},
			short: "sync 100%",
			line:  "sync: 9.0 MiB of 8.0 MiB (100%)",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, l := progress.Short(tt.p), progress.Line(tt.p, now)
			if tt.wantEmpty {
				if s != "" || l != "" || progress.Known(tt.p) {
					t.Errorf("Short, Line, Known(%v) = %q, %q, %t; want empty", tt.p, s, l, progress.Known(tt.p))
				}
				return
			}
			if s != tt.short {
				t.Errorf("Short(%v) = %q, want %q", tt.p, s, tt.short)
			}
			if l != tt.line {
				t.Errorf("Line(%v) = %q, want %q", tt.p, l, tt.line)
			}
		})
	}
}
