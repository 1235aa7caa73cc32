package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// BenchmarkCheck measures Check against a redis-server started by the
// benchmark, with Redis TIME. Run: go test -run '^$' -bench Check -benchtime 2s ./regional/redisstore/
func BenchmarkCheck(b *testing.B) {
	e := newEnv(b, true)
	ctx := context.Background()
	bucketsFor := func(i int, n int) []Bucket {
		tag := fmt.Sprintf("user:%d", i%1000)
		bs := []Bucket{{Key: Key(tag, "tb"), Algorithm: rules.TokenBucket, Capacity: 1_000_000_000, Rate: 1_000_000_000}}
		if n > 1 {
			bs = append(bs, window(Key(tag, "sw"), rules.SlidingWindow, 1_000_000, time.Minute))
		}
		if n > 2 {
			bs = append(bs, window(Key(tag, "fw"), rules.FixedWindow, 1_000_000, time.Hour))
		}
		return bs
	}
	// Redis's CPU time (INFO cpu, user + system) per check: what a check
	// costs Redis, which the machine's other load moves far less than
	// throughput.
	redisCPU := func(b *testing.B) float64 {
		info, err := e.client.Info(ctx, "cpu").Result()
		if err != nil {
			b.Fatal(err)
		}
		var sec float64
		for _, l := range strings.Split(info, "\n") {
			for _, f := range []string{"used_cpu_sys:", "used_cpu_user:"} {
				if v, ok := strings.CutPrefix(strings.TrimSpace(l), f); ok {
					x, err := strconv.ParseFloat(v, 64)
					if err != nil {
						b.Fatal(err)
					}
					sec += x
				}
			}
		}
		return sec
	}
	var cpu0 float64
	report := func(b *testing.B, p0, c0 uint64) {
		if p := e.store.pipelines.Load() - p0; p > 0 {
			b.ReportMetric(float64(e.store.batched.Load()-c0)/float64(p), "checks/pipeline")
		}
		b.ReportMetric((redisCPU(b)-cpu0)*1e6/float64(b.N), "redis-cpu-µs/op")
	}
	for _, n := range []int{1, 3} {
		b.Run(fmt.Sprintf("serial/buckets=%d", n), func(b *testing.B) {
			bs := bucketsFor(0, n)
			p0, c0 := e.store.pipelines.Load(), e.store.batched.Load()
			cpu0 = redisCPU(b)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, _, err := e.store.Check(ctx, 1, bs); err != nil {
					b.Fatal(err)
				}
			}
			report(b, p0, c0)
		})
		b.Run(fmt.Sprintf("parallel/buckets=%d", n), func(b *testing.B) {
			b.SetParallelism(64) // 64 x GOMAXPROCS goroutines
			var next atomic.Int64
			p0, c0 := e.store.pipelines.Load(), e.store.batched.Load()
			cpu0 = redisCPU(b)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				bs := bucketsFor(int(next.Add(1)), n)
				for pb.Next() {
					if _, _, err := e.store.Check(ctx, 1, bs); err != nil {
						b.Error(err)
						return
					}
				}
			})
			report(b, p0, c0)
		})
	}
}

// BenchmarkModel is the pure Go reference, for comparison.
func BenchmarkModel(b *testing.B) {
	m := NewModel(0)
	bs := []Bucket{{Key: Key("u", "tb"), Algorithm: rules.TokenBucket, Capacity: 1_000_000_000, Rate: 1_000_000_000}}
	for i := 0; i < b.N; i++ {
		m.Check(t0+int64(i), 1, bs)
	}
}

// BenchmarkCheckGlobal measures a global token bucket without a marker (the
// floor) and with a valid marker, and reports the Redis time per script call
// (INFO commandstats): with a valid marker the script also reads INFO server
// to compare run ids, which is its largest cost.
//
//	go test -run '^$' -bench CheckGlobal -benchtime 20000x ./regional/redisstore/
func BenchmarkCheckGlobal(b *testing.B) {
	r := testutil.StartRedis(b)
	rc := redis.NewClient(&redis.Options{Addr: r.Addr})
	b.Cleanup(func() { rc.Close() })
	s, err := New(rc)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	ctx := context.Background()
	for _, marker := range []bool{false, true} {
		if marker {
			id, err := s.RunID(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := s.WriteMarker(ctx, "g", Marker{Inc: 1, Seq: 1, Units: 500000, Lease: time.Hour, Create: true, RunID: id}); err != nil {
				b.Fatal(err)
			}
		}
		b.Run(fmt.Sprintf("marker=%v", marker), func(b *testing.B) {
			if err := rc.ConfigResetStat(ctx).Err(); err != nil {
				b.Fatal(err)
			}
			for i := 0; i < b.N; i++ {
				bk := []Bucket{{Key: Key(fmt.Sprint(i%100), "g"), Algorithm: rules.TokenBucket, Capacity: 1e9, Rate: 1e9,
					Global: &Global{Rule: "g", Units: 1000000, Floor: 25000}}}
				if _, _, err := s.Check(ctx, 1, bk); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(commandstat(b, rc, "evalsha", "usec_per_call"), "redis-µs/call")
		})
	}
}

// BenchmarkWriteShares measures one WriteShares call of n share records
// (a sync agent's store call; the agent writes a flush's records in calls
// of at most 1,024): per record, the time and the heap the call allocates,
// most of it go-redis's command for each record, held until the call
// returns.
//
//	go test -run '^$' -bench WriteShares -benchmem ./regional/redisstore/
func BenchmarkWriteShares(b *testing.B) {
	s := newEnv(b, true).store
	ctx := context.Background()
	for _, n := range []int{256, 1024, 4096} {
		recs := make([]ShareRecord, n)
		for i := range recs {
			recs[i] = ShareRecord{Key: Key(fmt.Sprintf("user:%d", i), "g"), Inc: 1, Units: 250, Capacity: 1e6, Rate: 1e6,
				Total: 1000, Floor: 25, TTL: time.Minute, Hold: time.Hour}
		}
		b.Run(fmt.Sprintf("records=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				for j := range recs {
					recs[j].Seq = uint64(i + 1)
				}
				if _, err := s.WriteShares(ctx, "g", recs); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/record")
		})
	}
}
