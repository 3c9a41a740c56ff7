// Package log is the project's only door to logrus: packages log through
// an Entry carried in a context (G) or the standard one (L), with Fields
// naming the session, path and device, and use a Limiter for anything a
// peer can trigger at will (the kernel's rtrs_err_rl).
package log

import (
	"context"
	"io"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
)

// Entry and Fields are logrus's; call sites never import logrus.
type (
	Entry  = logrus.Entry
	Fields = logrus.Fields
	Level  = logrus.Level
)

// Levels.
const (
	ErrorLevel = logrus.ErrorLevel
	WarnLevel  = logrus.WarnLevel
	InfoLevel  = logrus.InfoLevel
	DebugLevel = logrus.DebugLevel
)

// L is the standard entry.
var L = logrus.NewEntry(logrus.StandardLogger())

type ctxKey struct{}

// WithLogger returns ctx carrying e.
func WithLogger(ctx context.Context, e *Entry) context.Context {
	return context.WithValue(ctx, ctxKey{}, e)
}

// G returns the entry carried by ctx, or L.
func G(ctx context.Context) *Entry {
	if e, ok := ctx.Value(ctxKey{}).(*Entry); ok {
		return e
	}
	return L
}

// SetLevel sets the standard logger's level.
func SetLevel(l Level) { logrus.SetLevel(l) }

// ParseLevel parses a level name.
func ParseLevel(s string) (Level, error) { return logrus.ParseLevel(s) }

// SetOutput sets where the standard logger writes.
func SetOutput(w io.Writer) { logrus.SetOutput(w) }

// SetJSON switches the standard logger to JSON lines.
func SetJSON() { logrus.SetFormatter(&logrus.JSONFormatter{}) }

// Discard returns an entry that logs nothing, for tests.
func Discard() *Entry {
	l := logrus.New()
	l.SetOutput(io.Discard)
	return logrus.NewEntry(l)
}

// Limiter lets Burst events through per Interval and counts the rest, so
// a hostile peer cannot flood the log. The zero value allows 10 per second.
// It is safe for concurrent use.
type Limiter struct {
	Interval time.Duration
	Burst    int

	mu sync.Mutex
	// +checklocks:mu
	start time.Time
	// +checklocks:mu
	n int
	// +checklocks:mu
	suppressed int
}

// Allow reports whether an event may be logged now, and how many were
// suppressed since the last one that was allowed.
func (l *Limiter) Allow() (ok bool, suppressed int) {
	interval, burst := l.Interval, l.Burst
	if interval <= 0 {
		interval = time.Second
	}
	if burst <= 0 {
		burst = 10
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	if now.Sub(l.start) >= interval {
		l.start, l.n = now, 0
	}
	if l.n >= burst {
		l.suppressed++
		return false, 0
	}
	l.n++
	s := l.suppressed
	l.suppressed = 0
	return true, s
}

// Log logs msg at level on e if the limiter allows it, noting how many
// messages were suppressed before it.
func (l *Limiter) Log(e *Entry, level Level, msg string) {
	ok, s := l.Allow()
	if !ok {
		return
	}
	if s > 0 {
		e = e.WithField("suppressed", s)
	}
	e.Log(level, msg)
}
