package store

import (
	"context"
	"log/slog"
	"slices"
	"sort"
	"sync/atomic"

	"go.uber.org/zap/zapcore"
)

// slogCore is a zapcore.Core that sends etcd's zap logs to the
// controller's slog logger, at or above a minimum level. Once the member
// is closing, it drops them: etcd reports its own listeners closing as
// errors.
type slogCore struct {
	log     *slog.Logger
	min     zapcore.Level
	fields  []zapcore.Field
	closing *atomic.Bool
}

var _ zapcore.Core = (*slogCore)(nil)

func (c *slogCore) Enabled(l zapcore.Level) bool { return l >= c.min && !c.closing.Load() }

func (c *slogCore) With(fs []zapcore.Field) zapcore.Core {
	cc := *c
	cc.fields = append(slices.Clip(c.fields), fs...)
	return &cc
}

func (c *slogCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c *slogCore) Write(e zapcore.Entry, fs []zapcore.Field) error {
	enc := zapcore.NewMapObjectEncoder()
	for _, f := range c.fields {
		f.AddTo(enc)
	}
	for _, f := range fs {
		f.AddTo(enc)
	}
	keys := make([]string, 0, len(enc.Fields))
	for k := range enc.Fields {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	attrs := make([]slog.Attr, 0, len(keys)+1)
	attrs = append(attrs, slog.String("logger", e.LoggerName))
	for _, k := range keys {
		attrs = append(attrs, slog.Any(k, enc.Fields[k]))
	}
	c.log.LogAttrs(context.Background(), slogLevel(e.Level), e.Message, attrs...)
	return nil
}

func (c *slogCore) Sync() error { return nil }

func slogLevel(l zapcore.Level) slog.Level {
	switch {
	case l <= zapcore.DebugLevel:
		return slog.LevelDebug
	case l == zapcore.InfoLevel:
		return slog.LevelInfo
	case l == zapcore.WarnLevel:
		return slog.LevelWarn
	}
	return slog.LevelError
}
