package agent

import (
	"context"
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
	"github.com/apportion/apportion/sync/ledger"
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
// those in which every ledger held every key), and the fences (new
// incarnations) of the warm-up and of the measured intervals (fences-warmup,
// fences). The warm-up lasts until the agents have converged (every ledger
// holds every key, every marker is of its ledger's incarnation, and no
// incarnation changed for 16 intervals), so the figures are of the steady
// state. It logs every sample with the keys each ledger holds, and the
// reports the agents rejected by reason.
//
//	go test -run '^$' -bench Agent100kKeys -benchtime 50x ./sync/agent/
//
// APPORTION_BENCH_INTERVAL (a Go duration) sets another interval: the
// lease is 30 intervals whatever it is, and the heap per key does not
// depend on it, but whether three loops keep up on two shared cores does
// (a loop that falls behind holds reports queued and in hand).
// APPORTION_BENCH_SITES (any value) logs every sample's ten largest
// allocating functions, not only those of the least sample.
func BenchmarkAgent100kKeys(b *testing.B) {
	benchAgent(b, benchKeys(), benchInterval(500*time.Millisecond))
}

// BenchmarkAgent1MKeys is BenchmarkAgent100kKeys with 1,000,000 active
// keys and an interval of 5 s (what three such agents take on two cores).
//
//	go test -run '^$' -bench Agent1MKeys -benchtime 3x -timeout 1h ./sync/agent/
func BenchmarkAgent1MKeys(b *testing.B) { benchAgent(b, 1_000_000, benchInterval(5*time.Second)) }

func benchAgent(b *testing.B, keys int, iv time.Duration) {
	// Every 64 KiB allocated, a sample for agentHeap (the default is 512 KiB).
	defer func(r int) { runtime.MemProfileRate = r }(runtime.MemProfileRate)
	runtime.MemProfileRate = 64 << 10
	testInterval, testUsageKeys = iv, keys
	defer func() { testInterval, testUsageKeys = 0, 0 }()
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
	// Warm up until the agents have converged: every ledger holds every
	// key, every store's marker is of its region's current incarnation
	// and unexpired, and no incarnation changed (no fence) for
	// stableChecks intervals in a row. The first tick's usage creates every
	// key at once, so "every key held" alone ends the warm-up inside the
	// start, where the loops are furthest behind.
	const stableChecks = 16
	wait := 240 * time.Second * time.Duration(max(1, keys/100_000))
	deadline := time.Now().Add(wait)
	fences := newFenceCount(s)
	stable := 0
	for stable < stableChecks {
		publish()
		time.Sleep(interval) // pacing the load generator, not synchronisation
		changed := fences.probe()
		ok := !changed
		for _, n := range s.names {
			p := fences.last[n]
			ok = ok && p.keys >= keys && p.inc > 0 && markerAt(s.regions[n].mem, testRule, p.inc)
		}
		if ok {
			stable++
		} else {
			stable = 0
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
				b.Logf("%s: %+v", n, fences.last[n])
			}
			b.Fatalf("the agents did not converge on %d keys within %v (%d fences)", keys, wait, fences.n())
		}
	}
	warmFences := fences.n()
	b.Logf("converged after %d fences (warm-up)", warmFences)
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
		if os.Getenv("APPORTION_BENCH_SITES") != "" {
			for _, st := range sites[:min(len(sites), 10)] {
				b.Logf("  %8.1f B/key/region  %s", st.bytes/3/float64(keys), st.site)
			}
		}
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
	fences.probe()
	runFences := fences.n() - warmFences
	b.Logf("fences: %d in the warm-up, %d after it", warmFences, runFences)
	intervals := elapsed.Seconds() / interval.Seconds()
	b.Logf("reports rejected (all regions, whole run): %v", rejections(s))
	b.ReportMetric(float64(cpu.Microseconds())/1000/intervals/3, "cpu-ms/region/interval")
	b.ReportMetric(sent/3/float64(keys)/elapsed.Seconds(), "report-B/key/s")
	b.ReportMetric(float64(heap)/3/float64(keys), "process-heap-B/key/region")
	b.ReportMetric(own/3/float64(keys), "agent-heap-B/key/region")
	b.ReportMetric(ownMax/3/float64(keys), "agent-heap-max-B/key/region")
	b.ReportMetric(float64(warmFences), "fences-warmup")
	b.ReportMetric(float64(runFences), "fences")
}

