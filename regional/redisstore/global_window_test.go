package redisstore

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// The global windows of the contract cases: 100 requests per minute in
// 1000 units (10 units = 1 request), floor 100 units (10 requests).
const (
	gwLimit = 100
	gwWin   = time.Minute
	gwMs    = int64(gwWin / time.Millisecond)
)

// gw0 is the start of a window (t0 is not aligned to a minute).
var gw0 = (t0/gwMs + 1) * gwMs

func globalWindow(alg rules.Algorithm, rule, key string) Bucket {
	return Bucket{Key: key, Algorithm: alg, Limit: gwLimit, Window: gwWin, Global: &Global{Rule: rule, Units: gUnits, Floor: gFloor}}
}

func windowRecord(alg rules.Algorithm, key string, inc, seq uint64, units int64) ShareRecord {
	return ShareRecord{Key: key, Inc: inc, Seq: seq, Units: units, Algorithm: alg, Limit: gwLimit, Window: gwWin,
		Total: gUnits, Floor: gFloor, TTL: time.Minute}
}

// take checks n single requests at nowMs and returns how many were allowed
// and the last result.
func take(t *testing.T, im impl, nowMs int64, b Bucket, n int) (int, Result) {
	t.Helper()
	var ok int
	var last Result
	for i := 0; i < n; i++ {
		a, res := im.check(t, nowMs, 1, b)
		if a {
			ok++
		}
		last = res[0]
	}
	return ok, last
}

var globalWindowCases = []struct {
	name string
	run  func(t *testing.T, im impl, alg rules.Algorithm, key func(string) string, rule string)
}{
	{"no marker: the floor's share of the limit", func(t *testing.T, im impl, alg rules.Algorithm, key func(string) string, rule string) {
		b := globalWindow(alg, rule, key("a"))
		if ok, last := take(t, im, gw0, b, 12); ok != 10 || last.Limit != 10 || last.Allowed {
			t.Fatalf("admitted %d (last %+v), want 10 of a 10 allowance", ok, last)
		}
	}},
	{"marker default, then a record; a raise applies at once", func(t *testing.T, im impl, alg rules.Algorithm, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, 10*time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, gw0, rule, m)
		b := globalWindow(alg, rule, key("a"))
		if ok, _ := take(t, im, gw0, b, 31); ok != 30 {
			t.Fatalf("marker default 300 units: admitted %d, want 30", ok)
		}
		if v := im.shares(t, gw0+1, rule, windowRecord(alg, b.Key, 1, 2, 600)); v[0] != (Version{1, 2}) {
			t.Fatalf("raise: store holds %v", v)
		}
		if ok, last := take(t, im, gw0+2, b, 31); ok != 30 || last.Limit != 60 {
			t.Fatalf("after the raise to 600: admitted %d more (last %+v), want 30 of 60", ok, last)
		}
		if !im.persistent(t, gw0+2, b.Key) {
			t.Fatal("a key with a record that is not a Release record has a TTL")
		}
	}},
	{"a lowering below the use of the window is refused; within it, applied", func(t *testing.T, im impl, alg rules.Algorithm, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, 10*time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, gw0, rule, m)
		b := globalWindow(alg, rule, key("a"))
		im.shares(t, gw0, rule, windowRecord(alg, b.Key, 1, 2, 600))
		if ok, _ := take(t, im, gw0, b, 50); ok != 50 {
			t.Fatalf("admitted %d of 50", ok)
		}
		// 400 units allow 40 < 50 used: the key keeps version (1, 2) and 60
		if v := im.shares(t, gw0+1, rule, windowRecord(alg, b.Key, 1, 3, 400)); v[0] != (Version{1, 2}) {
			t.Fatalf("lowering below the use: store holds %v, want (1, 2)", v)
		}
		if _, last := take(t, im, gw0+1, b, 1); last.Limit != 60 {
			t.Fatalf("after a refused lowering the key enforces %d, want 60", last.Limit)
		}
		// 510 units allow 51 >= 51 used: applied; nothing more fits
		if v := im.shares(t, gw0+2, rule, windowRecord(alg, b.Key, 1, 4, 510)); v[0] != (Version{1, 4}) {
			t.Fatalf("lowering to the use: store holds %v, want (1, 4)", v)
		}
		if ok, last := take(t, im, gw0+2, b, 1); ok != 0 || last.Limit != 51 {
			t.Fatalf("after the lowering to 510: admitted %d, limit %d, want 0, 51", ok, last.Limit)
		}
		// a record of no marker's incarnation counts at the floor (10 < 51): refused
		if v := im.shares(t, gw0+3, rule, windowRecord(alg, b.Key, 2, 1, 900)); v[0] != (Version{1, 4}) {
			t.Fatalf("record of another incarnation: store holds %v, want (1, 4)", v)
		}
		// once the use has left the window, the lowering to 100 applies
		later := gw0 + gwMs // fixed: a new window; sliding: the old one still weighs 1
		if alg == rules.SlidingWindow {
			later = gw0 + 2*gwMs
		}
		if v := im.shares(t, later, rule, windowRecord(alg, b.Key, 1, 5, 100)); v[0] != (Version{1, 5}) {
			t.Fatalf("lowering in a later window: store holds %v, want (1, 5)", v)
		}
		if ok, last := take(t, im, later, b, 11); ok != 10 || last.Limit != 10 {
			t.Fatalf("after the lowering to 100: admitted %d (limit %d), want 10", ok, last.Limit)
		}
	}},
	{"a lapsed lease enforces the floor; a Release record may expire", func(t *testing.T, im impl, alg rules.Algorithm, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, time.Second)
		m.RunID = im.runID(t)
		im.marker(t, gw0, rule, m)
		b := globalWindow(alg, rule, key("a"))
		rec := windowRecord(alg, b.Key, 1, 2, 600)
		rec.Release = true
		im.shares(t, gw0, rule, rec)
		if im.persistent(t, gw0, b.Key) {
			t.Fatal("a Release record is persistent")
		}
		if ok, _ := take(t, im, gw0, b, 5); ok != 5 {
			t.Fatalf("admitted %d of 5", ok)
		}
		if ok, last := take(t, im, gw0+1000, b, 10); ok != 5 || last.Limit != 10 {
			t.Fatalf("lease over: admitted %d more (limit %d), want 5 more up to the floor's 10", ok, last.Limit)
		}
	}},
}

