package redisstore

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
)

// TestDifferentialGlobal drives the scripts in a real Redis and the Model
// with the same random interleaving of checks on global buckets (with a
// regional bucket now and then), share-record writes, marker creates (with
// the right and a wrong run id) and renewals, lease expiry by advancing the
// clock, clock steps back, and real restarts of redis-server (the model is
// told the new run id: Restart). It requires identical results, returned
// versions, bucket state, TTL kind and markers. It runs for global token
// buckets and global fixed and sliding windows (whose records are refused
// while the key has used more of its window than they allow).
func TestDifferentialGlobal(t *testing.T) {
	for _, alg := range []rules.Algorithm{rules.TokenBucket, rules.FixedWindow, rules.SlidingWindow} {
		t.Run(string(alg), func(t *testing.T) { diffGlobal(t, alg) })
	}
}

func diffGlobal(t *testing.T, alg rules.Algorithm) {
	seed := uint64(time.Now().UnixNano())
	if s := testingSeed(); s != 0 {
		seed = s
	}
	t.Logf("seed %d (rerun with REDISSTORE_SEED=%d)", seed, seed)
	r := rand.New(rand.NewPCG(seed, 0x610ba1))
	// No key may expire in real time (Redis) or in virtual time (the
	// model) during the test: the virtual clock advances at most 20 s a
	// step, 16.7 h over the 3,000 steps, within the 24 h slack (with 1 h,
	// a run that advanced 73 min saw the model expire a key Redis kept).
	const slack = 24 * time.Hour
	e := newEnv(t, false, WithTTLSlack(slack))
	m := NewModel(slack)
	ctx := ctxT(t)
	runID := func() string {
		id, err := e.store.RunID(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	m.Restart(runID())

	type grule struct {
		id          string
		c, rt, u, f int64 // token bucket: capacity, rate; windows: limit, window ms
		keys        []string
	}
	win := alg != rules.TokenBucket
	newRules := func() []grule {
		rs := make([]grule, 2)
		for i := range rs {
			g := grule{id: fmt.Sprintf("g%d", i), c: 1 + r.Int64N(50_000), rt: 1 + r.Int64N(20_000), u: 1 + r.Int64N(1000)}
			switch r.IntN(4) {
			case 0:
				g.u = 1_000_000
			case 1:
				g.c, g.rt, g.u = MaxCapacity-r.Int64N(1000), MaxRate-r.Int64N(1000), MaxUnits-r.Int64N(10)
				if win {
					g.c, g.rt = MaxLimit-r.Int64N(1000), MaxLimitWindow/MaxLimit
				}
			}
			if win && g.c < MaxLimit-1000 {
				g.c, g.rt = []int64{1 + r.Int64N(20), 1 + r.Int64N(200)}[r.IntN(2)], []int64{1000, 2000, 60_000, 1 + r.Int64N(5000)}[r.IntN(4)]
			}
			g.f = r.Int64N(g.u/2 + 1)
			for k := 0; k < 4; k++ {
				g.keys = append(g.keys, Key(fmt.Sprintf("user:%d", k), g.id))
			}
			rs[i] = g
		}
		return rs
	}
	rs := newRules()
	bucket := func(g grule, key string) Bucket {
		if win {
			return Bucket{Key: key, Algorithm: alg, Limit: g.c, Window: time.Duration(g.rt) * time.Millisecond, Global: &Global{Rule: g.id, Units: g.u, Floor: g.f}}
		}
		return Bucket{Key: key, Algorithm: rules.TokenBucket, Capacity: g.c, Rate: g.rt, Global: &Global{Rule: g.id, Units: g.u, Floor: g.f}}
	}
	units := func(g grule) int64 {
		switch r.IntN(4) {
		case 0:
			return g.f
		case 1:
			return g.u
		case 2:
			if win {
				return r.Int64N(g.f + 1) // below what the key may have used
			}
		}
		return r.Int64N(g.u + 1)
	}
	steps, restarts := 3000, 3
	if testing.Short() {
		steps, restarts = 600, 1
	}
	now := t0
	var checks, allowed, writes, applied, overUsed, markers, markersApplied, restarted int
	for st := 0; st < steps; st++ {
		switch x := r.IntN(20); {
		case x < 8:
		case x < 16:
			now += r.Int64N(1_500)
		case x < 19:
			now += r.Int64N(20_000) // leases lapse
		default:
			now -= r.Int64N(3_000) // a clock step back
		}
		e.clock.ms.Store(now)
		g := rs[r.IntN(len(rs))]
		switch x := r.IntN(20); {
		case x < 10: // a check of 1-3 keys, sometimes with a regional bucket on the same key
			perm := r.Perm(len(g.keys))[:1+r.IntN(3)]
			req := make([]Bucket, len(perm))
			for j, p := range perm {
				req[j] = bucket(g, g.keys[p])
			}
			switch {
			case r.IntN(15) != 0:
			case win: // a regional window on the key drops its record
				req[0] = Bucket{Key: req[0].Key, Algorithm: alg, Limit: 1 + r.Int64N(100), Window: req[0].Window}
			default:
				req[0] = Bucket{Key: req[0].Key, Algorithm: rules.TokenBucket, Capacity: 1 + r.Int64N(5000), Rate: 1 + r.Int64N(5000)}
			}
			if r.IntN(5) == 0 { // two rules in one request
				o := rs[(slices.IndexFunc(rs, func(x grule) bool { return x.id == g.id })+1)%len(rs)]
				req = append(req, bucket(o, o.keys[r.IntN(len(o.keys))]))
			}
			cost := 1 + r.Int64N(3)
			if r.IntN(10) == 0 {
				cost = 1 + r.Int64N(MaxCost)
			}
			gotOK, got, err := e.store.Check(ctx, cost, req)
			if err != nil {
				t.Fatalf("step %d: %v", st, err)
			}
			wantOK, want, err := m.Check(now, cost, req)
			if err != nil {
				t.Fatal(err)
			}
			checks++
			if wantOK {
				allowed++
			}
			if gotOK != wantOK || !slices.Equal(got, want) {
				t.Fatalf("step %d now %d cost %d buckets %+v:\nredis %v %+v\nmodel %v %+v", st, now, cost, req, gotOK, got, wantOK, want)
			}
			compareState(t, ctx, e.client, m, now, req, wantOK, want)
		case x < 15: // share records
			recs := make([]ShareRecord, 1+r.IntN(3))
			for j := range recs {
				recs[j] = ShareRecord{Key: g.keys[r.IntN(len(g.keys))], Inc: uint64(1 + r.IntN(3)), Seq: uint64(r.IntN(30)),
					Units: units(g), Release: r.IntN(4) == 0, Capacity: g.c, Rate: g.rt, Total: g.u, Floor: g.f,
					TTL: time.Duration(r.Int64N(10_000)) * time.Millisecond}
				if r.IntN(2) == 0 { // a held record with a TTL (else persistent)
					recs[j].Hold = time.Duration(r.Int64N(20_000)) * time.Millisecond
				}
				if win {
					recs[j].Algorithm, recs[j].Limit, recs[j].Window, recs[j].Capacity, recs[j].Rate = alg, g.c, time.Duration(g.rt)*time.Millisecond, 0, 0
				}
			}
			if win && r.IntN(3) == 0 { // a lowering to nothing, above the held version: refused if the key has used its window
				if k := m.get(now, recs[0].Key); k != nil {
					if si, ok := m.field(k, "i"); ok {
						recs[0].Inc, recs[0].Seq = uint64(si), uint64(k.h["s"])+1
					}
				}
				recs[0].Units = 0
			}
			// the version each key holds before: a window record of that
			// same version that the store refuses answers it too, so the
			// answer alone does not tell that it was written
			heldBefore := map[string]Version{}
			for _, rec := range recs {
				if k := m.get(now, rec.Key); k != nil {
					if si, ok := m.field(k, "i"); ok {
						heldBefore[rec.Key] = Version{uint64(si), uint64(k.h["s"])}
					}
				}
			}
			got, err := e.store.WriteShares(ctx, g.id, recs)
			if err != nil {
				t.Fatalf("step %d: %v", st, err)
			}
			want, err := m.WriteShares(now, g.id, recs)
			if err != nil {
				t.Fatal(err)
			}
			if win && r.IntN(2) == 0 { // the same again, with the refusals' answers
				ga, err := e.store.WriteWindowShares(ctx, g.id, recs)
				if err != nil {
					t.Fatalf("step %d: %v", st, err)
				}
				wa, err := m.WriteWindowShares(now, g.id, recs)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(ga, wa) {
					t.Fatalf("step %d now %d records %+v: redis %+v, model %+v", st, now, recs, ga, wa)
				}
				for j, a := range wa {
					if a.Need > 0 && shareOf(recs[j].Limit, a.Need, g.u) < 1 || a.Need > 0 && a.Until <= 0 {
						t.Fatalf("step %d: refusal answer %+v for %+v", st, a, recs[j])
					}
				}
			}
			if !slices.Equal(got, want) {
				t.Fatalf("step %d now %d records %+v: redis %v, model %v", st, now, recs, got, want)
			}
			for j, rec := range recs {
				writes++
				ok := want[j] == rec.versionOf()
				if ok {
					applied++
				}
				if want[j].Less(rec.versionOf()) {
					overUsed++ // a window record below what the key has used
				}
				// (a later record of the same key may have rewritten it)
				last := !slices.ContainsFunc(recs[j+1:], func(x ShareRecord) bool { return x.Key == rec.Key })
				hv, held := heldBefore[rec.Key]
				written := ok && last && !(win && held && hv == rec.versionOf())
				compareState(t, ctx, e.client, m, now, []Bucket{bucket(g, rec.Key)}, written, nil)
			}
		case x < 19: // a marker create or renewal
			mk := Marker{Inc: uint64(1 + r.IntN(3)), Seq: uint64(r.IntN(30)), Units: units(g),
				Lease: time.Duration(r.Int64N(30_000)) * time.Millisecond, Create: r.IntN(2) == 0}
			if mk.Create {
				mk.RunID, mk.Boot = m.RunID(), mk.Inc == 1 && r.IntN(4) != 0
				if r.IntN(4) == 0 {
					mk.RunID = "0000000000000000000000000000000000000000"
				}
			}
			got, err := e.store.WriteMarker(ctx, g.id, mk)
			if err != nil {
				t.Fatalf("step %d: %v", st, err)
			}
			want, err := m.WriteMarker(now, g.id, mk)
			if err != nil {
				t.Fatal(err)
			}
			markers++
			if want == (Version{mk.Inc, mk.Seq}) {
				markersApplied++
			}
			if got != want {
				t.Fatalf("step %d now %d marker %+v: redis %v, model %v", st, now, mk, got, want)
			}
			compareMarker(t, e, m, g.id)
		default:
			if restarted < restarts && r.IntN(10) == 0 {
				e.redis.Restart(t)
				m.Restart(runID())
				restarted++
				rs = newRules() // new parameters: the store is empty
			}
		}
	}
	t.Logf("%d checks (%d allowed), %d record writes (%d applied, %d refused as below the use), %d marker writes (%d applied), %d restarts: scripts and model agree",
		checks, allowed, writes, applied, overUsed, markers, markersApplied, restarted)
	if allowed == 0 || allowed == checks || applied == 0 || applied == writes || markersApplied == 0 || markersApplied == markers || win != (overUsed > 0) {
		t.Fatal("degenerate run")
	}
}

// compareMarker requires Redis to hold exactly the model's marker of rule,
// without a TTL.
func compareMarker(t *testing.T, e *env, m *Model, rule string) {
	t.Helper()
	ctx := ctxT(t)
	key := MarkerKey(rule)
	want, ok := m.markers[key]
	raw, err := e.client.Get(ctx, key).Result()
	if !ok {
		if err == nil {
			t.Fatalf("marker %s in Redis, not in the model", key)
		}
		return
	}
	if err != nil {
		t.Fatalf("marker %s: %v (model %+v)", key, err, want)
	}
	var v [5]int64
	for i := range v {
		for j := 5; j >= 0; j-- {
			v[i] = v[i]<<8 | int64(raw[6*i+j])
		}
	}
	const bootBit = int64(1) << 47 // a boot marker's flag in seq
	got := modelMarker{inc: v[0], seq: v[1] &^ bootBit, units: v[2], at: v[3], exp: v[4], run: raw[30:], boot: v[1]&bootBit != 0}
	if got != want {
		t.Fatalf("marker %s: redis %+v, model %+v", key, got, want)
	}
	if d := e.client.PTTL(ctx, key).Val(); d != -1 {
		t.Fatalf("marker %s has a TTL: %v", key, d)
	}
}
