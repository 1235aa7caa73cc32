package redisstore

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// randomBucket draws an algorithm and parameters. big draws values near the
// limits, to exercise the exactness of the script's doubles.
func randomBucket(r *rand.Rand, key string, big bool) Bucket {
	algs := []rules.Algorithm{rules.TokenBucket, rules.TokenBucket, rules.SlidingWindow, rules.FixedWindow, rules.SlidingLog, rules.LeakyBucket}
	if big {
		algs = algs[:4] // the log stores one member per token
		algs = append(algs, rules.LeakyBucket)
	}
	b := Bucket{Key: key, Algorithm: algs[r.IntN(len(algs))], Shadow: r.IntN(5) == 0}
	switch b.Algorithm {
	case rules.TokenBucket, rules.LeakyBucket:
		if big {
			b.Capacity = MaxCapacity - r.Int64N(1<<20)
			b.Rate = 1 + r.Int64N(MaxRate)
		} else {
			b.Capacity = 1 + r.Int64N(8_000)
			b.Rate = 1 + r.Int64N(5_000)
			if r.IntN(3) == 0 {
				b.Capacity = 1000 * (1 + r.Int64N(8))
				b.Rate = 1000 * (1 + r.Int64N(4))
			}
		}
	default:
		b.Window = time.Duration(1+r.Int64N(2_000)) * time.Millisecond
		b.Limit = 1 + r.Int64N(8)
		if big && b.Algorithm != rules.SlidingLog {
			b.Window = time.Duration(1+r.Int64N(86_400_000)) * time.Millisecond
			b.Limit = MaxLimitWindow/b.Window.Milliseconds() - r.Int64N(100)
		}
	}
	return b
}

// randomStep moves the virtual clock now by a random step: none, up to
// 1.5 s, up to 20 s, or back up to 3 s (a clock step back).
func randomStep(r *rand.Rand, now int64) int64 {
	switch x := r.IntN(10); {
	case x < 4:
	case x < 8:
		now += r.Int64N(1_500)
	case x < 9:
		now += r.Int64N(20_000)
	default:
		now -= r.Int64N(3_000)
	}
	return now
}

// TestDifferential drives the script in a real Redis and the Go model with
// the same random requests (algorithms, parameters, costs, time steps
// including steps back, several buckets per request with shadow ones) and
// requires identical verdicts, results, stored state and TTLs.
func TestDifferential(t *testing.T) {
	r := seededRand(t, 0x5eed)
	const slack = time.Hour // no key expires in real time during the test
	e := newEnv(t, false, WithTTLSlack(slack))
	m := NewModel(slack)
	ctx := ctxT(t)

	sequences, steps := 60, 120
	if testing.Short() {
		sequences = 10
	}
	var checks, allowed int
	for seq := 0; seq < sequences; seq++ {
		big := r.IntN(6) == 0
		nkeys := 1 + r.IntN(4)
		buckets := make([]Bucket, nkeys)
		for i := range buckets {
			buckets[i] = randomBucket(r, Key(fmt.Sprintf("user:%d", seq), fmt.Sprintf("rule-%d", i)), big)
		}
		now := t0 + r.Int64N(1_000_000)
		for st := 0; st < steps; st++ {
			now = randomStep(r, now)
			// a random non-empty subset of the keys, in random order
			perm := r.Perm(nkeys)[:1+r.IntN(nkeys)]
			req := make([]Bucket, len(perm))
			for j, p := range perm {
				req[j] = buckets[p]
			}
			cost := int64(1 + r.IntN(3))
			switch {
			case r.IntN(15) == 0:
				cost = 1 + r.Int64N(10)
			case big && r.IntN(4) == 0:
				cost = 1 + r.Int64N(MaxCost)
			}
			e.clock.ms.Store(now)
			gotOK, got, err := e.store.Check(ctx, cost, req)
			if err != nil {
				t.Fatalf("seq %d step %d: %v", seq, st, err)
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
				t.Fatalf("seq %d step %d now %d cost %d buckets %+v:\nredis %v %+v\nmodel %v %+v", seq, st, now, cost, req, gotOK, got, wantOK, want)
			}
			compareState(t, ctx, e.client, m, now, req, wantOK, want)
		}
	}
	t.Logf("%d checks (%d allowed): script and model agree", checks, allowed)
	if allowed == 0 || allowed == checks {
		t.Fatalf("degenerate run: %d of %d allowed", allowed, checks)
	}
}

// heldRecord reports whether the model's key holds a share record that is
// not a Release record.
func heldRecord(m *Model, k *modelKey) bool {
	u, ok := m.field(k, "u")
	return ok && u%2 == 0
}