func TestGlobalWindowContract(t *testing.T) {
	forEachImpl(t, func(t *testing.T, im impl) { runGlobalWindowCases(t, im) })
}

func TestGlobalWindowContractMiniredis(t *testing.T) {
	forEachMiniImpl(t, func(t *testing.T, im impl) { runGlobalWindowCases(t, im) })
}

func runGlobalWindowCases(t *testing.T, im impl) {
	for _, alg := range []rules.Algorithm{rules.FixedWindow, rules.SlidingWindow} {
		for i, tc := range globalWindowCases {
			t.Run(string(alg)+"/"+tc.name, func(t *testing.T) {
				rule := fmt.Sprintf("gw-%s-%d", alg, i)
				key := func(s string) string { return Key(s, rule) }
				tc.run(t, im, alg, key, rule)
			})
		}
	}
}

// TestSlidingWindowLoweringFollowsTheEstimate: a sliding window's use is its
// estimate, which falls as the previous window slides out, so a lowering
// refused at the start of a window applies once enough has slid out.
func TestSlidingWindowLoweringFollowsTheEstimate(t *testing.T) {
	forEachImpl(t, func(t *testing.T, im impl) {
		rule := "gw-slide"
		m := create(im, 1, 1, 600, 10*time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, gw0, rule, m)
		b := globalWindow(rules.SlidingWindow, rule, Key("a", rule))
		if ok, _ := take(t, im, gw0, b, 60); ok != 60 {
			t.Fatalf("admitted %d of 60", ok)
		}
		// next window, 0 in: estimate 60 > 30 (300 units)
		if v := im.shares(t, gw0+gwMs, rule, windowRecord(rules.SlidingWindow, b.Key, 1, 2, 300)); v[0] != (Version{}) {
			t.Fatalf("store holds %v, want none", v)
		}
		// half-way: estimate 60*30s/60s = 30 <= 30: applied
		if v := im.shares(t, gw0+gwMs+gwMs/2, rule, windowRecord(rules.SlidingWindow, b.Key, 1, 2, 300)); v[0] != (Version{1, 2}) {
			t.Fatalf("store holds %v, want (1, 2)", v)
		}
	})
}

