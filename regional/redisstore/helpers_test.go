package redisstore

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/redis/go-redis/v9"
)

// fakeClock is a settable clock in ms for WithClock.
type fakeClock struct{ ms atomic.Int64 }

func (c *fakeClock) now() time.Time { return time.UnixMilli(c.ms.Load()) }

type env struct {
	redis  *testutil.Redis
	client *redis.Client
	store  *Store
	clock  *fakeClock
}

// newEnv starts a redis-server and a Store on it. With a fake clock unless
// realTime is set.
func newEnv(tb testing.TB, realTime bool, opts ...Option) *env {
	tb.Helper()
	r := testutil.StartRedis(tb)
	client := redis.NewClient(&redis.Options{Addr: r.Addr, PoolSize: 64})
	tb.Cleanup(func() { client.Close() })
	e := &env{redis: r, client: client, clock: &fakeClock{}}
	if !realTime {
		opts = append([]Option{WithClock(e.clock.now)}, opts...)
	}
	s, err := New(client, opts...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { s.Close() })
	e.store = s
	return e
}

func ctxT(tb testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	tb.Cleanup(cancel)
	return ctx
}

// impl is one implementation under the contract suite.
type impl interface {
	check(tb testing.TB, nowMs, cost int64, buckets ...Bucket) (bool, []Result)
	marker(tb testing.TB, nowMs int64, rule string, m Marker) Version
	shares(tb testing.TB, nowMs int64, rule string, recs ...ShareRecord) []Version
	runID(tb testing.TB) string
	persistent(tb testing.TB, nowMs int64, key string) bool // the key exists without a TTL
	pttl(tb testing.TB, nowMs int64, key string) int64      // ms left (Redis: on its own clock); -1 none, -2 no key
}

type modelImpl struct{ m *Model }

func (mi modelImpl) check(tb testing.TB, nowMs, cost int64, buckets ...Bucket) (bool, []Result) {
	tb.Helper()
	ok, res, err := mi.m.Check(nowMs, cost, buckets)
	if err != nil {
		tb.Fatal(err)
	}
	return ok, res
}

func (mi modelImpl) marker(tb testing.TB, nowMs int64, rule string, m Marker) Version {
	tb.Helper()
	v, err := mi.m.WriteMarker(nowMs, rule, m)
	if err != nil {
		tb.Fatal(err)
	}
	return v
}

func (mi modelImpl) shares(tb testing.TB, nowMs int64, rule string, recs ...ShareRecord) []Version {
	tb.Helper()
	v, err := mi.m.WriteShares(nowMs, rule, recs)
	if err != nil {
		tb.Fatal(err)
	}
	return v
}

func (mi modelImpl) runID(testing.TB) string { return mi.m.RunID() }

func (mi modelImpl) persistent(tb testing.TB, nowMs int64, key string) bool {
	return mi.m.PTTL(nowMs, key) == -1
}

func (mi modelImpl) pttl(_ testing.TB, nowMs int64, key string) int64 { return mi.m.PTTL(nowMs, key) }

type redisImpl struct{ e *env }

func (ri redisImpl) check(tb testing.TB, nowMs, cost int64, buckets ...Bucket) (bool, []Result) {
	tb.Helper()
	ri.e.clock.ms.Store(nowMs)
	ok, res, err := ri.e.store.Check(ctxT(tb), cost, buckets)
	if err != nil {
		tb.Fatal(err)
	}
	return ok, res
}

func (ri redisImpl) marker(tb testing.TB, nowMs int64, rule string, m Marker) Version {
	tb.Helper()
	ri.e.clock.ms.Store(nowMs)
	v, err := ri.e.store.WriteMarker(ctxT(tb), rule, m)
	if err != nil {
		tb.Fatal(err)
	}
	return v
}

func (ri redisImpl) shares(tb testing.TB, nowMs int64, rule string, recs ...ShareRecord) []Version {
	tb.Helper()
	ri.e.clock.ms.Store(nowMs)
	v, err := ri.e.store.WriteShares(ctxT(tb), rule, recs)
	if err != nil {
		tb.Fatal(err)
	}
	return v
}

func (ri redisImpl) runID(tb testing.TB) string {
	tb.Helper()
	id, err := ri.e.store.RunID(ctxT(tb))
	if err != nil {
		tb.Fatal(err)
	}
	return id
}

func (ri redisImpl) persistent(tb testing.TB, _ int64, key string) bool {
	tb.Helper()
	d, err := ri.e.client.PTTL(ctxT(tb), key).Result()
	if err != nil {
		tb.Fatal(err)
	}
	return d == -1 // go-redis returns -1 (ns) for no TTL, -2 for no key
}

func (ri redisImpl) pttl(tb testing.TB, _ int64, key string) int64 {
	tb.Helper()
	d, err := ri.e.client.PTTL(ctxT(tb), key).Result()
	if err != nil {
		tb.Fatal(err)
	}
	if d < 0 {
		return int64(d) // -1 (no TTL) or -2 (no key), as go-redis returns them
	}
	return d.Milliseconds()
}

// forEachImpl runs f against the model and against the script in Redis.
func forEachImpl(t *testing.T, f func(t *testing.T, im impl)) {
	t.Run("model", func(t *testing.T) { f(t, modelImpl{NewModel(0)}) })
	t.Run("redis", func(t *testing.T) { f(t, redisImpl{newEnv(t, false)}) })
}
