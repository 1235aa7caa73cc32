package redisstore

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// TestDifferentialMulti drives Do with many calls (one multi-call script
// call: standalone, every call of a Do shares it) in a real Redis and the
// Go model evaluating the same calls one after another: random calls of
// every algorithm, global buckets of three rules whose markers change,
// calls sharing keys, invalid calls (failing alone, before sending) and
// calls on a corrupted key (a Redis-side error the script catches: that
// call fails with the error reply, the others are answered). Verdicts,
// results and the stored state must agree.
func TestDifferentialMulti(t *testing.T) {
	t.Run("redis", func(t *testing.T) { diffMulti(t, false) })
	t.Run("miniredis", func(t *testing.T) { diffMulti(t, true) }) // gopher-lua, no struct
}

func diffMulti(t *testing.T, mini bool) {
	r := seededRand(t, 0x3017)
	const slack = 24 * time.Hour // no key expires, in real or virtual time
	var e *env
	if mini {
		e, _ = newMiniEnv(t, false, WithTTLSlack(slack))
	} else {
		e = newEnv(t, false, WithTTLSlack(slack))
	}
	m := NewModel(slack)
	ctx := ctxT(t)
	id, err := e.store.RunID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m.Restart(id)

	// the bucket pool: every key has one algorithm and one set of
	// parameters for the whole test
	var pool []Bucket
	for u := 0; u < 4; u++ {
		for j := 0; j < 4; j++ {
			pool = append(pool, randomBucket(r, Key(fmt.Sprintf("user:%d", u), fmt.Sprintf("r-%d", j)), r.IntN(8) == 0))
		}
	}
	grules := []string{"gtb", "gfw", "gsw"}
	for gi, g := range grules {
		glob := &Global{Rule: g, Units: 1 + r.Int64N(1000)}
		glob.Floor = r.Int64N(glob.Units/2 + 1)
		for u := 0; u < 4; u++ {
			b := Bucket{Key: Key(fmt.Sprintf("user:%d", u), g), Global: glob}
			switch gi {
			case 0:
				b.Algorithm, b.Capacity, b.Rate = rules.TokenBucket, 1+r.Int64N(50_000), 1+r.Int64N(20_000)
			case 1:
				b.Algorithm, b.Limit, b.Window = rules.FixedWindow, 1+r.Int64N(200), time.Duration(1+r.Int64N(5000))*time.Millisecond
			default:
				b.Algorithm, b.Limit, b.Window = rules.SlidingWindow, 1+r.Int64N(200), time.Duration(1+r.Int64N(5000))*time.Millisecond
			}
			pool = append(pool, b)
		}
	}
	// corrupted keys: a state of no known length, and a list
	bad := []Bucket{
		{Key: Key("user:bad", "state"), Algorithm: rules.TokenBucket, Capacity: 10, Rate: 1000},
		{Key: Key("user:bad", "list"), Algorithm: rules.TokenBucket, Capacity: 10, Rate: 1000},
	}
	if err := e.client.Set(ctx, bad[0].Key, "xyz", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := e.client.RPush(ctx, bad[1].Key, "x").Err(); err != nil {
		t.Fatal(err)
	}

	steps := 300
	if testing.Short() {
		steps = 60
	}
	now := t0
	var calls, allowed, invalid, failed, markers int
	for st := 0; st < steps; st++ {
		now = randomStep(r, now)
		e.clock.ms.Store(now)
		if r.IntN(4) == 0 { // a marker create or renewal
			g := grules[r.IntN(len(grules))]
			mk := Marker{Inc: uint64(1 + r.IntN(3)), Seq: uint64(r.IntN(30)), Units: r.Int64N(1001),
				Lease: time.Duration(r.Int64N(30_000)) * time.Millisecond, Create: r.IntN(2) == 0}
			if mk.Create {
				mk.RunID = m.RunID()
			}
			got, err := e.store.WriteMarker(ctx, g, mk)
			if err != nil {
				t.Fatal(err)
			}
			want, err := m.WriteMarker(now, g, mk)
			if err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Fatalf("step %d marker %+v: redis %v, model %v", st, mk, got, want)
			}
			markers++
		}
		n := 2 + r.IntN(40)
		cs := make([]Call, n)
		kind := make([]int, n) // 0: valid, 1: invalid, 2: on a corrupted key
		for i := range cs {
			perm := r.Perm(len(pool))[:1+r.IntN(3)]
			req := make([]Bucket, len(perm))
			for j, p := range perm {
				req[j] = pool[p]
			}
			cs[i] = Call{Cost: 1 + r.Int64N(3), Buckets: req}
			switch x := r.IntN(20); {
			case x == 0:
				cs[i].Cost, kind[i] = 0, 1
			case x == 1:
				cs[i].Buckets, kind[i] = append(req, bad[r.IntN(len(bad))]), 2
			}
		}
		out := make([]Answer, n)
		e.store.Do(ctx, Budget{}, cs, out)
		var touched []Bucket
		for i, cl := range cs {
			a := out[i]
			switch kind[i] {
			case 1:
				invalid++
				if !errors.Is(a.Err, ErrInvalidCost) {
					t.Fatalf("step %d call %d: cost 0: %v", st, i, a.Err)
				}
				continue
			case 2:
				failed++
				if !isReply(a.Err) || !strings.Contains(a.Err.Error(), "bad state") && !strings.Contains(a.Err.Error(), "WRONGTYPE") {
					t.Fatalf("step %d call %d: on a corrupted key: %v", st, i, a.Err)
				}
				continue
			}
			if a.Err != nil {
				t.Fatalf("step %d call %d: %v", st, i, a.Err)
			}
			wantOK, want, err := m.Check(now, cl.Cost, cl.Buckets)
			if err != nil {
				t.Fatal(err)
			}
			calls++
			if wantOK {
				allowed++
			}
			if a.Allowed != wantOK || !slices.Equal(a.Results, want) {
				t.Fatalf("step %d now %d call %d of %d cost %d buckets %+v:\nredis %v %+v\nmodel %v %+v", st, now, i, n, cl.Cost, cl.Buckets, a.Allowed, a.Results, wantOK, want)
			}
			for _, b := range cl.Buckets {
				if !slices.ContainsFunc(touched, func(x Bucket) bool { return x.Key == b.Key }) {
					touched = append(touched, b)
				}
			}
		}
		compareState(t, ctx, e.client, m, now, touched, false, nil)
	}
	t.Logf("%d calls (%d allowed), %d invalid, %d on corrupted keys, %d marker writes: the multi-call script and the model agree", calls, allowed, invalid, failed, markers)
	if allowed == 0 || allowed == calls || invalid == 0 || failed == 0 {
		t.Fatal("degenerate run")
	}
	// one script call per Do, plus the marker writes, RunID and the
	// NOSCRIPT retries of the first uses
	if mini {
		return // no INFO commandstats
	}
	if n := commandstat(t, e.client, "evalsha", "calls"); n > float64(steps+markers+5) {
		t.Fatalf("%v EVALSHA for %d Do of many calls and %d marker writes", n, steps, markers)
	}
}

