package redisstore

import (
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
)

const t0 = int64(1_700_000_000_000) // a realistic epoch in ms

func tokenBucket(key string, capTokens, ratePerSec int64) Bucket {
	return Bucket{Key: key, Algorithm: rules.TokenBucket, Capacity: capTokens * 1000, Rate: ratePerSec * 1000}
}

func window(key string, alg rules.Algorithm, limit int64, w time.Duration) Bucket {
	return Bucket{Key: key, Algorithm: alg, Limit: limit, Window: w}
}

type step struct {
	at      int64 // ms after t0
	cost    int64
	allowed bool
	results []Result // nil: not checked
}

func runSteps(t *testing.T, im impl, buckets []Bucket, steps []step) {
	t.Helper()
	for i, s := range steps {
		cost := s.cost
		if cost == 0 {
			cost = 1
		}
		ok, res := im.check(t, t0+s.at, cost, buckets...)
		if ok != s.allowed {
			t.Fatalf("step %d (t=+%dms cost %d): allowed = %v, want %v (results %+v)", i, s.at, cost, ok, s.allowed, res)
		}
		if s.results != nil {
			for j := range s.results {
				if res[j] != s.results[j] {
					t.Fatalf("step %d (t=+%dms): bucket %d = %+v, want %+v", i, s.at, j, res[j], s.results[j])
				}
			}
		}
	}
}

