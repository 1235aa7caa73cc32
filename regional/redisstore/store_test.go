package redisstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

func TestKey(t *testing.T) {
	tests := []struct {
		name        string
		tag, rule   string
		extra       []string
		want        string
		wantHashTag string
	}{
		{"plain", "user:42", "orders-free", nil, "rl:{user:42}:orders-free", "user:42"},
		{"braces escaped", "{user:1}", "r", nil, "rl:{%7Buser:1%7D}:r", "%7Buser:1%7D"},
		{"percent escaped", "a%7Bb", "r", nil, "rl:{a%257Bb}:r", "a%257Bb"},
		{"extras", "u", "r", []string{"1m", "a:b{}"}, "rl:{u}:r:1m:a%3Ab%7B%7D", "u"},
		{"colon in rule id", "u", "a:b", nil, "rl:{u}:a%3Ab", "u"},
		{"empty tag", "", "r", nil, "rl:{%00}:r", "%00"},
	}
	// Sub-buckets of a split rule: never another client's key.
	for _, tc := range []struct {
		tag  string
		sub  int
		want string
	}{
		{"v", 0, "rl:{v}:r"},
		{"v", 1, "rl:{v%#1}:r"},
		{"v#1", 0, "rl:{v#1}:r"},
		{"", 2, "rl:{%00%#2}:r"},
		{"v%#1", 0, "rl:{v%25#1}:r"},
	} {
		if got := SubKey(tc.tag, tc.sub, "r"); got != tc.want {
			t.Errorf("SubKey(%q, %d) = %q, want %q", tc.tag, tc.sub, got, tc.want)
		}
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := Key(tc.tag, tc.rule, tc.extra...)
			if got != tc.want {
				t.Fatalf("Key = %q, want %q", got, tc.want)
			}
			if h := hashTag(got); h != tc.wantHashTag {
				t.Fatalf("hash tag %q, want %q", h, tc.wantHashTag)
			}
		})
	}
	if Key("{user:1}", "r") == Key("user:1", "r") {
		t.Fatal(`Key("{user:1}") == Key("user:1")`)
	}
}

// hashTag is Redis Cluster's rule: the bytes between the first '{' and the
// first '}' after it, if not empty; else the whole key.
func hashTag(key string) string {
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return key
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j <= 0 {
		return key
	}
	return key[i+1 : i+1+j]
}

// TestKeyInjective draws keys from a small alphabet full of separators and
// requires distinct inputs (sub-buckets of a split rule and algorithms too)
// to give distinct keys, and every key's hash tag to
// be its escaped client key, brace-free.
func TestKeyInjective(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	alphabet := []string{"{", "}", ":", "%", "7B", "a", "", "#", "1", "!", "fw"}
	word := func() string {
		var b strings.Builder
		for n := r.IntN(5); n > 0; n-- {
			b.WriteString(alphabet[r.IntN(len(alphabet))])
		}
		return b.String()
	}
	algs := []rules.Algorithm{rules.TokenBucket, rules.LeakyBucket, rules.FixedWindow, rules.SlidingWindow, rules.SlidingLog}
	seen := map[string]string{}
	for i := 0; i < 20000; i++ {
		tag, rule, sub, alg := word(), word(), r.IntN(3), algs[r.IntN(len(algs))]
		extra := make([]string, r.IntN(3))
		for j := range extra {
			extra[j] = word()
		}
		in := fmt.Sprintf("%d %s %q", sub, alg, append([]string{tag, rule}, extra...))
		k := AlgorithmKey(SubKey(tag, sub, rule, extra...), alg)
		if prev, ok := seen[k]; ok && prev != in {
			t.Fatalf("%s and %s both give %q", prev, in, k)
		}
		seen[k] = in
		h := hashTag(k)
		if h == k || strings.ContainsAny(h, "{}") || !strings.HasPrefix(k, "rl:{"+h+"}:") {
			t.Fatalf("key %q: hash tag %q", k, h)
		}
		// every key of one client (one sub-bucket) shares the tag
		if hashTag(SubKey(tag, sub, "other")) != h {
			t.Fatalf("tag of %q differs across rules", tag)
		}
	}
}

