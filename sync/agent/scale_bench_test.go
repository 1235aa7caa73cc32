package agent

import (
	"fmt"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/regional/usage"
	"github.com/nats-io/nats.go"
	dto "github.com/prometheus/client_model/go"
)

// BenchmarkAgent100kKeys runs three real agents (a NATS super-cluster, one
// etcd, the in-memory contract store instead of Redis) with 100,000 active
// keys of one global rule: every interval each region's enforcers report
// usage for every key (a: 8, b: 4, c: 1 per key and interval, against a
// global 100/s per key: contested, so shares keep moving). One iteration is
// one sync interval: 500 ms here, because three agents with 100,000 keys
// each do not fit the 2 cores of the development machine at 100 ms. It reports, per region and interval, the CPU
// the whole process spent (agents, NATS servers, the usage publishers:
// an upper bound for one agent), the report bytes each agent sent per
// active key per second, and the heap per key per region.
//
//	go test -run '^$' -bench Agent100kKeys -benchtime 50x ./sync/agent/
func BenchmarkAgent100kKeys(b *testing.B) {
	keys := benchKeys()
	testInterval = 500 * time.Millisecond
	defer func() { testInterval = 0 }()
	w := &world{}
	s := newStack(b, func(n string) (Store, *memStore) {
		m := newMemStore(w, n)
		return m, m
	})
	rule := globalRule()
	rule.Capacity, rule.RefillPerSecond = 100, 100
	s.putRule(b, rule)
	names := make([]string, keys)
	for i := range names {
		names[i] = fmt.Sprintf("rl:{user:%d}:%s", i, testRule)
	}
	demand := map[string]int64{"a": 8, "b": 4, "c": 1}
	pubs := map[string]*nats.Conn{}
	for _, n := range s.names {
		pubs[n] = s.cluster[n].Connect(b)
	}
	seq := uint64(0)
	publish := func() {
		for _, n := range s.names {
			seq++
			ds := make([]usage.Delta, keys)
			for i, k := range names {
				ds[i] = usage.Delta{Rule: testRule, Key: k, Admitted: demand[n]}
			}
			msgs, err := usage.EncodeSplit(usage.Batch{Region: n, Enforcer: "bench", Seq: seq, Deltas: ds}, 512<<10)
			if err != nil {
				b.Fatal(err)
			}
			for _, m := range msgs {
				pubs[n].Publish(usage.Subject(n), m)
			}
			pubs[n].Flush()
		}
	}
	interval := testInterval
	// Warm up until every region coordinates every key.
	deadline := time.Now().Add(120 * time.Second)
	for {
		publish()
		time.Sleep(interval) // pacing the load generator, not synchronisation
		all := true
		for _, n := range s.names {
			if len(s.regions[n].agent.Shares(testRule)) < keys {
				all = false
			}
		}
		if all {
			break
		}
		if time.Now().After(deadline) {
			for _, n := range s.names {
				mfs, _ := s.regions[n].reg.Gather()
				for _, mf := range mfs {
					for _, m := range mf.GetMetric() {
						if m.GetCounter() != nil && m.GetCounter().GetValue() > 0 {
							b.Logf("%s %s %v %v", n, mf.GetName(), m.GetLabel(), m.GetCounter().GetValue())
						}
					}
				}
				b.Logf("%s coordinates %d keys", n, len(s.regions[n].agent.Shares(testRule)))
			}
			b.Fatalf("the agents did not coordinate %d keys within 120s", keys)
		}
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heap := ms.HeapAlloc
	sent0 := sentBytes(s)
	cpu0 := cpuTime()
	start := time.Now()
	b.ResetTimer()
	next := time.Now()
	for i := 0; i < b.N; i++ {
		publish()
		next = next.Add(interval)
		time.Sleep(time.Until(next))
	}
	b.StopTimer()
	elapsed := time.Since(start)
	cpu := cpuTime() - cpu0
	sent := sentBytes(s) - sent0
	intervals := elapsed.Seconds() / interval.Seconds()
	b.ReportMetric(float64(cpu.Microseconds())/1000/intervals/3, "cpu-ms/region/interval")
	b.ReportMetric(sent/3/float64(keys)/elapsed.Seconds(), "report-B/key/s")
	b.ReportMetric(float64(heap)/3/float64(keys), "heap-B/key/region")
}

func sentBytes(s *stack) float64 {
	total := 0.0
	for _, n := range s.names {
		mfs, _ := s.regions[n].reg.Gather()
		for _, mf := range mfs {
			if mf.GetName() != "apportion_sync_report_bytes_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				if labelOf(m, "direction") == "sent" {
					total += m.GetCounter().GetValue()
				}
			}
		}
	}
	return total
}

func labelOf(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchKeys is 100,000, or APPORTION_BENCH_KEYS for profiling smaller runs.
func benchKeys() int {
	var n int
	if _, err := fmt.Sscan(getenv("APPORTION_BENCH_KEYS"), &n); err == nil && n > 0 {
		return n
	}
	return 100_000
}

var getenv = os.Getenv