// compareState requires Redis to hold exactly the model's state for the
// buckets' keys, and a TTL on every key; written says the keys were written
// now, so Redis's TTL must be the model's (less the real time since).
// A sliding log is written only when it takes tokens (res[i].Allowed).
func compareState(t *testing.T, ctx context.Context, c *redis.Client, m *Model, now int64, buckets []Bucket, written bool, res []Result) {
	t.Helper()
	for i, b := range buckets {
		k := m.get(now, b.Key)
		pttl, err := c.PTTL(ctx, b.Key).Result()
		if err != nil {
			t.Fatal(err)
		}
		if k == nil {
			if n, _ := c.Exists(ctx, b.Key).Result(); n != 0 {
				t.Fatalf("%s exists in Redis, not in the model (now %d, PTTL %v)", b.Key, now, pttl)
			}
			continue
		}
		switch mp := m.PTTL(now, b.Key); {
		case mp == -1:
			if pttl != -1 {
				t.Fatalf("%s: TTL %v, model: persistent", b.Key, pttl)
			}
		case pttl <= 0:
			t.Fatalf("%s has no TTL (%v), model %d ms", b.Key, pttl, mp)
		case written && res != nil && heldRecord(m, k):
			// a Check keeps a held record's TTL (KEEPTTL), which Redis
			// counts down in real time and the model in virtual time
		case written && (b.Algorithm != rules.SlidingLog || res == nil || res[i].Allowed):
			want := time.Duration(mp) * time.Millisecond
			if pttl > want || pttl < want-2*time.Second {
				t.Fatalf("%s: TTL %v, model %v", b.Key, pttl, want)
			}
		}
		if b.Algorithm == rules.SlidingLog {
			zs, err := c.ZRangeWithScores(ctx, b.Key, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			scores := make([]int64, len(zs))
			for i, z := range zs {
				scores[i] = int64(z.Score)
			}
			if !slices.Equal(scores, k.log) {
				t.Fatalf("%s: log %v, model %v", b.Key, scores, k.log)
			}
			continue
		}
		raw, err := c.Get(ctx, b.Key).Result()
		if err != nil {
			t.Fatal(err)
		}
		if h := decodeState(t, b.Algorithm, raw); !maps.Equal(h, k.h) {
			t.Fatalf("%s: state %v, model %v", b.Key, h, k.h)
		}
	}
}

// decodeState reads a bucket's binary state (little-endian unsigned
// integers, 6 bytes each but for a share record's 3, 5 and 4) into the
// model's field names.
func decodeState(tb testing.TB, alg rules.Algorithm, raw string) map[string]int64 {
	tb.Helper()
	names := map[rules.Algorithm][]string{
		rules.TokenBucket:   tbFields,
		rules.LeakyBucket:   {"t", "l"},
		rules.FixedWindow:   winFields[algFixedWindow],
		rules.SlidingWindow: winFields[algSlidingWindow],
	}[alg]
	widths := []int{6, 6, 6, 6, 6, 6, 6}
	if alg == rules.TokenBucket && len(raw) == 19 {
		// the decimal layout: 10^18 + t*10^9 + l mod 10^9
		t, err1 := strconv.ParseInt(raw[:10], 10, 64)
		m, err2 := strconv.ParseInt(raw[10:], 10, 64)
		if err1 != nil || err2 != nil || t < 1e9 {
			tb.Fatalf("bad decimal token bucket state %q", raw)
		}
		return map[string]int64{"t": t - 1e9, "m": m}
	}
	switch {
	case alg == rules.TokenBucket && len(raw) == 16:
		widths = []int{6, 6, 4}
	case alg == rules.TokenBucket && len(raw) == 28:
		widths = []int{6, 6, 4, 3, 5, 4}
	case alg == rules.FixedWindow && len(raw) == 24:
		widths = []int{6, 6, 3, 5, 4}
	case alg == rules.SlidingWindow && len(raw) == 30:
		widths = []int{6, 6, 6, 3, 5, 4}
	case alg == rules.SlidingWindow && len(raw) == 28:
		widths = []int{6, 5, 5, 3, 5, 4}
	case alg == rules.TokenBucket && len(raw) != 12:
		tb.Fatalf("token bucket state of %d bytes", len(raw))
	case len(raw)%6 != 0 || len(raw)/6 > len(names):
		tb.Fatalf("state of %d bytes for %s", len(raw), alg)
	}
	h := map[string]int64{}
	for i, off := 0, 0; off < len(raw); i++ {
		var v int64
		for j := widths[i] - 1; j >= 0; j-- {
			v = v<<8 | int64(raw[off+j])
		}
		h[names[i]] = v
		off += widths[i]
	}
	return h
}

// TestDecimalLayoutWrap runs a regional token bucket in the decimal layout
// (l stored modulo 10^9 ms) across a multiple of 10^9 ms, forward and with
// clock steps back across it, and requires the script and the model to agree
// on every result and state.
func TestDecimalLayoutWrap(t *testing.T) {
	e := newEnv(t, false)
	m := NewModel(DefaultTTLSlack)
	ctx := ctxT(t)
	b := tokenBucket(Key("wrap", "r"), 5, 2)
	now := int64(1_796_000_000_000) - 700
	for i, step := range []int64{0, 300, 300, 200, -400, -300, 900, 100, -1200, 2500, 1, 0, 60_000} {
		now += step
		e.clock.ms.Store(now)
		gotOK, got, err := e.store.Check(ctx, 1, []Bucket{b})
		if err != nil {
			t.Fatal(err)
		}
		wantOK, want, err := m.Check(now, 1, []Bucket{b})
		if err != nil {
			t.Fatal(err)
		}
		if gotOK != wantOK || !slices.Equal(got, want) {
			t.Fatalf("step %d now %d: redis %v %+v, model %v %+v", i, now, gotOK, got, wantOK, want)
		}
		compareState(t, ctx, e.client, m, now, []Bucket{b}, wantOK, want)
		if raw := e.client.Get(ctx, b.Key).Val(); len(raw) != 19 {
			t.Fatalf("step %d: state %q is not the decimal layout", i, raw)
		}
		if enc := e.client.ObjectEncoding(ctx, b.Key).Val(); enc != "int" {
			t.Fatalf("step %d: encoding %s, want int", i, enc)
		}
	}
}
