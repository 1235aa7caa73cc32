// Package usagetest publishes synthetic usage of one key for tests: what a
// region's enforcers would report to its sync agent for a steady load.
package usagetest

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/regional/usage"
	"github.com/nats-io/nats.go"
)

// Load is one synthetic enforcer: at every usage flush (usage.NextFlush,
// usage.DefaultInterval on the wall clock, as an enforcer flushes) it
// publishes a batch on its region's usage subject, with the usage of the
// interval, or empty when it has none (as an enforcer does, so that the
// agent can tell a late flush from an idle one).
type Load struct {
	mode atomic.Int32 // busy, idle or stalled
	quit chan struct{}
	done chan struct{}
	once atomic.Bool
}

const (
	busy int32 = iota
	idle
	stalled
)

// Start starts a Load of key under rule on region's usage subject on nc:
// perSecond requests a second in whole requests (a fraction is carried to
// the next flush), three quarters of them admitted. It runs until Stop or
// the end of the test.
func Start(tb testing.TB, nc *nats.Conn, region, rule, key string, perSecond float64) *Load {
	l := &Load{quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(l.done)
		var owed float64 // requests not published yet
		seq := uint64(0)
		for {
			select {
			case <-l.quit:
				return
			case <-time.After(time.Until(usage.NextFlush(time.Now(), usage.DefaultInterval))):
			}
			mode := l.mode.Load()
			if mode != idle {
				owed += perSecond * usage.DefaultInterval.Seconds()
			}
			if mode == stalled {
				continue // held, as by a NATS server that delivers nothing
			}
			b := usage.Batch{Region: region, Enforcer: "usagetest", Seq: seq + 1}
			if n := int64(owed); n > 0 {
				owed -= float64(n)
				b.Deltas = []usage.Delta{{Rule: rule, Key: key, Admitted: n - n/4, Rejected: n / 4}}
			}
			data, err := usage.Encode(b)
			if err != nil {
				tb.Errorf("usagetest: encode usage: %v", err)
				return
			}
			seq++
			nc.Publish(usage.Subject(region), data)
		}
	}()
	tb.Cleanup(l.Stop)
	return l
}

// Idle stops the requests: the Load goes on publishing, empty batches.
func (l *Load) Idle() { l.mode.Store(idle) }

// Busy resumes the requests (after Idle or Stall).
func (l *Load) Busy() { l.mode.Store(busy) }

// Stall publishes nothing while the requests go on, as a NATS server that
// stalls delivers nothing; the usage goes out with the first flush after
// Busy.
func (l *Load) Stall() { l.mode.Store(stalled) }

// Stop ends the Load (the enforcer is gone: nothing more is published) and
// waits for it.
func (l *Load) Stop() {
	if l.once.CompareAndSwap(false, true) {
		close(l.quit)
		<-l.done
	}
}

// Publish is Start, returning the Load's Stop.
func Publish(tb testing.TB, nc *nats.Conn, region, rule, key string, perSecond float64) (stop func()) {
	return Start(tb, nc, region, rule, key, perSecond).Stop
}