// TestClusterMulti sends Do calls of many clients, spread over the three
// masters, several calls per client: each slot's calls share one script
// call (multi-call), and every call is answered as alone: a token bucket
// and a global one (whose marker copy is in its slot) of 3 tokens each
// allow a client's first 3 calls, across Do, and no more; a call on a
// corrupted key fails alone.
func TestClusterMulti(t *testing.T) {
	e := newClusterEnv(t)
	ctx := ctxT(t)
	if err := e.store.Warm(ctx); err != nil {
		t.Fatal(err)
	}
	const clients = 12
	bad := Bucket{Key: Key("client-3", "bad"), Algorithm: rules.TokenBucket, Capacity: 10, Rate: 1000}
	if err := e.client.Set(ctx, bad.Key, "xyz", 0).Err(); err != nil {
		t.Fatal(err)
	}
	masters := map[int]bool{}
	used := make([]int, clients)
	var calls int
	for d := 0; d < 3; d++ {
		var cs []Call
		var who []int
		for c := 0; c < clients; c++ {
			tag := fmt.Sprintf("client-%d", c)
			bs := []Bucket{
				{Key: Key(tag, "tb"), Algorithm: rules.TokenBucket, Capacity: 3000, Rate: 1},
				{Key: Key(tag, "g"), Algorithm: rules.TokenBucket, Capacity: 3000, Rate: 1, Global: &Global{Rule: "g", Units: 10, Floor: 10}},
			}
			if d == 0 {
				masters[e.master(t, bs[0].Key)] = true
			}
			cs, who = append(cs, Call{Cost: 1, Buckets: bs}, Call{Cost: 1, Buckets: bs}), append(who, c, c)
		}
		cs, who = append(cs, Call{Cost: 1, Buckets: []Bucket{bad}}), append(who, -1)
		out := make([]Answer, len(cs))
		e.store.Do(ctx, Budget{}, cs, out)
		calls += len(cs)
		for i, a := range out {
			c := who[i]
			if c < 0 {
				if !isReply(a.Err) || !strings.Contains(a.Err.Error(), "bad state") {
					t.Fatalf("Do %d: the corrupted key's call: %v", d, a.Err)
				}
				continue
			}
			if a.Err != nil {
				t.Fatalf("Do %d call %d (client %d): %v", d, i, c, a.Err)
			}
			want := used[c] < 3
			if a.Allowed != want || len(a.Results) != 2 || a.Results[0].Allowed != want || a.Results[1].Allowed != want {
				t.Fatalf("Do %d call %d (client %d, %d taken): %+v, want allowed %v", d, i, c, used[c], a, want)
			}
			if want {
				used[c]++
			}
		}
	}
	if len(masters) != 3 {
		t.Fatalf("%d clients on %d masters, want all 3", clients, len(masters))
	}
	var evalsha float64
	for _, addr := range e.c.Addrs() {
		rc := redis.NewClient(&redis.Options{Addr: addr})
		if role, _ := rc.Do(ctx, "ROLE").Slice(); len(role) > 0 && role[0] == "master" {
			evalsha += commandstat(t, rc, "evalsha", "calls")
		}
		rc.Close()
	}
	if evalsha > 3*(clients+1) {
		t.Fatalf("%v EVALSHA for %d calls of %d clients in 3 Do: not one script call per slot and Do", evalsha, calls, clients)
	}
	t.Logf("%d calls in %v EVALSHA", calls, evalsha)
}

// TestMultiNoScript: a Do of many calls on a server that lost its scripts
// (SCRIPT FLUSH) loads them and is answered, as a single call is.
func TestMultiNoScript(t *testing.T) {
	e := newEnv(t, true)
	ctx := ctxT(t)
	cs := make([]Call, 8)
	for i := range cs {
		cs[i] = Call{Cost: 1, Buckets: []Bucket{{Key: Key(fmt.Sprintf("user:%d", i%4), "tb"), Algorithm: rules.TokenBucket, Capacity: 2000, Rate: 1}}}
	}
	for round := 0; round < 2; round++ {
		if err := e.client.ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		loads := e.store.ScriptLoads()
		out := make([]Answer, len(cs))
		e.store.Do(ctx, Budget{}, cs, out)
		for i, a := range out {
			// round 0: each key's two calls fit its capacity of 2; round 1: none is left
			if want := round == 0; a.Err != nil || a.Allowed != want {
				t.Fatalf("round %d call %d: %+v, want allowed %v", round, i, a, want)
			}
		}
		if e.store.ScriptLoads() == loads {
			t.Fatalf("round %d: no script load after SCRIPT FLUSH", round)
		}
	}
}
