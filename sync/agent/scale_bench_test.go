package agent

import (
	"fmt"
	"math"
	"os"
	"runtime"
	"sort"
	"strings"
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
// each do not fit the 2 cores of the development machine at 100 ms. It
// reports, per region and interval, the CPU the whole process spent
// (agents, NATS servers, the usage publishers: an upper bound for one
// agent), the report bytes each agent sent per active key per second, the
// whole process's heap per key per region (an upper bound), and the
// agents' own heap per key per region (agentHeap, plus the encoded reports
// in the agents' queues: the least and the most of three samples, of
// those in which every ledger held every key). It logs every sample with
// the keys each ledger holds, and the reports the agents rejected by
// reason.
//
//	go test -run '^$' -bench Agent100kKeys -benchtime 50x ./sync/agent/
func BenchmarkAgent100kKeys(b *testing.B) { benchAgent(b, benchKeys(), 500*time.Millisecond) }

// BenchmarkAgent1MKeys is BenchmarkAgent100kKeys with 1,000,000 active
// keys and an interval of 5 s (what three such agents take on two cores).
//
//	go test -run '^$' -bench Agent1MKeys -benchtime 3x -timeout 1h ./sync/agent/
func BenchmarkAgent1MKeys(b *testing.B) { benchAgent(b, 1_000_000, 5*time.Second) }

func benchAgent(b *testing.B, keys int, iv time.Duration) {
	// Every 64 KiB allocated, a sample for agentHeap (the default is 512 KiB).
	defer func(r int) { runtime.MemProfileRate = r }(runtime.MemProfileRate)
	runtime.MemProfileRate = 64 << 10
	testInterval = iv
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
	wait := 120 * time.Second * time.Duration(max(1, keys/100_000))
	deadline := time.Now().Add(wait)
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
			b.Fatalf("the agents did not coordinate %d keys within %v", keys, wait)
		}
	}
	// Three samples a third of an interval apart: the agents keep working
	// meanwhile, and what a tick has in hand (writes, reports, usage) is
	// in use when a sample falls into it.
	// The reports waiting for the agents' loops are kept encoded, in the
	// buffers the NATS client allocated: agentHeap does not see them, so
	// their bytes are added (queuedReports) and listed as a site.
	// Each sample is logged with the keys each ledger holds then (0 also
	// when the loop did not answer within shareViewTimeout: a busy loop).
	// Only the samples in which every ledger answered with every key count
	// (a ledger fenced just before a sample holds few keys and little
	// heap, which would flatter the figure), unless none did.
	sample := func() (float64, bool, []heapSite) {
		o, sites := agentHeap()
		q := queuedReports(s)
		sites = append(sites, heapSite{"(encoded reports queued for the loops)", q})
		sort.Slice(sites, func(a, b int) bool { return sites[a].bytes > sites[b].bytes })
		held, full := map[string]int{}, true
		for _, n := range s.names {
			held[n] = len(s.regions[n].agent.Shares(testRule))
			full = full && held[n] >= keys
		}
		b.Logf("sample: %.0f B/key/region (queued reports %.0f), keys held %v", (o+q)/3/float64(keys), q/3/float64(keys), held)
		return o + q, full, sites
	}
	var own, ownMax float64
	var sites []heapSite
	anyFull := false
	for i := 0; i < 3; i++ {
		if i > 0 {
			time.Sleep(interval / 3) // spacing the samples, not synchronisation
		}
		o, full, ss := sample()
		if anyFull && !full {
			continue
		}
		if full && !anyFull || o < own || sites == nil {
			own, sites = o, ss
		}
		if full && !anyFull {
			ownMax = 0
		}
		anyFull = anyFull || full
		ownMax = max(ownMax, o)
	}
	if !anyFull {
		b.Logf("no sample with every key in every ledger: the figures are of all samples")
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heap := ms.HeapAlloc
	var top strings.Builder
	for _, st := range sites[:min(len(sites), 12)] {
		fmt.Fprintf(&top, "\n%8.1f B/key/region  %s", st.bytes/3/float64(keys), st.site)
	}
	b.Logf("the agents' heap by allocating function:%s", top.String())
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
	b.Logf("reports rejected (all regions, whole run): %v", rejections(s))
	b.ReportMetric(float64(cpu.Microseconds())/1000/intervals/3, "cpu-ms/region/interval")
	b.ReportMetric(sent/3/float64(keys)/elapsed.Seconds(), "report-B/key/s")
	b.ReportMetric(float64(heap)/3/float64(keys), "process-heap-B/key/region")
	b.ReportMetric(own/3/float64(keys), "agent-heap-B/key/region")
	b.ReportMetric(ownMax/3/float64(keys), "agent-heap-max-B/key/region")
}