func TestGlobalWindowValidation(t *testing.T) {
	m := NewModel(0)
	bad := []ShareRecord{
		{Key: "k", Total: 10, Algorithm: rules.FixedWindow, Limit: 0, Window: time.Second},
		{Key: "k", Total: 10, Algorithm: rules.FixedWindow, Limit: 1, Window: 0},
		{Key: "k", Total: 10, Algorithm: rules.SlidingWindow, Limit: 1, Window: time.Microsecond},
		{Key: "k", Total: 10, Algorithm: rules.SlidingWindow, Limit: MaxLimit, Window: time.Hour},
		{Key: "k", Total: 10, Algorithm: rules.SlidingLog, Limit: 1, Window: time.Second},
	}
	for i, r := range bad {
		if _, err := m.WriteShares(t0, "g", []ShareRecord{r}); err == nil {
			t.Errorf("bad[%d] accepted", i)
		}
	}
	mixed := []ShareRecord{windowRecord(rules.FixedWindow, "a", 1, 1, 1), record("g", "b", 1, 1, 1)}
	if _, err := m.WriteShares(t0, "g", mixed); err == nil {
		t.Error("records of two algorithms in one call accepted")
	}
	if err := ValidateBucket(Bucket{Algorithm: rules.SlidingLog, Limit: 1, Window: time.Second, Global: &Global{Rule: "g", Units: 1}}); err == nil {
		t.Error("a global sliding log accepted")
	}
	if err := ValidateBucket(globalWindow(rules.FixedWindow, "g", "k")); err != nil {
		t.Errorf("a global fixed window refused: %v", err)
	}
}

// TestWindowRefusalAnswer: a refused record answers the fewest units the
// key can take (50 used of 100 per window in 1000 units: 500) and the time
// until the window ends, on redis-server as in the model.
func TestWindowRefusalAnswer(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	m := NewModel(0)
	for _, alg := range []rules.Algorithm{rules.FixedWindow, rules.SlidingWindow} {
		rule := "gw-answer-" + string(alg)
		b := globalWindow(alg, rule, Key("a", rule))
		for _, im := range []impl{modelImpl{m}, redisImpl{e}} {
			mk := create(im, 1, 1, 600, 10*time.Minute)
			mk.RunID = im.runID(t)
			im.marker(t, gw0, rule, mk)
			take(t, im, gw0, b, 50)
		}
		e.clock.ms.Store(gw0 + 1)
		got, err := e.store.WriteWindowShares(ctx, rule, []ShareRecord{windowRecord(alg, b.Key, 1, 2, 400)})
		if err != nil {
			t.Fatal(err)
		}
		want := []WindowApplied{{Need: 500, Until: gwWin - time.Millisecond}}
		if got[0] != want[0] {
			t.Fatalf("%s: redis answers %+v, want %+v", alg, got[0], want[0])
		}
		if mg, _ := m.WriteWindowShares(gw0+1, rule, []ShareRecord{windowRecord(alg, b.Key, 1, 2, 400)}); mg[0] != want[0] {
			t.Fatalf("%s: model answers %+v, want %+v", alg, mg[0], want[0])
		}
		if _, err := e.store.WriteWindowShares(ctx, rule, []ShareRecord{record(rule, b.Key, 1, 3, 1)}); err == nil {
			t.Fatal("WriteWindowShares took a token-bucket record")
		}
	}
}

