package ledger

import (
	"math"
	"time"
)

// SilenceTokens is the count of requests (of cost 1) whose absence bounds a
// small limit's demand estimate: after quiet seconds without usage, the
// estimate is at most SilenceTokens/quiet requests per second (at a higher
// rate, SilenceTokens or more requests would have been expected in that
// time, and none arriving has probability below e^-SilenceTokens, 0.7%).
// With 3 (5%), one gap in twenty between Poisson arrivals cut a region's
// share for a moment: in limit-10-per-second about 0.1 point of utilization
// lost to shares moving back and forth.
const SilenceTokens = 5

// DemandCap bounds every demand a ledger estimates, reports or reads from
// a report: DemandCap whole limits (Config.maxDemand). A region can get no
// more than the whole limit, so far above it a demand says nothing more;
// but the allocator compares demands that exceed the limit (Proportional's
// ratios, and whole tokens, which move only to a region that wants
// KeepToken times more than the holder), and a small limit's demand is
// often many times the limit (a limit of 1/s asked 1,000 times a second is
// 1,000 limits; TestOneLostReportIsNoSilence's demand of 30 limits). 2^20
// limits keeps every such ratio, and at the default Units (10^6) is 2^40
// units, far from overflowing anything that adds or compares demands.
// Without a bound, usage on a key of a few hundred million a second (a
// usage delta of 1e15 requests, which anyone who can publish on the
// region's usage subject can send) made an estimate above 2^63 units,
// which int64 turned into math.MinInt64: the region published a negative
// demand, every peer refused its whole rule report, acknowledgements
// included, and its lease lapsed: every key of the rule fell to its floor
// in that region for as long as the deltas came (TestHugeUsage).
const DemandCap = 1 << 20

// maxDemandUnits bounds Config.maxDemand whatever the Units: a float32
// (key.sentDem) or float64 of it converts back to int64 without overflow.
const maxDemandUnits = 1 << 62

// maxDemand is the largest demand in units: DemandCap whole limits, at
// most maxDemandUnits.
func (c Config) maxDemand() int64 {
	if c.Units > maxDemandUnits/DemandCap {
		return maxDemandUnits
	}
	return max(0, c.Units) * DemandCap
}

// readDemand is a peer's reported demand as this ledger allocates with
// it: within [0, maxDemand]. Demand is the allocator's input only (no
// counter, position or check of invariants 1 to 3 reads it), so a key's
// demand out of range changes nothing but that key's targets, and its
// report is applied with the demand bounded instead of being refused
// whole: refusing it refused the report's acknowledgements too, and its
// sender fenced. Only a sender's estimate above 2^63 units (before
// DemandCap) ever made a negative demand (int64 of it is math.MinInt64),
// so a negative demand reads as the bound.
func (c Config) readDemand(d int64) int64 {
	if d < 0 {
		return c.maxDemand()
	}
	return min(d, c.maxDemand())
}

// toUnits converts f (units) to int64 without overflow: NaN and values
// below 0 are 0, values at or above hi (+Inf too) are hi.
func toUnits(f float64, hi int64) int64 {
	switch {
	case !(f > 0):
		return 0
	case f >= float64(hi):
		return hi
	}
	return min(int64(f), hi) // f < float64(hi) <= 2^63: int64(f) does not overflow
}

// addCost adds two non-negative costs, saturating at math.MaxInt64: a
// usage delta's counts are anything below 2^63 (usage.Decode), and two of
// them wrapped to a negative sum.
func addCost(a, b int64) int64 {
	if s := a + b; s >= a {
		return s
	}
	return math.MaxInt64
}

