package redisstore

import (
	"syscall"
	"testing"
	"time"
)

// TestLateMarkerWriteKeepsItsLeaseEnd: a marker write that Redis runs late
// (here the server is stopped, SIGSTOP, for 1.5 s between WriteMarker's
// read of its clock and the write) gets no lease beyond the server's clock
// before the write plus the lease. The ledger sizes a lease assuming the
// write is in effect within StoreTimeout of being issued; uncapped, the
// late write would keep the region's share 1.5 s past that, while peers
// may already have reclaimed it.
func TestLateMarkerWriteKeepsItsLeaseEnd(t *testing.T) {
	e := newEnv(t, true)
	ctx := ctxT(t)
	run, err := e.store.RunID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const lease = 3 * time.Second
	const stall = 1500 * time.Millisecond
	var anchor int64
	markerAnchored = func() {
		tm, err := e.client.Time(ctx).Result() // just after WriteMarker's own read
		if err != nil {
			t.Error(err)
			return
		}
		anchor = tm.UnixMilli()
		pid := e.redis.PID()
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Error(err)
			return
		}
		time.AfterFunc(stall, func() { syscall.Kill(pid, syscall.SIGCONT) })
	}
	defer func() { markerAnchored = nil }()
	if _, err := e.store.WriteMarker(ctx, "r", Marker{Inc: 1, Seq: 1, Units: 500_000, Lease: lease, Create: true, RunID: run}); err != nil {
		t.Fatal(err)
	}
	raw, err := e.client.Get(ctx, MarkerKey("r")).Result()
	if err != nil {
		t.Fatal(err)
	}
	var v [5]int64
	for i := range v {
		for j := 5; j >= 0; j-- {
			v[i] = v[i]<<8 | int64(raw[6*i+j])
		}
	}
	at, exp := v[3], v[4]
	if at-anchor < stall.Milliseconds()/2 {
		t.Fatalf("the write applied %d ms after the clock read, want about %v (the stall did not delay it)", at-anchor, stall)
	}
	if exp > anchor+lease.Milliseconds() {
		t.Fatalf("a write applied %d ms late ends its lease at %d, %d ms past the clock read before it plus the lease", at-anchor, exp, exp-anchor-lease.Milliseconds())
	}
	t.Logf("applied %d ms after the clock read; lease ends %d ms after it (lease %v)", at-anchor, exp-anchor, lease)
}
