package redisstore

import (
	"fmt"
	"time"
)

// Defaults.
const (
	DefaultBatchSize = 128
	DefaultWorkers   = 2
	DefaultTTLSlack  = time.Second
)

type options struct {
	activity *Activity
	batch    int
	workers  int
	clock    func() time.Time
	slack    time.Duration
	// slotLo, slotHi: WithMarkerSlots (slotHi 0: every slot)
	slotLo, slotHi int
}

// Option configures a Store.
type Option func(*options) error

// WithBatchSize sets how many pending checks one worker sends in one
// pipeline, at most. Default 128 (DefaultBatchSize); unit: checks.
func WithBatchSize(n int) Option {
	return func(o *options) error {
		if n < 1 {
			return fmt.Errorf("redisstore: batch size %d must be at least 1", n)
		}
		o.batch = n
		return nil
	}
}

// WithWorkers sets the number of pipelining goroutines, each with at most one
// pipeline in flight. Default 2 (DefaultWorkers); unit: goroutines. Two
// keep Redis (one thread) busy: it runs one pipeline while the other
// worker reads its replies and gathers the next. More workers send
// smaller pipelines (more round trips, more system calls per check, on
// both sides) for no more throughput.
func WithWorkers(n int) Option {
	return func(o *options) error {
		if n < 1 {
			return fmt.Errorf("redisstore: workers %d must be at least 1", n)
		}
		o.workers = n
		return nil
	}
}

// WithActivity makes the store hear Redis through a, whose Dialer the
// client's connections were dialed with (see Activity). Default nil: the
// store hears Redis when a pipeline completes.
func WithActivity(a *Activity) Option {
	return func(o *options) error {
		o.activity = a
		return nil
	}
}

// WithClock is for tests: the scripts use clock() (truncated to ms, passed
// as an argument; it must lie in [1970, MaxTime]) instead of Redis TIME. Default nil: Redis TIME, one clock
// for every enforcer of a region.
func WithClock(clock func() time.Time) Option {
	return func(o *options) error {
		o.clock = clock
		return nil
	}
}

// WithTTLSlack sets how much longer than the time a bucket needs to become
// full (or a window to end) its key lives. Default 1s (DefaultTTLSlack);
// unit: time, truncated to ms; every TTL is at least 1s in any case.
func WithTTLSlack(d time.Duration) Option {
	return func(o *options) error {
		if d < 0 || d > 24*time.Hour {
			return fmt.Errorf("redisstore: TTL slack %v must be in [0, 24h]", d)
		}
		o.slack = d
		return nil
	}
}