// observe folds the usage of the interval that ends now (dt seconds) into
// k's demand estimate, in units of the whole limit: an EWMA of the interval
// rates (admitted and rejected cost alike: a region's demand is what its
// clients ask for, not what its share let through) whose newest interval
// weighs 1-2^(-dt/HalfLife) (the same decay per second whatever the
// interval), at most dt*rate/DemandTokens (so that at a few
// requests per second the estimate averages over about DemandTokens
// requests' worth of the limit instead of jumping with each one).
//
// The EWMA starts from 0. Where DemandTokens slows it below that weight (limits
// below about DemandTokens/(1.44*HalfLife) per second, about 100/s by default), the
// estimate divides it by the total weight of the samples so far (1 - the
// product of (1 - a)) once SilenceTokens of cost have been seen since the
// average started (a key's first usage, or its estimate falling to 0): a
// region where a key has just become busy gets the mean of its samples
// instead of an estimate that starts at 0 and takes DemandTokens/rate
// seconds to rise (at 10/s, 4 s in which every region's share followed
// estimates that had not caught up; at 1/s, a client that moved to another
// region waited 40 s for its token), while a single stray request does not
// count as a rate of one request per interval. At the default HalfLife
// (250ms) the EWMA reaches 94% of a new key's rate within a second; it is left as is.
//
// Where the EWMA is slow, silence also ends the estimate sooner: after quiet
// seconds without usage the estimate is at most SilenceTokens/quiet requests
// per second, and 0 once the region has been quiet for the whole window
// (DemandTokens/rate). A region whose clients have left then gives its
// whole token up within seconds, not after the EWMA has decayed (a minute
// at 1/s), while a region whose requests only come a few seconds apart
// keeps its estimate. The cap does not change the EWMA: when requests
// resume, the estimate is the EWMA's again.
//
// Every value is bounded (DemandCap): the interval's rate is at most
// maxDemand (usage of any size, a rate float32 rounds to 0 or to +Inf,
// NaN from 0/0: 0), and so is the estimate, so the EWMA stays finite and
// every conversion to int64 is in range.
func (l *Ledger) observe(k *key, dt float64, now time.Duration) {
	rate := float64(k.rate)
	hi := l.cfg.maxDemand()
	inst := float64(k.used) / dt * float64(l.cfg.Units) / rate
	if !(inst >= 0) {
		inst = 0 // NaN: no usage at a rate of 0
	}
	inst = min(inst, float64(hi))
	a, slow := l.cfg.demandWeight(dt, rate)
	if slow {
		a = dt * rate / l.cfg.DemandTokens
	}
	if k.used > 0 || k.weight == 0 {
		k.busyAt = now
	}
	k.ewma = a*inst + (1-a)*k.ewma
	k.weight = a + (1-a)*k.weight
	k.seen = uint8(min(int64(k.seen)+min(k.used, SilenceTokens), SilenceTokens))
	k.demand = k.ewma
	if slow && k.seen >= SilenceTokens {
		k.demand /= k.weight
	}
	if quiet := (now - k.busyAt).Seconds(); slow && quiet > 0 {
		limit := SilenceTokens / quiet / rate * float64(l.cfg.Units)
		if quiet*rate >= l.cfg.DemandTokens {
			limit = 0
		}
		k.demand = min(k.demand, limit) // the EWMA stays: requests that resume find it
	}
	if !(k.demand >= 0) {
		k.demand = 0 // NaN (0/0 with no weight yet): no estimate
	}
	k.demand = min(k.demand, float64(hi))
	if k.demand < 0.5 { // the average starts anew
		k.ewma, k.demand, k.weight, k.seen = 0, 0, 0, 0
	}
	if d := toUnits(k.demand, hi); l.cfg.demandMoved(k.reported(), d, l.band) {
		f := float32(d)
		if int64(f) > d { // rounded up (above 2^24 units): not above maxDemand
			f = math.Nextafter32(f, 0)
		}
		k.sentDem, k.dirty = f, true
	}
}

// demandMoved reports whether a demand of d differs enough from sent, the
// demand last reported, to count as a change: by more than band of the
// larger of the two (DemandBand) and more than Hysteresis units, or to or from zero.
func (c Config) demandMoved(sent, d int64, band float64) bool {
	if d == sent {
		return false
	}
	if d == 0 || sent == 0 || band <= 0 {
		return true
	}
	diff := d - sent
	if diff < 0 {
		diff = -diff
	}
	return diff > c.Hysteresis && float64(diff) > band*float64(max(d, sent))
}

// demandWeight is the half-life's EWMA weight of an interval of dt seconds,
// 1-2^(-dt/HalfLife), and whether DemandTokens slows it for a limit of rate
// per second (dt*rate/DemandTokens below it: the estimate then averages
// over about DemandTokens requests' worth of the limit).
func (c Config) demandWeight(dt, rate float64) (float64, bool) {
	a := 1.0
	if h := c.HalfLife.Seconds(); h > 0 {
		a = -math.Expm1(-dt / h * math.Ln2) // 1 - 2^(-dt/h)
	}
	return a, c.DemandTokens > 0 && dt*rate/c.DemandTokens < a
}
