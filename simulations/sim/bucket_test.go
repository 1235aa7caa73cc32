package sim

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
)

// TestBucketMatchesRedisModel holds Bucket to regional/redisstore.Model, the
// Go reference of the enforcer's Lua script, on a global bucket: the same
// checks and share records (settle, set, clamp), with clock steps back, give
// the same verdicts and tokens.
func TestBucketMatchesRedisModel(t *testing.T) {
	const units = 1_000_000
	for seed := uint64(1); seed <= 50; seed++ {
		rng := rand.New(rand.NewPCG(seed, 7))
		m := redisstore.NewModel(0)
		key := redisstore.Key("user:42", "r")
		capG, rateG := 1000*(1+rng.Int64N(1000)), 1000*(1+rng.Int64N(1000))
		g := &redisstore.Global{Rule: "r", Units: units, Floor: 1000}
		if _, err := m.WriteMarker(0, "r", redisstore.Marker{Inc: 1, Seq: 1, Units: units / 4, Lease: 20 * time.Hour, Create: true, RunID: m.RunID()}); err != nil {
			t.Fatal(err)
		}
		var b Bucket
		ms, seq := int64(0), uint64(1)
		u := int64(units / 4)
		b.Start(0, mulDiv(capG, u, units), mulDiv(rateG, u, units))
		// Both start full on first use: a write to a key without state would
		// fill the model's bucket at the new share instead.
		if _, _, err := m.Check(0, 1, []redisstore.Bucket{{Key: key, Algorithm: rules.TokenBucket, Capacity: capG, Rate: rateG, Global: g}}); err != nil {
			t.Fatal(err)
		}
		b.Take(0, 1)
		for step := 0; step < 2000; step++ {
			if rng.IntN(20) == 0 {
				ms = max(0, ms-rng.Int64N(50)) // clock step back (not before the marker: it would not be live)
			} else {
				ms += rng.Int64N(30)
			}
			if rng.IntN(10) == 0 {
				u = rng.Int64N(units + 1)
				seq++
				if _, err := m.WriteShares(ms, "r", []redisstore.ShareRecord{{Key: key, Inc: 1, Seq: seq, Units: u,
					Capacity: capG, Rate: rateG, Total: units, Floor: g.Floor}}); err != nil {
					t.Fatal(err)
				}
				b.Set(ms, mulDiv(capG, u, units), mulDiv(rateG, u, units))
				continue
			}
			cost := 1 + rng.Int64N(3)
			ok, res, err := m.Check(ms, cost, []redisstore.Bucket{{Key: key, Algorithm: rules.TokenBucket, Capacity: capG, Rate: rateG, Global: g}})
			if err != nil {
				t.Fatal(err)
			}
			got := b.Take(ms, cost)
			left := b // a rejection stores nothing, but answers with the refilled tokens
			left.Refill(ms)
			if got != ok || left.Tokens/1_000_000 != res[0].Remaining {
				t.Fatalf("seed %d step %d ms %d: bucket (%v, %d tokens) != model (%v, %d)", seed, step, ms, got, left.Tokens/1_000_000, ok, res[0].Remaining)
			}
		}
	}
}

func TestEngineOrder(t *testing.T) {
	var e engine
	var got []int
	for i, at := range []time.Duration{5, 1, 5, 3, 1, 5} {
		i := i
		e.at(at, func() { got = append(got, i) })
	}
	for {
		ev, ok := e.pop()
		if !ok {
			break
		}
		ev.fn()
	}
	want := []int{1, 4, 3, 0, 2, 5} // by time, ties in scheduling order
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("order %v, want %v", got, want)
		}
	}
}

// TestWindowBucketMatchesRedisModel holds a fixed-window Bucket to the
// Model's global fixed window: the same verdicts and counts, with share
// changes applied only where the Model accepts them (a record below the
// key's use of its window is refused, as the ledger strategy's store does).
func TestWindowBucketMatchesRedisModel(t *testing.T) {
	const units = 1_000_000
	refused := 0
	for seed := uint64(1); seed <= 30; seed++ {
		rng := rand.New(rand.NewPCG(seed, 9))
		m := redisstore.NewModel(0)
		key := redisstore.Key("user:42", "q")
		limit, W := 1+rng.Int64N(300), 1000*(1+rng.Int64N(60))
		g := &redisstore.Global{Rule: "q", Units: units, Floor: 1000}
		wb := redisstore.Bucket{Key: key, Algorithm: rules.FixedWindow, Limit: limit, Window: time.Duration(W) * time.Millisecond, Global: g}
		if _, err := m.WriteMarker(0, "q", redisstore.Marker{Inc: 1, Seq: 1, Units: units / 4, Lease: 20 * time.Hour, Create: true, RunID: m.RunID()}); err != nil {
			t.Fatal(err)
		}
		b := Bucket{W: W}
		u := int64(units / 4)
		b.Start(0, mulDiv(limit*1000, u, units), 0)
		ms, seq := int64(0), uint64(1)
		for step := 0; step < 2000; step++ {
			ms += rng.Int64N(W / 20)
			if rng.IntN(8) == 0 {
				nu := rng.Int64N(units + 1)
				seq++
				v, err := m.WriteShares(ms, "q", []redisstore.ShareRecord{{Key: key, Inc: 1, Seq: seq, Units: nu, Algorithm: rules.FixedWindow,
					Limit: limit, Window: wb.Window, Total: units, Floor: g.Floor}})
				if err != nil {
					t.Fatal(err)
				}
				applied := v[0] == redisstore.Version{Inc: 1, Seq: seq}
				if fits := b.Used(ms)*1000 <= mulDiv(limit*1000, nu, units); fits != applied {
					t.Fatalf("seed %d step %d: model applied %v, bucket fits %v (used %d, units %d)", seed, step, applied, fits, b.Used(ms), nu)
				}
				if !applied {
					refused++
					seq-- // the model keeps the older version; the next record reuses the number
					continue
				}
				u = nu
				b.Set(ms, mulDiv(limit*1000, u, units), 0)
				continue
			}
			cost := 1 + rng.Int64N(3)
			ok, res, err := m.Check(ms, cost, []redisstore.Bucket{wb})
			if err != nil {
				t.Fatal(err)
			}
			if got := b.Take(ms, cost); got != ok || res[0].Limit*1000 > b.Cap || res[0].Limit != b.Cap/1000 || res[0].Remaining != max(b.Cap/1000-b.N, 0) {
				t.Fatalf("seed %d step %d ms %d: bucket (%v, %d of %d) != model (%v, %+v)", seed, step, ms, got, b.N, b.Cap/1000, ok, res[0])
			}
		}
	}
	if refused == 0 {
		t.Fatal("no record was refused: the refusal went untested")
	}
}
