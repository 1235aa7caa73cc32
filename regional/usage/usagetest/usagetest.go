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

// Publish sends, every 50 ms until the returned stop is called (or the test
// ends), usage batches of key under rule to region's usage subject on nc:
// perSecond requests a second in whole requests (a fraction is carried to
// the next batch), three quarters of them admitted.
func Publish(tb testing.TB, nc *nats.Conn, region, rule, key string, perSecond float64) (stop func()) {
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(50 * time.Millisecond)
		defer tk.Stop()
		var owed float64
		seq := uint64(0)
		for {
			select {
			case <-quit:
				return
			case <-tk.C:
			}
			owed += perSecond / 20
			n := int64(owed)
			if n == 0 {
				continue
			}
			owed -= float64(n)
			seq++
			b, err := usage.Encode(usage.Batch{Region: region, Enforcer: "test", Seq: seq,
				Deltas: []usage.Delta{{Rule: rule, Key: key, Admitted: n - n/4, Rejected: n / 4}}})
			if err != nil {
				tb.Errorf("usagetest: encode usage: %v", err)
				return
			}
			nc.Publish(usage.Subject(region), b)
		}
	}()
	var once atomic.Bool
	stop = func() {
		if once.CompareAndSwap(false, true) {
			close(quit)
			<-done
		}
	}
	tb.Cleanup(stop)
	return stop
}
