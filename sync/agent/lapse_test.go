package agent

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/redis/go-redis/v9"
)

const ms = time.Millisecond

// marker returns a renewal (or a Create) of inc 1 at seq with lease.
func marker(seq uint64, lease time.Duration, create bool) redisstore.Marker {
	return redisstore.Marker{Inc: 1, Seq: seq, Units: 10, Lease: lease, Create: create}
}

// write feeds t a write of m sent at sent and answered at done: applied
// (the store answers m's version), or not (it answers held's, or err).
func write(t *markerTrack, m redisstore.Marker, sent, done time.Duration, got redisstore.Version, err error) markerOutcome {
	return t.wrote(markerWrite{v: m.Version(), began: sent, sent: sent, done: done, lease: m.Lease}, m.Create, got, err)
}

func applied(t *markerTrack, m redisstore.Marker, sent, done time.Duration) markerOutcome {
	return write(t, m, sent, done, m.Version(), nil)
}

// TestMarkerTrack: the lapses found from the agent's clock around each
// marker write, for each way a renewal can come too late, and none for a
// renewal in time, one whose lapse is uncertain, or a Create.
func TestMarkerTrack(t *testing.T) {
	errTimeout := errors.New("i/o timeout")
	lease := time.Second
	short := 200 * ms // Interval + StoreTimeout: a shorter held lease is the ledger's deadline
	start := func() *markerTrack {
		tr := &markerTrack{short: short}
		if o := applied(tr, marker(1, lease, true), 0, 2*ms); o.lapse != nil || o.hasMargin {
			t.Fatalf("Create: %+v, want nothing", o)
		}
		return tr
	}
	t.Run("healthy", func(t *testing.T) {
		tr := start()
		for i := uint64(2); i < 50; i++ {
			at := time.Duration(i-1) * 100 * ms
			o := applied(tr, marker(i, lease, false), at, at+3*ms)
			if o.lapse != nil {
				t.Fatalf("renewal %d at %v: lapse %+v", i, at, *o.lapse)
			}
			// the held lease ends at 1 s after the last renewal's send at
			// the earliest: 100 ms before, answered 3 ms after this one's
			if want := lease - 100*ms - 3*ms; o.margin != want {
				t.Fatalf("renewal %d: margin %v, want %v", i, o.margin, want)
			}
		}
	})
	t.Run("late", func(t *testing.T) {
		tr := start()
		o := applied(tr, marker(2, lease, false), 1500*ms, 1505*ms)
		if o.lapse == nil || o.lapse.cause != LapseLate || o.lapse.late != 503*ms || o.lapse.call != 5*ms || o.lapse.gap != 1500*ms || o.lapse.lease != lease {
			t.Fatalf("renewal 1.5 s after a 1 s lease: %+v %+v, want late 503ms", o, o.lapse)
		}
		if o.margin != -505*ms {
			t.Fatalf("margin %v, want -505ms", o.margin)
		}
		if o := applied(tr, marker(3, lease, false), 1600*ms, 1601*ms); o.lapse != nil {
			t.Fatalf("the next renewal in time: %+v", *o.lapse)
		}
	})
	t.Run("in time", func(t *testing.T) {
		// answered before the latest end of the lease, after its earliest:
		// it may have come late; only the margin says so
		tr := start()
		o := applied(tr, marker(2, lease, false), 900*ms, 1002*ms)
		if o.lapse != nil || o.margin != -2*ms {
			t.Fatalf("%+v, want no lapse and margin -2ms", o)
		}
	})
	t.Run("slow store", func(t *testing.T) {
		// sent in time, applied: its answer came after the lease's end
		tr := start()
		o := applied(tr, marker(2, lease, false), 100*ms, 2500*ms)
		if o.lapse == nil || o.lapse.cause != LapseStore || o.lapse.late != 1498*ms || o.lapse.call != 2400*ms {
			t.Fatalf("%+v, want a store lapse 1.498s late", o.lapse)
		}
		if o := applied(tr, marker(3, lease, false), 2600*ms, 2601*ms); o.lapse != nil {
			t.Fatalf("the next renewal in time: %+v", *o.lapse)
		}
	})
	t.Run("failed", func(t *testing.T) {
		tr := start()
		lapses := 0
		var first *markerLapse
		seq := uint64(2)
		for at := 100 * ms; at < 2500*ms; at += 300 * ms { // each times out after 200 ms
			o := write(tr, marker(seq, lease, false), at, at+200*ms, redisstore.Version{}, errTimeout)
			seq++
			if o.lapse != nil {
				lapses++
				first = o.lapse
			}
		}
		o := applied(tr, marker(seq, lease, false), 2500*ms, 2502*ms)
		if o.lapse != nil {
			lapses++
		}
		if lapses != 1 || first == nil || first.cause != LapseStore {
			t.Fatalf("%d lapses (first %+v), want 1 of cause store", lapses, first)
		}
		// counted at the first answer after the lease's latest end (1.002 s):
		// the renewal sent at 1 s, answered at 1.2 s
		if first.late != 198*ms || first.gap != 1000*ms {
			t.Fatalf("lapse %+v, want late 198ms since_renewal 1s", *first)
		}
		if o.margin >= 0 {
			t.Fatalf("the renewal that applied at last: margin %v, want < 0", o.margin)
		}
	})
	t.Run("behind the share writes", func(t *testing.T) {
		// the flush began in time; the rule's share writes held the
		// marker's back past the lease: the store's doing
		tr := start()
		m := marker(2, lease, false)
		o := tr.wrote(markerWrite{v: m.Version(), began: 100 * ms, sent: 1500 * ms, done: 1501 * ms, lease: lease}, false, m.Version(), nil)
		if o.lapse == nil || o.lapse.cause != LapseStore || o.lapse.late != 499*ms {
			t.Fatalf("%+v, want a store lapse 499ms late", o.lapse)
		}
	})
	t.Run("failed then late", func(t *testing.T) {
		// a renewal that failed early and the next sent after the lease
		// ran out: the store had its chance
		tr := start()
		write(tr, marker(2, lease, false), 100*ms, 300*ms, redisstore.Version{}, errTimeout)
		o := applied(tr, marker(3, lease, false), 1500*ms, 1501*ms)
		if o.lapse == nil || o.lapse.cause != LapseStore {
			t.Fatalf("%+v, want a store lapse", o.lapse)
		}
	})
	t.Run("create", func(t *testing.T) {
		// a new incarnation (after a fence) or a Create of the same one
		// (its lease deadline passed): the ledger's doing, not counted
		tr := start()
		if o := write(tr, redisstore.Marker{Inc: 2, Seq: 1, Lease: lease, Create: true}, 5*time.Second, 5*time.Second+ms, redisstore.Version{Inc: 2, Seq: 1}, nil); o.lapse != nil {
			t.Fatalf("Create of a new incarnation: %+v", *o.lapse)
		}
		if o := write(tr, redisstore.Marker{Inc: 2, Seq: 2, Lease: lease}, 5100*ms, 5101*ms, redisstore.Version{Inc: 2, Seq: 2}, nil); o.lapse != nil || !o.hasMargin {
			t.Fatalf("renewal of the new incarnation: %+v", o)
		}
		tr = start()
		if o := applied(tr, marker(2, lease, true), 5*time.Second, 5*time.Second+ms); o.lapse != nil {
			t.Fatalf("Create of the same incarnation: %+v", *o.lapse)
		}
	})
	t.Run("zero lease", func(t *testing.T) {
		tr := &markerTrack{}
		applied(tr, marker(1, 0, true), 0, ms)
		if o := applied(tr, marker(2, lease, false), 500*ms, 501*ms); o.lapse != nil || o.hasMargin {
			t.Fatalf("after a zero lease: %+v", o)
		}
		if o := applied(tr, marker(3, lease, false), 2*time.Second, 2*time.Second+ms); o.lapse == nil {
			t.Fatal("a renewal 1.5 s after a 1 s lease: no lapse")
		}
	})
	t.Run("deadline", func(t *testing.T) {
		// The peers' acknowledgements stopped (a NATS partition): each
		// renewal's lease ends near the ledger's deadline, shorter each
		// time. The one whose lease cannot reach the next renewal lapses,
		// by the ledger's doing, whether the next renewal is answered
		// after the lease's end (the store's timing, seen before as
		// "store") or sent after it (as "late").
		for _, next := range []struct {
			name       string
			sent, done time.Duration
		}{{"answered after the end", 600 * ms, 700 * ms}, {"sent after the end", 700 * ms, 701 * ms}} {
			tr := start()
			leases := []time.Duration{900 * ms, 700 * ms, 500 * ms, 300 * ms, 150 * ms}
			for i, l := range leases {
				at := time.Duration(i+1) * 100 * ms
				if o := applied(tr, marker(uint64(i+2), l, false), at, at+ms); o.lapse != nil {
					t.Fatalf("%s: renewal %d (lease %v) in time: lapse %+v", next.name, i+2, l, *o.lapse)
				}
			}
			// held: sent at 500 ms, lease 150 ms: ends by 651 ms
			o := applied(tr, marker(7, 0, false), next.sent, next.done)
			if o.lapse == nil || o.lapse.cause != LapseDeadline || o.lapse.lease != 150*ms {
				t.Fatalf("%s: %+v, want a deadline lapse of the 150ms lease", next.name, o.lapse)
			}
		}
		// A store that fails while the lease is long is still the store's,
		// and a held lease of exactly short is not the deadline's.
		tr := start()
		applied(tr, marker(2, short, false), 100*ms, 101*ms)
		if o := write(tr, marker(3, lease, false), 250*ms, 400*ms, redisstore.Version{}, errTimeout); o.lapse == nil || o.lapse.cause != LapseStore {
			t.Fatalf("a lease of %v, its renewal failed: %+v, want a store lapse", short, o.lapse)
		}
	})
	t.Run("cluster fan-out", func(t *testing.T) {
		// A Cluster skips a renewal that changes only the lease while the
		// copies' lease is more than half left, and a fan-out that outlasts
		// the call goes on: the store answers the version its copies hold.
		tr := start()
		held := marker(1, lease, true).Version()
		if o := write(tr, marker(2, lease, false), 100*ms, 101*ms, held, nil); o.lapse != nil {
			t.Fatalf("skipped renewal: %+v", *o.lapse)
		}
		// renewal 3's fan-out answers after the budget; it applies later
		if o := write(tr, marker(3, lease, false), 600*ms, 700*ms, held, nil); o.lapse != nil {
			t.Fatalf("fan-out past the budget: %+v", *o.lapse)
		}
		o := write(tr, marker(4, lease, false), 1200*ms, 1201*ms, marker(3, lease, false).Version(), nil)
		if o.lapse != nil || tr.held.v.Seq != 3 || tr.held.sent != 600*ms {
			t.Fatalf("renewal 3 seen applied: %+v, held %+v", o, tr.held)
		}
		// held is 3 (its lease ends by 1.7 s): a renewal answered after
		// that, holding 3 still, finds its copies lapsed
		o = write(tr, marker(5, lease, false), 1750*ms, 1760*ms, marker(3, lease, false).Version(), nil)
		if o.lapse == nil || o.lapse.cause != LapseStore {
			t.Fatalf("copies' lease over: %+v, want a store lapse", o.lapse)
		}
	})
}