var contractCases = []struct {
	name string
	run  func(t *testing.T, im impl, key func(string) string)
}{
	{"reference example: token bucket 5, 2/s", func(t *testing.T, im impl, key func(string) string) {
		b := []Bucket{tokenBucket(key("tb"), 5, 2)}
		runSteps(t, im, b, []step{
			{at: 0, allowed: true, results: []Result{{true, 5, 4, 0, 500}}},
			{at: 0, allowed: true},
			{at: 0, allowed: true},
			{at: 0, allowed: true},
			{at: 0, allowed: true, results: []Result{{true, 5, 0, 0, 2500}}},
			{at: 0, allowed: false, results: []Result{{false, 5, 0, 500, 2500}}},
			{at: 500, allowed: true, results: []Result{{true, 5, 0, 0, 2500}}},
			{at: 500, allowed: false, results: []Result{{false, 5, 0, 500, 2500}}},
			{at: 1500, allowed: true, results: []Result{{true, 5, 1, 0, 2000}}},
			{at: 1500, allowed: true},
			{at: 1500, allowed: false, results: []Result{{false, 5, 0, 500, 2500}}},
		})
	}},
	{"two buckets: the window rejects, the token bucket is not consumed", func(t *testing.T, im impl, key func(string) string) {
		tb := tokenBucket(key("tb"), 10, 10)
		win := window(key("win"), rules.SlidingWindow, 20, time.Minute)
		for i := 0; i < 20; i++ { // fill the window alone
			if ok, _ := im.check(t, t0, 1, win); !ok {
				t.Fatalf("window check %d rejected", i)
			}
		}
		ok, res := im.check(t, t0, 1, tb, win)
		if ok || !res[0].Allowed || res[1].Allowed {
			t.Fatalf("allowed=%v results %+v: want rejected by the window only", ok, res)
		}
		if res[0].Remaining != 10 {
			t.Fatalf("token bucket remaining %d after a rejected request, want 10 (not consumed)", res[0].Remaining)
		}
		_, res = im.check(t, t0, 1, tb)
		if res[0].Remaining != 9 {
			t.Fatalf("token bucket remaining %d, want 9", res[0].Remaining)
		}
	}},
	{"cost above one token, fractional capacity and rate", func(t *testing.T, im impl, key func(string) string) {
		// capacity 2.5 tokens, 0.333 tokens/s
		b := []Bucket{{Key: key("tb"), Algorithm: rules.TokenBucket, Capacity: 2500, Rate: 333}}
		runSteps(t, im, b, []step{
			{at: 0, cost: 2, allowed: true, results: []Result{{true, 2, 0, 0, 6007}}},      // 2 tokens = 2e6 millionths / 333 per ms
			{at: 0, cost: 1, allowed: false, results: []Result{{false, 2, 0, 1502, 6007}}}, // 0.5e6 short at 333/ms
			{at: 1501, cost: 1, allowed: false},
			{at: 1502, cost: 1, allowed: true, results: []Result{{true, 2, 0, 0, 7508}}}, // 166 millionths left
			{at: 1502, cost: 3, allowed: false, results: []Result{{false, 2, 0, Never, 7508}}},
		})
	}},
	{"token bucket: no drift under frequent checks", func(t *testing.T, im impl, key func(string) string) {
		// 0.007 tokens/s checked every ms for 1s must refill exactly 7 thousandths.
		k := key("tb")
		b := Bucket{Key: k, Algorithm: rules.TokenBucket, Capacity: 1000, Rate: 7}
		im.check(t, t0, 1, b)
		for ms := int64(1); ms <= 1000; ms += 37 {
			im.check(t, t0+ms, 1, Bucket{Key: key("other"), Algorithm: rules.TokenBucket, Capacity: 1000, Rate: 7}) // unrelated traffic
			ok, res := im.check(t, t0+ms, 1, b)
			if ok {
				t.Fatalf("allowed at +%dms", ms)
			}
			if want := ceilDiv(micro-ms*7, 7); res[0].RetryAfterMs != want {
				t.Fatalf("+%dms: retry %d, want %d", ms, res[0].RetryAfterMs, want)
			}
		}
	}},
	{"clock step back mints nothing", func(t *testing.T, im impl, key func(string) string) {
		b := []Bucket{tokenBucket(key("tb"), 2, 1)}
		runSteps(t, im, b, []step{
			{at: 10_000, cost: 2, allowed: true},
			{at: 5_000, allowed: false, results: []Result{{false, 2, 0, 1000, 2000}}},
			{at: 5_999, allowed: false},
			{at: 6_000, allowed: true}, // 1s after the step back: 1s of real refill
		})
		// A window key whose window is after the clock's goes on in the
		// current window with its count (it does not wait, full, for the
		// clock to catch up: up to the step), and a log's entries move back
		// with the clock, the newest to now.
		w := []Bucket{window(key("fw"), rules.FixedWindow, 2, time.Second)}
		runSteps(t, im, w, []step{
			{at: 10_500, cost: 2, allowed: true},
			{at: 9_500, allowed: false, results: []Result{{false, 2, 0, 500, 500}}},
			{at: 9_999, allowed: false},
			{at: 10_000, cost: 2, allowed: true},
			{at: 10_000, allowed: false},
		})
		sw := []Bucket{window(key("sw"), rules.SlidingWindow, 2, time.Second)}
		runSteps(t, im, sw, []step{
			{at: 70_500, cost: 2, allowed: true},
			{at: 10_500, allowed: false},
			{at: 11_000, allowed: false}, // the 2 weigh 2 in the next window's start
			{at: 11_500, allowed: true},  // and 1 half way through it
		})
		l := []Bucket{window(key("log"), rules.SlidingLog, 2, time.Second)}
		runSteps(t, im, l, []step{
			{at: 10_500, cost: 2, allowed: true},
			{at: 5_000, allowed: false, results: []Result{{false, 2, 0, 1000, 1000}}},
			{at: 5_999, allowed: false},
			{at: 6_000, allowed: true},
		})
	}},
	{"fixed window", func(t *testing.T, im impl, key func(string) string) {
		b := []Bucket{window(key("fw"), rules.FixedWindow, 3, time.Second)}
		runSteps(t, im, b, []step{
			{at: 1_500, allowed: true, results: []Result{{true, 3, 2, 0, 500}}},
			{at: 1_600, cost: 2, allowed: true, results: []Result{{true, 3, 0, 0, 400}}},
			{at: 1_999, allowed: false, results: []Result{{false, 3, 0, 1, 1}}},
			{at: 2_000, cost: 4, allowed: false, results: []Result{{false, 3, 3, Never, 1000}}},
			{at: 2_000, cost: 3, allowed: true, results: []Result{{true, 3, 0, 0, 1000}}},
		})
	}},
	{"sliding window counter", func(t *testing.T, im impl, key func(string) string) {
		b := []Bucket{window(key("sw"), rules.SlidingWindow, 10, time.Second)}
		runSteps(t, im, b, []step{
			{at: 100, cost: 10, allowed: true, results: []Result{{true, 10, 0, 0, 1900}}},
			// at +1100 the previous 10 weigh 9: one fits
			{at: 900, allowed: false, results: []Result{{false, 10, 0, 200, 1100}}},
			// next window, half way: the previous 10 weigh 5
			{at: 1_500, cost: 5, allowed: true, results: []Result{{true, 10, 0, 0, 1500}}},
			{at: 1_500, allowed: false, results: []Result{{false, 10, 0, 100, 1500}}},
			{at: 1_599, allowed: false},
			{at: 1_600, allowed: true, results: []Result{{true, 10, 0, 0, 1400}}},
			// window 2 at 10%: previous 6 weigh 5.4, + 1
			{at: 2_100, allowed: true, results: []Result{{true, 10, 3, 0, 1900}}},
		})
	}},
	{"sliding log", func(t *testing.T, im impl, key func(string) string) {
		b := []Bucket{window(key("log"), rules.SlidingLog, 3, time.Second)}
		runSteps(t, im, b, []step{
			{at: 0, allowed: true, results: []Result{{true, 3, 2, 0, 1000}}},
			{at: 100, cost: 2, allowed: true, results: []Result{{true, 3, 0, 0, 1000}}},
			{at: 300, allowed: false, results: []Result{{false, 3, 0, 700, 800}}},
			{at: 300, cost: 3, allowed: false, results: []Result{{false, 3, 0, 800, 800}}},
			{at: 1_000, allowed: true, results: []Result{{true, 3, 0, 0, 1000}}},
			{at: 1_000, cost: 4, allowed: false, results: []Result{{false, 3, 0, Never, 1000}}},
		})
	}},
	{"leaky bucket meter", func(t *testing.T, im impl, key func(string) string) {
		b := []Bucket{{Key: key("lb"), Algorithm: rules.LeakyBucket, Capacity: 3000, Rate: 1000}}
		runSteps(t, im, b, []step{
			{at: 0, allowed: true, results: []Result{{true, 3, 2, 0, 1000}}},
			{at: 0, allowed: true, results: []Result{{true, 3, 1, 1000, 2000}}},
			{at: 0, allowed: true, results: []Result{{true, 3, 0, 2000, 3000}}},
			{at: 0, allowed: false, results: []Result{{false, 3, 0, 1000, 3000}}},
			{at: 1_500, allowed: true, results: []Result{{true, 3, 0, 1500, 2500}}},
			{at: 1_500, cost: 4, allowed: false, results: []Result{{false, 3, 0, Never, 2500}}},
		})
	}},
	{"shadow bucket never rejects and consumes only when it allows", func(t *testing.T, im impl, key func(string) string) {
		enforced := tokenBucket(key("enforced"), 10, 1)
		shadow := tokenBucket(key("shadow"), 1, 1)
		shadow.Shadow = true
		ok, res := im.check(t, t0, 1, enforced, shadow)
		if !ok || !res[1].Allowed || res[1].Remaining != 0 || res[0].Remaining != 9 {
			t.Fatalf("first: %v %+v", ok, res)
		}
		ok, res = im.check(t, t0, 1, enforced, shadow)
		if !ok || res[1].Allowed || res[0].Remaining != 8 || res[1].RetryAfterMs != 1000 {
			t.Fatalf("second: want allowed with the shadow's would-be rejection: %v %+v", ok, res)
		}
		// only shadow buckets: always allowed
		ok, res = im.check(t, t0, 1, shadow)
		if !ok || res[0].Allowed {
			t.Fatalf("shadow only: %v %+v", ok, res)
		}
		// A rejected request: the shadow that would allow consumes nothing.
		small := tokenBucket(key("small"), 1, 1)
		im.check(t, t0, 1, small)
		sh2 := tokenBucket(key("shadow2"), 5, 1)
		sh2.Shadow = true
		ok, res = im.check(t, t0, 1, small, sh2)
		if ok || !res[1].Allowed || res[1].Remaining != 5 {
			t.Fatalf("rejected request: %v %+v, want the shadow untouched (5)", ok, res)
		}
	}},
}

func TestContract(t *testing.T) {
	forEachImpl(t, func(t *testing.T, im impl) {
		for i, tc := range contractCases {
			t.Run(tc.name, func(t *testing.T) {
				key := func(s string) string { return Key("case"+string(rune('a'+i)), s) }
				tc.run(t, im, key)
			})
		}
	})
}
