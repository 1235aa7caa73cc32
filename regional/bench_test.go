package regional

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/rules"
)

// BenchmarkCheckLimitGRPC measures CheckLimit end to end: gRPC on loopback,
// the enforcer, and one Redis script call per request against a real
// redis-server, with many concurrent callers (GOMAXPROCS x 32) pipelined to
// Redis. It reports p50 and p99 latency alongside ns/op (= 1/throughput).
func BenchmarkCheckLimitGRPC(b *testing.B) {
	e := newBenchEnv(b)
	var n atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	b.SetParallelism(32)
	b.ResetTimer()
	done := reportCPU(b)
	b.RunParallel(func(pb *testing.PB) {
		local := make([]time.Duration, 0, 1024)
		req := &ratelimitv1.CheckLimitRequest{Resource: "GET /bench"}
		for pb.Next() {
			req.ClientKey = fmt.Sprintf("bench:%d", n.Add(1)%1000)
			t0 := time.Now()
			resp, err := e.client.CheckLimit(context.Background(), req)
			local = append(local, time.Since(t0))
			if err != nil || resp.FailOpen {
				b.Errorf("check: err=%v fail_open=%v", err, resp.GetFailOpen())
				return
			}
		}
		mu.Lock()
		lat = append(lat, local...)
		mu.Unlock()
	})
	b.StopTimer()
	done()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	if len(lat) > 0 {
		b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
		b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
	}
}

// BenchmarkCheckLimitsGRPC is BenchmarkCheckLimitGRPC with CheckLimits of
// 32 requests (distinct keys) per op; decisions/s = 32 x ops/s.
func BenchmarkCheckLimitsGRPC(b *testing.B) {
	e := newBenchEnv(b)
	var n atomic.Int64
	b.SetParallelism(4)
	b.ResetTimer()
	done := reportCPU(b)
	b.RunParallel(func(pb *testing.PB) {
		req := &ratelimitv1.CheckLimitsRequest{Requests: make([]*ratelimitv1.CheckLimitRequest, 32)}
		for i := range req.Requests {
			req.Requests[i] = &ratelimitv1.CheckLimitRequest{Resource: "GET /bench"}
		}
		for pb.Next() {
			for _, r := range req.Requests {
				r.ClientKey = fmt.Sprintf("bench:%d", n.Add(1)%1000)
			}
			resp, err := e.client.CheckLimits(context.Background(), req)
			if err != nil {
				b.Errorf("check: %v", err)
				return
			}
			for _, r := range resp.Responses {
				if r.FailOpen || !r.Allowed {
					b.Errorf("answer %+v", r)
					return
				}
			}
		}
	})
	done()
	b.ReportMetric(float64(b.N)*32/b.Elapsed().Seconds(), "decisions/s")
}

// reportCPU adds this process's CPU time (user + system, every thread) and
// context switches (voluntary + involuntary) per op since it was called: the
// figures of a benchmark that the machine's other load moves least. Call
// it after the setup and ResetTimer; call the function it returns at the end.
// The process includes the benchmark's own gRPC client, not Redis.
func reportCPU(b *testing.B) func() {
	var r0 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &r0)
	return func() {
		var r1 syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &r1)
		cpu := time.Duration(r1.Utime.Nano() + r1.Stime.Nano() - r0.Utime.Nano() - r0.Stime.Nano())
		b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/op")
		b.ReportMetric(float64(r1.Nvcsw+r1.Nivcsw-r0.Nvcsw-r0.Nivcsw)/float64(b.N), "csw/op")
	}
}

func newBenchEnv(b *testing.B) *env {
	return newEnvTB(b, []rules.Rule{tokenBucket("bench", 1000000, 1000000)}, func(c *Config) { c.Timeout = time.Second })
}

// BenchmarkEnforcerCheckRules shows that check latency does not depend on the
// number of rules loaded: the same request (matching 1 rule) with 1 and with
// 1,000 rules in the set, through the enforcer and a real Redis.
func BenchmarkEnforcerCheckRules(b *testing.B) {
	for _, n := range []int{1, 1000} {
		b.Run(fmt.Sprintf("rules=%d", n), func(b *testing.B) {
			rs := []rules.Rule{tokenBucket("bench", 1000000, 1000000)}
			rs[0].Match = map[string]string{"resource": "GET /bench"}
			for i := 1; i < n; i++ {
				r := tokenBucket(fmt.Sprintf("other-%d", i), 10, 1)
				r.Match = map[string]string{"resource": fmt.Sprintf("GET /other/%d", i), "tier": "*"}
				if i%2 == 0 {
					r.Match = map[string]string{"resource": fmt.Sprintf("POST /x/%d", i)}
				}
				rs = append(rs, r)
			}
			e := newEnvTB(b, rs, func(c *Config) { c.Timeout = time.Second })
			var n atomic.Int64
			b.SetParallelism(16)
			b.ResetTimer()
			done := reportCPU(b)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					resp, err := e.enf.Check(context.Background(), Request{ClientKey: fmt.Sprintf("k:%d", n.Add(1)%1000), Resource: "GET /bench"})
					if err != nil || resp.RuleID != "bench" || resp.FailOpen {
						b.Errorf("check: %+v %v", resp, err)
						return
					}
				}
			})
			done()
		})
	}
}