func TestMinWindow(t *testing.T) {
	w := newMinWindow(10 * time.Second)
	t0 := time.Now()
	if v := w.value(t0); !math.IsNaN(v) {
		t.Fatalf("empty: %v, want NaN", v)
	}
	w.observe(t0, 2)
	w.observe(t0.Add(time.Second), -0.5)
	w.observe(t0.Add(2*time.Second), 1)
	if v := w.value(t0.Add(3 * time.Second)); v != -0.5 {
		t.Fatalf("%v, want -0.5", v)
	}
	w.observe(t0.Add(12*time.Second), 3)
	if v := w.value(t0.Add(19 * time.Second)); v != -0.5 {
		t.Fatalf("the window before: %v, want -0.5", v)
	}
	if v := w.value(t0.Add(21 * time.Second)); v != 3 {
		t.Fatalf("two windows on: %v, want 3", v)
	}
	if v := w.value(t0.Add(45 * time.Second)); !math.IsNaN(v) {
		t.Fatalf("none lately: %v, want NaN", v)
	}
}

// logRecorder is a slog.Handler keeping every record's message and
// attributes (its own With ones too) as text.
type logRecorder struct {
	mu    *sync.Mutex
	lines *[]map[string]string
	attrs []slog.Attr
}

func newLogRecorder() logRecorder {
	return logRecorder{mu: &sync.Mutex{}, lines: &[]map[string]string{}}
}