// TestGlobalWindowSumNeverAboveLimit: three regions' stores (Models) hold
// one global window key of 100 per minute in 1000 units; random admissions,
// clock moves and gifts that follow the ledger's order (the giver lowers
// first; on a refusal it gives only what the answer allows; the receiver
// raises once the lowering applied). After every step the regions' uses of
// their current windows sum to at most the limit, and the gifts move units.
func TestGlobalWindowSumNeverAboveLimit(t *testing.T) {
	for _, alg := range []rules.Algorithm{rules.FixedWindow, rules.SlidingWindow} {
		t.Run(string(alg), func(t *testing.T) {
			seed := uint64(time.Now().UnixNano())
			if s := testingSeed(); s != 0 {
				seed = s
			}
			t.Logf("seed %d (rerun with REDISSTORE_SEED=%d)", seed, seed)
			r := rand.New(rand.NewPCG(seed, 0x3d))
			const rule = "gw-sum"
			key := Key("u", rule)
			ms := []*Model{NewModel(0), NewModel(0), NewModel(0)}
			pos := []int64{333, 333, 334}
			seq := []uint64{1, 1, 1}
			now := gw0
			for i, m := range ms {
				if _, err := m.WriteMarker(now, rule, Marker{Inc: 1, Seq: 1, Units: pos[i], Lease: MaxLease, Create: true, RunID: m.RunID()}); err != nil {
					t.Fatal(err)
				}
			}
			write := func(i int, units int64) WindowApplied {
				seq[i]++
				a, err := ms[i].WriteWindowShares(now, rule, []ShareRecord{windowRecord(alg, key, 1, seq[i], units)})
				if err != nil {
					t.Fatal(err)
				}
				return a[0]
			}
			var admitted, moved, refused int
			for step := 0; step < 20_000; step++ {
				switch x := r.IntN(10); {
				case x < 6:
					i := r.IntN(3)
					if ok, _, _ := ms[i].Check(now, 1+r.Int64N(3), []Bucket{globalWindow(alg, rule, key)}); ok {
						admitted++
					}
				case x < 8:
					i, j := r.IntN(3), r.IntN(3)
					g := r.Int64N(pos[i] + 1)
					if i == j || g == 0 {
						continue
					}
					a := write(i, pos[i]-g)
					if a.Version.Seq != seq[i] { // refused: give what is above the need
						refused++
						if g = pos[i] - a.Need; g <= 0 {
							continue
						}
						if a = write(i, pos[i]-g); a.Version.Seq != seq[i] {
							t.Fatalf("step %d: lowering to the answered need %d refused: %+v", step, a.Need, a)
						}
					}
					pos[i] -= g
					if a := write(j, pos[j]+g); a.Version.Seq != seq[j] {
						t.Fatalf("step %d: raise refused: %+v", step, a)
					}
					pos[j] += g
					moved++
				default:
					now += r.Int64N(gwMs / 20)
				}
				var use int64 // times W
				for _, m := range ms {
					k := m.get(now, key)
					if k == nil {
						continue
					}
					wi := floorDiv(now, gwMs)
					off := now - wi*gwMs
					switch w := k.h["w"]; {
					case alg == rules.FixedWindow && w == wi:
						use += k.h["n"] * gwMs
					case alg == rules.SlidingWindow && w == wi:
						use += k.h["c"]*gwMs + k.h["p"]*(gwMs-off)
					case alg == rules.SlidingWindow && w == wi-1:
						use += k.h["c"] * (gwMs - off)
					}
				}
				if use > gwLimit*gwMs {
					t.Fatalf("step %d: the regions' uses sum to %.2f, above %d (units %v)", step, float64(use)/float64(gwMs), gwLimit, pos)
				}
			}
			t.Logf("%d admissions, %d gifts (%d lowerings refused and cut to the need), units %v", admitted, moved, refused, pos)
			if moved == 0 || refused == 0 || admitted == 0 {
				t.Fatal("degenerate run")
			}
		})
	}
}

// TestSlidingWindowRecordLayouts: a global sliding window with a share
// record is written in 28 bytes (c and p in 5 bytes each); the 30-byte
// layout (6 bytes each: counts of 2^40 and more, and earlier versions) is
// still read, and a key in it answers as the same key in 28 bytes.
func TestSlidingWindowRecordLayouts(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	rule := "sw-layouts"
	m := create(redisImpl{e}, 1, 1, 300, time.Hour)
	m.RunID = redisImpl{e}.runID(t)
	redisImpl{e}.marker(t, gw0, rule, m)
	keys := []string{Key("new", rule), Key("old", rule)}
	for _, k := range keys {
		redisImpl{e}.shares(t, gw0, rule, windowRecord(rules.SlidingWindow, k, 1, 2, 600))
		take(t, redisImpl{e}, gw0+10, globalWindow(rules.SlidingWindow, rule, k), 7)
	}
	raw := e.client.Get(ctx, keys[1]).Val()
	if len(raw) != 28 {
		t.Fatalf("sliding window with a record: %d bytes, want 28", len(raw))
	}
	// the same state with c and p widened to 6 bytes
	wide := raw[:6] + raw[6:11] + "\x00" + raw[11:16] + "\x00" + raw[16:]
	if err := e.client.Set(ctx, keys[1], wide, redis.KeepTTL).Err(); err != nil {
		t.Fatal(err)
	}
	if got := decodeState(t, rules.SlidingWindow, wide); got["c"] != 7 {
		t.Fatalf("30-byte state %v, want c = 7", got)
	}
	for _, now := range []int64{gw0 + 20, gw0 + gwMs + 30, gw0 + gwMs + 40} {
		n0, r0 := take(t, redisImpl{e}, now, globalWindow(rules.SlidingWindow, rule, keys[0]), 5)
		n1, r1 := take(t, redisImpl{e}, now, globalWindow(rules.SlidingWindow, rule, keys[1]), 5)
		if n0 != n1 || r0 != r1 {
			t.Fatalf("at %d: 28-byte key %d %+v, 30-byte key %d %+v", now, n0, r0, n1, r1)
		}
	}
	if a, b := decodeState(t, rules.SlidingWindow, e.client.Get(ctx, keys[0]).Val()), decodeState(t, rules.SlidingWindow, e.client.Get(ctx, keys[1]).Val()); fmt.Sprint(a) != fmt.Sprint(b) {
		t.Fatalf("states differ: %v and %v", a, b)
	}
}
