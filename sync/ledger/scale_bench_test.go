package ledger

import (
	"fmt"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/allocation"
)

// The ledger at scale: a region of three holding n active keys, each with
// gifts both ways (pairs, confirmed writes, the peers' positions), the way
// a global rule with n active keys sits in the agent. Reported: heap per
// key (after GC, names included), and the time of one Tick with usage on
// every key.
//
//	go test -run '^$' -bench 'BenchmarkLedger(100k|1M)Keys' -benchtime 5x ./sync/ledger

func BenchmarkLedger100kKeys(b *testing.B) { benchLedger(b, 100_000, false) }
func BenchmarkLedger1MKeys(b *testing.B)   { benchLedger(b, 1_000_000, false) }

// BenchmarkLedgerReceive100kKeys is the same ledger receiving instead of
// ticking: one iteration is a full report of every key from each of the two
// peers (a newer sequence, the same counters), the agent's other per-key
// work every interval.
//
//	go test -run '^$' -bench 'BenchmarkLedgerReceive100kKeys' -benchtime 5x ./sync/ledger
func BenchmarkLedgerReceive100kKeys(b *testing.B) { benchLedger(b, 100_000, true) }

func heapNow() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

func benchLedger(b *testing.B, n int, receive bool) {
	cfg := DefaultConfig()
	cfg.Allocate = AllocatorOf(allocation.MaxMinFair) // the agent's (agent.Config.LedgerConfig)
	regions := []RegionSpec{{"r0", 1}, {"r1", 1}, {"r2", 1}}
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("rl:{user:%07d}:orders", i)
	}
	before := heapNow()
	now := time.Duration(0)
	l, err := New(cfg, "r0", regions, Start{Inc: 1, RunID: "run"}, now)
	if err != nil {
		b.Fatal(err)
	}
	confirm := func(out Output) {
		var cs []Confirmation
		for _, w := range out.Writes {
			cs = append(cs, Confirmation{w.Key, w.Version})
		}
		if o := l.SharesApplied(now, cs); len(o.Writes) > 0 {
			b.Fatal("writes from a confirmation")
		}
	}
	tick := func() Output {
		now += cfg.Interval
		for _, name := range names {
			l.Usage(now, name, 1000, 10, 0)
		}
		out := l.Tick(now)
		confirm(out)
		return out
	}
	for _, w := range l.Tick(now).Writes {
		if w.Key == MarkerKey {
			l.ShareApplied(now, w.Key, w.Version)
		}
	}
	// The peers: r1 has demand on every key and gives nothing, r2 has none
	// and gives r0 1000 units of each: r0 gives to r1 and takes from r2.
	peer := func(from string, seq uint64, demand, pos int64, gave []Counter) Report {
		r := Report{From: from, Inc: 1, Seq: seq, Base: l.initial[1] + l.floor[1],
			Acks: []Ack{{Region: "r0", Inc: 1, Seq: l.rseq}}}
		for _, name := range sortedCopy(names) {
			r.Keys = append(r.Keys, KeyReport{Key: name, Demand: demand, Position: pos, Gave: gave})
		}
		return r
	}
	tick()
	base := l.initial[1] + l.floor[1]
	reports := []Report{
		peer("r1", 1, 3*base, base, nil),
		peer("r2", 1, 0, base-1000, []Counter{{"r0", 1, 1000}}),
	}
	recv := func() {
		for j := range reports {
			out, err := l.Receive(now, reports[j])
			if err != nil {
				b.Fatal(err)
			}
			confirm(out)
			reports[j].Seq++
			reports[j].Acks[0].Seq = l.rseq
		}
	}
	recv()
	for i := 0; i < 3; i++ {
		tick()
	}
	k := l.keys[names[0]]
	if l.pair(k, 1).conf == 0 || l.pair(k, 2).recv != 1000 {
		b.Fatalf("setup: want gifts both ways, got %+v", l.pairsOf(k))
	}
	if !receive {
		reports = nil // B/key is the ledger's
	}
	perKey := float64(heapNow()-before) / float64(n)
	// What a key's unconfirmed write keeps in the ledger (its snapshot,
	// key.pend) until the store confirms it: the heap with every key's
	// write unconfirmed (after a store reset, which writes every key
	// again), less the heap once confirmed (the confirmations held in
	// both). The ticks below start from that reset.
	var pendKey float64
	if !receive {
		var cs []Confirmation
		for _, w := range l.StoreReset(now, "run-2").Writes {
			cs = append(cs, Confirmation{w.Key, w.Version})
		}
		if len(cs) < n {
			b.Fatalf("%d writes after a store reset, want every key's (%d)", len(cs), n)
		}
		pending := heapNow()
		l.SharesApplied(now, cs)
		pendKey = (float64(pending) - float64(heapNow())) / float64(n)
		runtime.KeepAlive(cs)
	}
	b.ResetTimer()
	cpu0 := cpuTime()
	step, unit := func() { tick() }, "tick"
	if receive {
		step, unit = recv, "2reports"
	}
	for i := 0; i < b.N; i++ {
		step()
	}
	cpu := cpuTime() - cpu0
	b.StopTimer()
	if !receive {
		b.ReportMetric(perKey, "B/key")
		b.ReportMetric(pendKey, "B/key-unconfirmed")
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/key/"+unit)
	// The process's CPU time (the garbage collector's included): what a
	// shared machine's other load moves much less than the elapsed time.
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N)/float64(n), "cpu-ns/key/"+unit)
	runtime.KeepAlive(l)
}

func sortedCopy(s []string) []string {
	out := append([]string(nil), s...)
	for i := 1; i < len(out); i++ {
		if out[i-1] > out[i] {
			panic("names must be generated sorted")
		}
	}
	return out
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