// heapSite is the in-use heap allocated at one place of the agents' code.
type heapSite struct {
	site  string
	bytes float64
}

// agentHeap returns, after a GC, the in-use heap the agents' own code
// allocated (the ledgers, the driver, the agents' maps and snapshots,
// reports and usage decoded for them), from the runtime's heap profile: a
// record counts if a frame of its allocation stack is in sync/agent,
// sync/driver, sync/ledger, sync/wire or regional/usage and none is in a
// _test.go file (the load generator, the in-memory store, the set-up).
// What the NATS servers, the etcd server and the NATS client's buffers hold
// is not counted. Records are scaled by the sampling rate as pprof does.
// It also returns the bytes per allocating function (the innermost frame
// in the project's code), largest first.
func agentHeap() (float64, []heapSite) {
	runtime.GC()
	runtime.GC()
	var recs []runtime.MemProfileRecord
	for {
		n, ok := runtime.MemProfile(recs, false)
		if ok {
			recs = recs[:n]
			break
		}
		recs = make([]runtime.MemProfileRecord, n+100)
	}
	rate := float64(runtime.MemProfileRate)
	bySite := map[string]float64{}
	var total float64
	for i := range recs {
		r := &recs[i]
		objs, bytes := r.InUseObjects(), r.InUseBytes()
		if objs <= 0 {
			continue
		}
		size := float64(bytes) / float64(objs)
		scaled := float64(bytes)
		if rate > 1 {
			scaled /= 1 - math.Exp(-size/rate)
		}
		own, site := false, ""
		frames := runtime.CallersFrames(r.Stack())
		for {
			f, more := frames.Next()
			if strings.HasSuffix(f.File, "_test.go") {
				own = false
				break
			}
			for _, dir := range []string{"/sync/agent/", "/sync/driver/", "/sync/ledger/", "/sync/wire/", "/regional/usage/"} {
				if strings.Contains(f.File, dir) {
					own = true
					if site == "" {
						site = strings.TrimPrefix(f.Function, "github.com/apportion/apportion/")
					}
				}
			}
			if !more {
				break
			}
		}
		if own {
			total += scaled
			bySite[site] += scaled
		}
	}
	var sites []heapSite
	for s, b := range bySite {
		sites = append(sites, heapSite{s, b})
	}
	sort.Slice(sites, func(a, b int) bool { return sites[a].bytes > sites[b].bytes })
	return total, sites
}

// queuedReports is the bytes of the encoded reports in the agents' queues.
func queuedReports(s *stack) float64 {
	total := 0.0
	for _, n := range s.names {
		total += float64(s.regions[n].agent.inbox.queued())
	}
	return total
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

// rejections is apportion_sync_reports_rejected_total by reason, summed
// over the regions.
func rejections(s *stack) map[string]float64 {
	out := map[string]float64{}
	for _, n := range s.names {
		mfs, _ := s.regions[n].reg.Gather()
		for _, mf := range mfs {
			if mf.GetName() == "apportion_sync_reports_rejected_total" {
				for _, m := range mf.GetMetric() {
					out[labelOf(m, "reason")] += m.GetCounter().GetValue()
				}
			}
		}
	}
	return out
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
