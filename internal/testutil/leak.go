package testutil

import (
	"bytes"
	"runtime"
	"runtime/pprof"
	"testing"
	"time"
)

// CheckGoroutines fails the test if, once every later cleanup has run, more
// goroutines are alive than when it was called. Call it first in a test of
// a long-lived object (cleanups run last-in first-out, so this check runs
// after the object and the servers it used were closed). Goroutines wind
// down asynchronously, so it polls for up to 5 seconds before failing with
// a dump of every goroutine.
func CheckGoroutines(tb testing.TB) {
	tb.Helper()
	base := runtime.NumGoroutine()
	tb.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		n := runtime.NumGoroutine()
		for n > base && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond) // polling the count: there is no event to wait on
			n = runtime.NumGoroutine()
		}
		if n > base {
			var buf bytes.Buffer
			pprof.Lookup("goroutine").WriteTo(&buf, 1)
			tb.Errorf("testutil: %d goroutines leaked (%d at start, %d now):\n%s", n-base, base, n, buf.String())
		}
	})
}