func TestValidation(t *testing.T) {
	e := newEnv(t, false)
	ok := tokenBucket("k", 1, 1)
	tests := []struct {
		name    string
		cost    int64
		buckets []Bucket
		want    error
	}{
		{"zero cost", 0, []Bucket{ok}, ErrInvalidCost},
		{"huge cost", MaxCost + 1, []Bucket{ok}, ErrInvalidCost},
		{"no key", 1, []Bucket{{Algorithm: rules.TokenBucket, Capacity: 1, Rate: 1}}, ErrInvalidBucket},
		{"unknown algorithm", 1, []Bucket{{Key: "k", Algorithm: "gcra"}}, rules.ErrUnknownAlgorithm},
		{"zero rate", 1, []Bucket{{Key: "k", Algorithm: rules.TokenBucket, Capacity: 1}}, ErrInvalidBucket},
		{"capacity too big", 1, []Bucket{{Key: "k", Algorithm: rules.LeakyBucket, Capacity: MaxCapacity + 1, Rate: 1}}, ErrInvalidBucket},
		{"sub-ms window", 1, []Bucket{{Key: "k", Algorithm: rules.FixedWindow, Limit: 1, Window: time.Microsecond}}, ErrInvalidBucket},
		{"limit x window too big", 1, []Bucket{{Key: "k", Algorithm: rules.SlidingWindow, Limit: MaxLimitWindow, Window: time.Second}}, ErrInvalidBucket},
		{"repeated key", 1, []Bucket{ok, ok}, ErrInvalidBucket},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := e.store.Check(ctxT(t), tc.cost, tc.buckets)
			if !errors.Is(err, tc.want) {
				t.Fatalf("store: err %v, want %v", err, tc.want)
			}
			_, _, err = NewModel(0).Check(0, tc.cost, tc.buckets)
			if !errors.Is(err, tc.want) {
				t.Fatalf("model: err %v, want %v", err, tc.want)
			}
		})
	}
	for _, opt := range []Option{WithBatchSize(0), WithWorkers(0), WithTTLSlack(-time.Second)} {
		if _, err := New(e.client, opt); err == nil {
			t.Fatal("New accepted a bad option")
		}
	}
	if allowed, res, err := e.store.Check(ctxT(t), 1, nil); !allowed || res != nil || err != nil {
		t.Fatalf("no buckets: %v %v %v", allowed, res, err)
	}
}

