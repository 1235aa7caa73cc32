package scenario

import (
	"fmt"
	"time"
)

// The most a run may ask of the simulator: what the 2 shared cores and the
// memory of the machine the results come from run in minutes (measured
// there: about 0.8 million requests a second at 3 regions, 250 B of memory
// per request of the last minute at the peak, which the exact overshoot
// windows keep, and 450 B per key and region). CheckSize refuses
// a run beyond them up front, instead of a run that never ends or dies
// out of memory.
const (
	// MaxRequests bounds the requests of a run (about 2 minutes).
	MaxRequests = 100_000_000
	// MaxRequestsPerMinute bounds the requests of one minute at the peak
	// (about 2.5 GB).
	MaxRequestsPerMinute = 10_000_000
	// MaxKeys bounds demand[].keys.count.
	MaxKeys = 1_000_000
	// MaxKeyRegions bounds the keys of all demand entries times the
	// regions (about 4.5 GB).
	MaxKeyRegions = 10_000_000
	// MaxSamples bounds the samples of the series (duration / sample).
	MaxSamples = 1_000_000
)

// Size is what a run of the scenario asks of the simulator.
type Size struct {
	// Requests over the run, every demand entry at its peak level
	// throughout (the simulator draws Poisson arrivals at the peak and
	// thins them): an upper bound.
	Requests float64
	// PerMinute is the requests of one minute (of the run, if shorter) at
	// the peak level of every entry.
	PerMinute float64
	// Keys is the number of keys (a bound when key sets share a prefix).
	Keys int
	// Samples of the time series.
	Samples int64
}

// SizeOf returns the size of a run of duration dur.
func (sc *Scenario) SizeOf(dur time.Duration) Size {
	var perSec float64
	fixed := map[string]bool{}
	sets := map[string]int{}
	for i := range sc.Demand {
		d := &sc.Demand[i]
		perSec += d.Peak() * sc.Rule.Rate / float64(max(d.Cost, 1))
		if d.Keys != nil {
			sets[d.Keys.Prefix] = max(sets[d.Keys.Prefix], d.Keys.Count)
		} else {
			fixed[d.Key] = true
		}
	}
	keys := len(fixed)
	for _, n := range sets {
		keys += n
	}
	var samples int64
	if s := sc.Sample.D(); s > 0 {
		samples = int64((dur + s - 1) / s)
	}
	return Size{Requests: perSec * dur.Seconds(), PerMinute: perSec * min(dur, time.Minute).Seconds(), Keys: keys, Samples: samples}
}

// CheckSize refuses a run of duration dur that the simulator would not
// finish on the machine the limits above come from: above MaxRequests
// requests, MaxRequestsPerMinute in a minute, MaxKeys keys or MaxKeyRegions
// keys times regions, or MaxSamples samples. The error names the field to
// lower (and, for a parsed file, its line). sim.Run calls it.
func (sc *Scenario) CheckSize(dur time.Duration) error {
	err := sc.checkSize(dur)
	if e, ok := err.(*Error); ok && sc.src != nil {
		e.File = sc.src.file
		e.Line = lineOf(sc.src.root, e.Field)
	}
	return err
}

func (sc *Scenario) checkSize(dur time.Duration) error {
	sz := sc.SizeOf(dur)
	if sz.Samples > MaxSamples {
		return bad("sample", "%v over a run of %v is %d samples, above the maximum of %d: use a longer sample", sc.Sample.D(), dur, sz.Samples, MaxSamples)
	}
	keysField := "demand"
	most := 0
	for i, d := range sc.Demand {
		if d.Keys != nil && d.Keys.Count > most {
			keysField, most = fmt.Sprintf("demand[%d].keys.count", i), d.Keys.Count
		}
	}
	if sz.Keys > MaxKeys {
		return bad(keysField, "the demand uses %d keys in all, above the maximum of %d: lower keys.count", sz.Keys, MaxKeys)
	}
	if n := sz.Keys * len(sc.Regions); n > MaxKeyRegions {
		return bad(keysField, "%d keys in %d regions (%d buckets per strategy, about %.1f GB) are above the maximum of %d keys x regions: lower keys.count",
			sz.Keys, len(sc.Regions), n, float64(n)*450/1e9, MaxKeyRegions)
	}
	rate := num(sc.Rule.Rate)
	if sz.PerMinute > MaxRequestsPerMinute {
		return bad("rule.rate", "%s/s at the demand's peak levels offers up to %.3g requests in a minute, above the maximum of %d (the overshoot windows keep a minute of them in memory, about 250 B each): lower rule.rate or the demand levels (multiples of it)",
			rate, sz.PerMinute, MaxRequestsPerMinute)
	}
	if sz.Requests > MaxRequests {
		return bad("duration", "a run of %v at rule.rate %s/s and the demand's peak levels offers up to %.3g requests, above the maximum of %d (minutes of CPU): lower the duration (or --duration), rule.rate or the demand levels",
			dur, rate, sz.Requests, MaxRequests)
	}
	return nil
}