func (h logRecorder) Enabled(context.Context, slog.Level) bool { return true }

func (h logRecorder) Handle(_ context.Context, r slog.Record) error {
	m := map[string]string{"msg": r.Message, "level": r.Level.String()}
	for _, a := range h.attrs {
		m[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool { m[a.Key] = a.Value.String(); return true })
	h.mu.Lock()
	*h.lines = append(*h.lines, m)
	h.mu.Unlock()
	return nil
}

func (h logRecorder) WithAttrs(as []slog.Attr) slog.Handler {
	h.attrs = append(append([]slog.Attr{}, h.attrs...), as...)
	return h
}

func (h logRecorder) WithGroup(string) slog.Handler { return h }

// find returns the records whose message contains msg and whose
// attributes include attrs.
func (h logRecorder) find(msg string, attrs map[string]string) []map[string]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []map[string]string
next:
	for _, l := range *h.lines {
		if !strings.Contains(l["msg"], msg) {
			continue
		}
		for k, v := range attrs {
			if l[k] != v {
				continue next
			}
		}
		out = append(out, l)
	}
	return out
}

// TestMarkerLapsesWithRedis: two regions on real Redis servers, a global
// rule between them (no fence: the witness keeps the leases). Healthy, no
// lapse is counted and the margin stays positive. Then region a's marker
// lapses without a fence twice, and each time the lapse is counted by its
// cause and logged, naming the rule: its agent's loop stalls for 2.5 leases
// (the renewal is sent late), and its Redis pauses writes for 2.5 leases
// (CLIENT PAUSE: renewals sent in time do not apply). Region b, healthy
// throughout, counts none.
func TestMarkerLapsesWithRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	servers := map[string]*testutil.Redis{}
	stores := map[string]*redisstore.Store{}
	logs := map[string]logRecorder{"a": newLogRecorder(), "b": newLogRecorder()}
	s := newStackOf(t, []string{"a", "b"}, func(n string) (Store, *memStore) {
		r := testutil.StartRedis(t)
		servers[n] = r
		return storeOn(t, redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1}), stores, n), nil
	}, func(c *Config) {
		c.Logger = slog.New(logs[c.Region]).With("region", c.Region)
		c.PeerKeys = testPeerKeys(t, "a", "b")
	})
	rule := globalRule()
	rule.Regions = map[string]float64{"a": 1, "b": 1}
	s.putRule(t, rule)
	s.waitIncarnations(t)
	a, b := s.regions["a"], s.regions["b"]
	lease := a.agent.cfg.Lease
	lapses := func(r *testRegion, cause string) float64 {
		v, ok := testutil.Metric(t, r.reg, "apportion_sync_marker_lapses_total", map[string]string{"cause": cause})
		if !ok {
			t.Fatalf("region %s: no apportion_sync_marker_lapses_total{cause=%q}", r.name, cause)
		}
		return v
	}
	margin := func(r *testRegion) float64 {
		v, ok := testutil.Metric(t, r.reg, "apportion_sync_marker_margin_seconds", nil)
		if !ok {
			t.Fatalf("region %s: no apportion_sync_marker_margin_seconds", r.name)
		}
		return v
	}
	noLapses := func(r *testRegion, when string) {
		t.Helper()
		for _, c := range lapseCauses {
			if n := lapses(r, c); n != 0 {
				t.Errorf("%s: region %s counted %v lapses (%s), want 0", when, r.name, n, c)
			}
		}
		if l := logs[r.name].find("marker lease lapsed", nil); len(l) > 0 {
			t.Errorf("%s: region %s logged %v", when, r.name, l)
		}
	}
	incs := map[string]uint64{"a": a.agent.Incarnation(testRule), "b": b.agent.Incarnation(testRule)}

	// Healthy: a few leases of renewals, none late.
	time.Sleep(3 * lease)
	for _, r := range []*testRegion{a, b} {
		noLapses(r, "healthy")
		if m := margin(r); !(m > 0 && m <= lease.Seconds()) {
			t.Errorf("healthy: region %s's margin %v s, want in (0, %v]", r.name, m, lease.Seconds())
		}
	}

	// a's loop stalls: its next renewal goes out 2.5 leases after the last.
	stall := lease * 5 / 2
	if err := a.agent.onLoop(context.Background(), func() { time.Sleep(stall) }); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*lease, "a's late renewal counted", func() bool { return lapses(a, LapseLate) >= 1 })
	l := logs["a"].find("marker lease lapsed", map[string]string{"rule": testRule, "cause": LapseLate, "level": "WARN"})
	if len(l) == 0 {
		t.Fatalf("no WARN log of the late renewal")
	}
	if late, err := time.ParseDuration(l[0]["late"]); err != nil || late < stall-lease-lease/2 || late > stall {
		t.Errorf("logged late %q (%v), want about %v", l[0]["late"], err, stall-lease)
	}
	if !strings.Contains(l[0]["hint"], "loop") || !strings.Contains(l[0]["hint"], "--lease") {
		t.Errorf("logged hint %q, want the loop and --lease", l[0]["hint"])
	}
	t.Logf("a's loop stalled %v: %v", stall, l[0])
	if m := margin(a); m > -(stall - lease - lease/2).Seconds() {
		t.Errorf("margin after the stall %v s, want below -%v", m, stall-lease-lease/2)
	}

	// a's Redis holds every write for 2.5 leases: renewals time out.
	ctx := context.Background()
	rc := redis.NewClient(&redis.Options{Addr: servers["a"].Addr})
	defer rc.Close()
	if err := rc.Do(ctx, "CLIENT", "PAUSE", stall.Milliseconds(), "WRITE").Err(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*lease, "a's renewals that did not apply counted", func() bool { return lapses(a, LapseStore) >= 1 })
	l = logs["a"].find("marker lease lapsed", map[string]string{"rule": testRule, "cause": LapseStore, "level": "WARN"})
	if len(l) == 0 {
		t.Fatalf("no WARN log of the renewals that did not apply")
	}
	if !strings.Contains(l[0]["hint"], "Redis") {
		t.Errorf("logged hint %q, want Redis", l[0]["hint"])
	}
	t.Logf("a's Redis paused %v: %v", stall, l[0])
	if n := lapses(a, LapseLate); n != 1 {
		t.Errorf("a counted %v late lapses, want the stall's 1", n)
	}

	// b was healthy throughout; neither fenced (a marker lapse is no fence).
	noLapses(b, "a's faults")
	for _, r := range []*testRegion{a, b} {
		if inc := r.agent.Incarnation(testRule); inc != incs[r.name] {
			t.Errorf("region %s's incarnation %d, was %d: it fenced", r.name, inc, incs[r.name])
		}
	}
}
