// Package logsample rate-limits repeated log lines: a line with a given key
// is written at most once per interval, with the count of the lines that were
// suppressed since the last one.
package logsample

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// Logger writes at most one line per key per interval. Safe for concurrent use.
type Logger struct {
	log      *slog.Logger
	interval time.Duration
	now      func() time.Time

	mu   sync.Mutex
	last map[string]entry // guarded by mu
}

type entry struct {
	at         time.Time
	suppressed int64
}

// New returns a Logger writing to log at most once per interval per key.
func New(log *slog.Logger, interval time.Duration) *Logger {
	if log == nil {
		log = slog.Default()
	}
	return &Logger{log: log, interval: interval, now: time.Now, last: map[string]entry{}}
}

// Log writes msg at level unless a line with the same key was written less
// than one interval ago.
func (l *Logger) Log(level slog.Level, key, msg string, args ...any) {
	now := l.now()
	l.mu.Lock()
	e, ok := l.last[key]
	if ok && now.Sub(e.at) < l.interval {
		e.suppressed++
		l.last[key] = e
		l.mu.Unlock()
		return
	}
	if len(l.last) > 10000 { // bound memory: keys are rule ids and error kinds
		l.last = map[string]entry{}
	}
	l.last[key] = entry{at: now}
	l.mu.Unlock()
	if e.suppressed > 0 {
		args = append(args, "suppressed", e.suppressed)
	}
	l.log.Log(context.Background(), level, msg, args...)
}