// ledgerProbe is what a region's loop answered of its ledger of testRule.
type ledgerProbe struct {
	keys int    // keys held
	inc  uint64 // its incarnation; 0: none (fenced, or starting)
}

// fenceCount counts the fences of the regions' ledgers of testRule from
// their incarnations (each fence starts a new one): the highest seen per
// region, less the first, plus one while a region has no ledger.
type fenceCount struct {
	s    *stack
	max  map[string]uint64
	last map[string]ledgerProbe
}

func newFenceCount(s *stack) *fenceCount {
	return &fenceCount{s: s, max: map[string]uint64{}, last: map[string]ledgerProbe{}}
}

// probe asks every region's loop (counting keys without copying them)
// and reports whether an incarnation changed since the last probe.
func (f *fenceCount) probe() (changed bool) {
	for _, n := range f.s.names {
		a := f.s.regions[n].agent
		var p ledgerProbe
		ctx, cancel := context.WithTimeout(context.Background(), shareViewTimeout)
		err := a.onLoop(ctx, func() {
			if st := a.rules[testRule]; st != nil && st.Led != nil {
				p.inc = st.Led.Incarnation().Inc
				st.Led.Each(func(string, ledger.Share) { p.keys++ })
			}
		})
		cancel()
		if err != nil {
			p = f.last[n] // a busy loop: nothing learnt
		}
		changed = changed || p.inc != f.last[n].inc
		f.last[n] = p
		f.max[n] = max(f.max[n], p.inc)
	}
	return changed
}

// n is the fences counted so far.
func (f *fenceCount) n() int {
	total := 0
	for _, n := range f.s.names {
		if f.max[n] > 1 {
			total += int(f.max[n] - 1)
		}
		if f.max[n] > 0 && f.last[n].inc == 0 {
			total++
		}
	}
	return total
}

// markerAt reports whether m holds rule's marker at incarnation inc, unexpired.
func markerAt(m *memStore, rule string, inc uint64) bool {
	m.w.mu.Lock()
	defer m.w.mu.Unlock()
	mk := m.markers[rule]
	return mk != nil && mk.v.Inc == inc && time.Now().Before(mk.expires)
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
// is not counted: nor is a record whose innermost frame outside the
// runtime and the standard library is another module's (allocated by the
// NATS or etcd client, even when an agent's frame called it: the NATS
// client's write buffer keeps the capacity of the largest message it
// was given, up to its max payload, a constant per connection that
// counted about 50 B per key and region at 20,000 keys before 3 December
// 2026). Records are scaled by the sampling rate as pprof does.
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
		if foreignAlloc(r.Stack()) {
			continue
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

// foreignAlloc reports whether the innermost frame of stack outside the
// runtime and the standard library (a package path whose first element
// has no dot) is in another module than this project's.
func foreignAlloc(stack []uintptr) bool {
	frames := runtime.CallersFrames(stack)
	for {
		f, more := frames.Next()
		first, _, _ := strings.Cut(f.Function, "/")
		if strings.Contains(first, ".") && !strings.HasPrefix(first, "runtime.") {
			return !strings.HasPrefix(f.Function, "github.com/apportion/apportion/")
		}
		if !more {
			return false
		}
	}
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

// benchInterval is APPORTION_BENCH_INTERVAL, or def.
func benchInterval(def time.Duration) time.Duration {
	if d, err := time.ParseDuration(getenv("APPORTION_BENCH_INTERVAL")); err == nil && d > 0 {
		return d
	}
	return def
}

var getenv = os.Getenv