// TestMemoryUsage measures a typical token-bucket key, with and without a
// share (Redis 7.0, jemalloc; the figures are in the package doc).
func TestMemoryUsage(t *testing.T) {
	e := newEnv(t, true)
	ctx := ctxT(t)
	key := Key("user:42", "orders-free")
	if _, _, err := e.store.Check(ctx, 1, []Bucket{tokenBucket(key, 20, 10)}); err != nil {
		t.Fatal(err)
	}
	n, err := e.client.MemoryUsage(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("MEMORY USAGE %s = %d bytes (state %v)", key, n, decodeState(t, rules.TokenBucket, e.client.Get(ctx, key).Val()))
	if n > 80 {
		t.Fatalf("token bucket key uses %d bytes, want <= 80 (the decimal layout, int-encoded)", n)
	}
	// The other layouts, for the record: the keys an enforcer writes for
	// the same rule id with another algorithm (AlgorithmKey).
	for _, b := range []Bucket{
		{Key: AlgorithmKey(key, rules.LeakyBucket), Algorithm: rules.LeakyBucket, Capacity: 20_000, Rate: 10_000},
		window(AlgorithmKey(key, rules.FixedWindow), rules.FixedWindow, 100, time.Minute),
		window(AlgorithmKey(key, rules.SlidingWindow), rules.SlidingWindow, 100, time.Minute),
		window(AlgorithmKey(key, rules.SlidingLog), rules.SlidingLog, 100, time.Minute),
	} {
		if _, _, err := e.store.Check(ctx, 1, []Bucket{b}); err != nil {
			t.Fatal(err)
		}
		t.Logf("MEMORY USAGE %s (%s, after one request) = %d bytes", b.Key, b.Algorithm, e.client.MemoryUsage(ctx, b.Key).Val())
	}
	// A global token bucket holding a share record, and the rule's marker.
	runID, err := e.store.RunID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.WriteMarker(ctx, "orders-free", Marker{Inc: 3, Seq: 7, Units: 300_000, Lease: time.Minute, Create: true, RunID: runID}); err != nil {
		t.Fatal(err)
	}
	gb := Bucket{Key: key, Algorithm: rules.TokenBucket, Capacity: 20_000_000, Rate: 10_000_000, Global: &Global{Rule: "orders-free", Units: 1_000_000, Floor: 100_000}}
	if _, _, err := e.store.Check(ctx, 1, []Bucket{gb}); err != nil {
		t.Fatal(err)
	}
	n, _ = e.client.MemoryUsage(ctx, key).Result()
	t.Logf("MEMORY USAGE %s global, no record = %d bytes (state %v)", key, n, decodeState(t, rules.TokenBucket, e.client.Get(ctx, key).Val()))
	// held, with the agent's Hold (a TTL: not counted by MEMORY USAGE)
	if _, err := e.store.WriteShares(ctx, "orders-free", []ShareRecord{{Key: key, Inc: 3, Seq: 123_456, Units: 412_345, Capacity: gb.Capacity, Rate: gb.Rate, Total: 1_000_000, Floor: 100_000, Hold: time.Hour}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.store.Check(ctx, 1, []Bucket{gb}); err != nil {
		t.Fatal(err)
	}
	n, _ = e.client.MemoryUsage(ctx, key).Result()
	t.Logf("MEMORY USAGE %s global, with a share record = %d bytes (state %v, PTTL %v)", key, n, decodeState(t, rules.TokenBucket, e.client.Get(ctx, key).Val()), e.client.PTTL(ctx, key).Val().Round(time.Second))
	if n > 104 {
		t.Fatalf("token bucket key with a share record uses %d bytes, want <= 104 (28 bytes of state)", n)
	}
	// Global windows holding a held share record (their enforcer's keys).
	for _, alg := range []rules.Algorithm{rules.FixedWindow, rules.SlidingWindow} {
		wk := AlgorithmKey(key, alg)
		wb := Bucket{Key: wk, Algorithm: alg, Limit: 100, Window: time.Minute, Global: &Global{Rule: "orders-free", Units: 1_000_000, Floor: 100_000}}
		if _, err := e.store.WriteShares(ctx, "orders-free", []ShareRecord{{Key: wk, Inc: 3, Seq: 123_457, Units: 412_345, Algorithm: alg, Limit: 100, Window: time.Minute, Total: 1_000_000, Floor: 100_000, Hold: time.Hour}}); err != nil {
			t.Fatal(err)
		}
		if _, _, err := e.store.Check(ctx, 1, []Bucket{wb}); err != nil {
			t.Fatal(err)
		}
		t.Logf("MEMORY USAGE %s (global %s, with a share record) = %d bytes", wk, alg, e.client.MemoryUsage(ctx, wk).Val())
	}
	mk := MarkerKey("orders-free")
	t.Logf("MEMORY USAGE %s (marker) = %d bytes", mk, e.client.MemoryUsage(ctx, mk).Val())
}

func TestTTL(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	e.clock.ms.Store(t0 + 300) // 300 ms into a 1s window
	tests := []struct {
		name string
		b    Bucket
		want time.Duration // slack 1s included
	}{
		{"token bucket: refill from empty + slack", tokenBucket(Key("u", "tb"), 5, 2), 3500 * time.Millisecond},
		{"leaky bucket: drain when full + slack", Bucket{Key: Key("u", "lb"), Algorithm: rules.LeakyBucket, Capacity: 3000, Rate: 1000}, 4000 * time.Millisecond},
		{"fixed window: window end + slack", window(Key("u", "fw"), rules.FixedWindow, 5, time.Second), 1700 * time.Millisecond},
		{"sliding window: next window end + slack", window(Key("u", "sw"), rules.SlidingWindow, 5, time.Second), 2700 * time.Millisecond},
		{"sliding log: window + slack", window(Key("u", "log"), rules.SlidingLog, 5, time.Second), 2000 * time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, err := e.store.Check(ctx, 1, []Bucket{tc.b}); err != nil {
				t.Fatal(err)
			}
			got := e.client.PTTL(ctx, tc.b.Key).Val()
			if got > tc.want || got < tc.want-500*time.Millisecond {
				t.Fatalf("PTTL %v, want %v", got, tc.want)
			}
		})
	}
	t.Run("at least 1s", func(t *testing.T) {
		s, err := New(e.client, WithClock(e.clock.now), WithTTLSlack(0))
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		k := Key("u", "fast")
		if _, _, err := s.Check(ctx, 1, []Bucket{tokenBucket(k, 1, 1000)}); err != nil {
			t.Fatal(err)
		}
		if got := e.client.PTTL(ctx, k).Val(); got > time.Second || got < 500*time.Millisecond {
			t.Fatalf("PTTL %v, want 1s", got)
		}
	})
}

// TestModelExpiry shows that a TTL never ends a key before it stands for the
// state a new key starts in: a model whose keys expire (slack 0) answers
// exactly like one whose keys never do, for random forward-moving traffic.
func TestModelExpiry(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	expiring, lasting := NewModel(time.Nanosecond), NewModel(1000*time.Hour)
	var expired int
	for seq := 0; seq < 300; seq++ {
		buckets := make([]Bucket, 1+r.IntN(3))
		for i := range buckets {
			buckets[i] = randomBucket(r, Key(fmt.Sprint(seq), fmt.Sprint(i)), false)
		}
		now := t0
		for st := 0; st < 100; st++ {
			now += r.Int64N(1 + r.Int64N(12_000))
			for _, b := range buckets {
				if k := expiring.keys[b.Key]; k != nil && k.expireAt <= now {
					expired++
				}
			}
			cost := 1 + r.Int64N(3)
			ok1, res1, err1 := expiring.Check(now, cost, buckets)
			ok2, res2, err2 := lasting.Check(now, cost, buckets)
			if err1 != nil || err2 != nil || ok1 != ok2 || fmt.Sprint(res1) != fmt.Sprint(res2) {
				t.Fatalf("seq %d step %d: expiring %v %v %v, lasting %v %v %v", seq, st, ok1, res1, err1, ok2, res2, err2)
			}
		}
	}
	t.Logf("%d expiries, no difference", expired)
	if expired == 0 {
		t.Fatal("no key expired")
	}
}

// TestScriptFlush: after SCRIPT FLUSH (or a restart) Check reloads the script.
func TestScriptFlush(t *testing.T) {
	e := newEnv(t, true)
	ctx := ctxT(t)
	b := []Bucket{tokenBucket(Key("u", "r"), 5, 1)}
	if _, _, err := e.store.Check(ctx, 1, b); err != nil {
		t.Fatal(err)
	}
	before := e.store.ScriptLoads()
	if before != 1 {
		t.Fatalf("ScriptLoads %d after first use, want 1", before)
	}
	if err := e.client.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	_, res, err := e.store.Check(ctx, 1, b)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Remaining != 3 {
		t.Fatalf("remaining %d, want 3", res[0].Remaining)
	}
	if got := e.store.ScriptLoads(); got != before+1 {
		t.Fatalf("ScriptLoads %d, want %d", got, before+1)
	}
	// WriteShares and WriteMarker reload their own scripts too
	if err := e.client.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.WriteShares(ctx, "g", []ShareRecord{{Key: Key("u", "g"), Inc: 1, Seq: 1, Units: 1, Capacity: 1000, Rate: 1000, Total: 1}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.WriteMarker(ctx, "g", Marker{Inc: 1, Seq: 1}); err != nil {
		t.Fatal(err)
	}
	if got := e.store.ScriptLoads(); got != before+3 {
		t.Fatalf("ScriptLoads %d, want %d", got, before+3)
	}
	// a restarted, empty server: reload, and the bucket starts full again
	e.redis.Restart(t)
	testutil.WaitFor(t, 5*time.Second, "check after restart", func() bool {
		_, res, err = e.store.Check(ctx, 1, b)
		return err == nil
	})
	if res[0].Remaining != 4 {
		t.Fatalf("remaining %d after restart, want 4", res[0].Remaining)
	}
}

// TestConcurrentAtomic: many goroutines race for one bucket through the
// pipeliner (with real Redis TIME); exactly the capacity is admitted, and a
// second, exhausted bucket in half of the requests makes those consume nothing.
func TestConcurrentAtomic(t *testing.T) {
	e := newEnv(t, true, WithWorkers(2), WithBatchSize(16))
	ctx := ctxT(t)
	// 100 tokens, refill 0.001 token/s: nothing refills during the test
	shared := Bucket{Key: Key("u", "shared"), Algorithm: rules.TokenBucket, Capacity: 100_000, Rate: 1}
	empty := window(Key("u", "empty"), rules.FixedWindow, 1, 24*time.Hour)
	if ok, _, err := e.store.Check(ctx, 1, []Bucket{empty}); !ok || err != nil {
		t.Fatal(ok, err)
	}
	var admitted, rejectedBoth atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 32; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 20; i++ {
				req := []Bucket{shared}
				if i%2 == 1 {
					req = append(req, empty)
				}
				ok, res, err := e.store.Check(ctx, 1, req)
				if err != nil {
					t.Error(err)
					return
				}
				if ok {
					admitted.Add(1)
				} else if len(req) == 2 && res[0].Allowed {
					rejectedBoth.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if admitted.Load() != 100 {
		t.Fatalf("admitted %d, want exactly 100", admitted.Load())
	}
	t.Logf("admitted %d; %d requests rejected by the second bucket while the first had room", admitted.Load(), rejectedBoth.Load())
}

// blackHole accepts connections and never answers.
func blackHole(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return l.Addr().String()
}

// TestDeadRedis: a server that never answers, or none at all, costs a caller
// its timeout and no more; Close does not hang either.
func TestDeadRedis(t *testing.T) {
	down := testutil.StartRedis(t)
	down.Stop()
	for _, tc := range []struct{ name, addr string }{{"black hole", blackHole(t)}, {"refused", down.Addr}} {
		t.Run(tc.name, func(t *testing.T) {
			client := redis.NewClient(&redis.Options{Addr: tc.addr, ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond, DialTimeout: 200 * time.Millisecond})
			defer client.Close()
			s, err := New(client)
			if err != nil {
				t.Fatal(err)
			}
			b := []Bucket{tokenBucket(Key("u", "r"), 5, 1)}
			var wg sync.WaitGroup
			for i := 0; i < 20; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
					defer cancel()
					start := time.Now()
					_, _, err := s.Check(ctx, 1, b)
					if err == nil {
						t.Error("Check succeeded against a dead server")
					}
					if el := time.Since(start); el > 250*time.Millisecond {
						t.Errorf("Check took %v with a 5ms timeout (err %v)", el, err)
					}
				}()
			}
			wg.Wait()
			// Close waits for pipelines in flight: at most the client's timeouts.
			start := time.Now()
			s.Close()
			if el := time.Since(start); el > 2*time.Second {
				t.Fatalf("Close took %v", el)
			}
		})
	}
}

func TestClose(t *testing.T) {
	base := runtime.NumGoroutine()
	e := newEnv(t, true, WithWorkers(3))
	ctx := ctxT(t)
	b := []Bucket{tokenBucket(Key("u", "r"), 5, 1)}
	if _, _, err := e.store.Check(ctx, 1, b); err != nil {
		t.Fatal(err)
	}
	if err := e.store.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.store.Close(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.store.Check(ctx, 1, b); !errors.Is(err, ErrClosed) {
		t.Fatalf("Check after Close: %v, want ErrClosed", err)
	}
	if err := e.client.Ping(ctx).Err(); err != nil {
		t.Fatalf("Close closed the client: %v", err)
	}
	e.client.Close()
	testutil.WaitFor(t, 5*time.Second, "store goroutines to exit", func() bool {
		return runtime.NumGoroutine() <= base+1 // +1: the redis-server waiter of testutil
	})
}
