package scenario

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/rules"
)

func bad(field, format string, args ...any) error {
	return &Error{Field: field, Msg: fmt.Sprintf(format, args...)}
}

// badSee is bad for a message that names other fields (see): Parse gives
// their lines.
func badSee(field string, see []string, format string, args ...any) error {
	return &Error{Field: field, Msg: fmt.Sprintf(format, args...), see: see}
}

func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

// num writes a number as the file would: 274877907, 0.0001, 1e+300.
func num(x float64) string {
	if x == math.Trunc(x) && math.Abs(x) < 1e15 {
		return strconv.FormatFloat(x, 'f', -1, 64)
	}
	return strconv.FormatFloat(x, 'g', -1, 64)
}

// MaxDelay bounds every delay given in milliseconds (network.delay_ms,
// jitter_ms, registry_ms, sync.store_ms): a larger one is certainly a
// mistake, and one beyond time.Duration's range would wrap around.
const MaxDelay = time.Hour

const maxDelayMs = float64(MaxDelay / time.Millisecond)

// checkMs refuses a delay in ms that is negative, not finite or above MaxDelay.
func checkMs(field string, v float64) error {
	switch {
	case !(v >= 0) || !finite(v):
		return bad(field, "negative or invalid delay %v ms", v)
	case v > maxDelayMs:
		return bad(field, "%s ms is above the maximum of %s ms (an hour)", num(v), num(maxDelayMs))
	}
	return nil
}

// maxGiftWaitIntervals is sync/ledger's bound on GiftWait, in intervals.
const maxGiftWaitIntervals = 255

// Validate reports the first inconsistency, naming its field.
func (sc *Scenario) Validate() error {
	if sc.Name == "" {
		return bad("name", "required")
	}
	if sc.Duration <= 0 {
		return bad("duration", "must be positive")
	}
	if sc.Sample <= 0 {
		return bad("sample", "must be positive")
	}
	if len(sc.Regions) == 0 {
		return bad("regions", "at least one region is required")
	}
	seen := map[string]int{}
	for i, r := range sc.Regions {
		f := fmt.Sprintf("regions[%d]", i)
		if r.Name == "" {
			return bad(f+".name", "required")
		}
		if j, ok := seen[r.Name]; ok {
			return bad(f+".name", "region %q named twice (first as regions[%d])", r.Name, j)
		}
		seen[r.Name] = i
		if r.AgentClock != nil && !(math.Abs(*r.AgentClock) <= *sc.Sync.ClockError) {
			return bad(f+".agent_clock", "rate error %v outside the bound sync.clock_error %v", *r.AgentClock, *sc.Sync.ClockError)
		}
		if !(math.Abs(r.StoreClock) < 0.5) {
			return bad(f+".store_clock", "rate error must be within (-0.5, 0.5)")
		}
	}
	// Network.
	n := &sc.Network
	for _, from := range sortedKeys(n.DelayMs) {
		if sc.Index(from) < 0 {
			return bad("network.delay_ms."+from, "unknown region %q", from)
		}
		for _, to := range sortedKeys(n.DelayMs[from]) {
			f := "network.delay_ms." + from + "." + to
			if sc.Index(to) < 0 {
				return bad(f, "unknown region %q", to)
			}
			if err := checkMs(f, n.DelayMs[from][to]); err != nil {
				return err
			}
		}
	}
	for i, a := range sc.Regions {
		for _, b := range sc.Regions[i+1:] {
			if _, ok := sc.delay(a.Name, b.Name); !ok {
				return bad("network.delay_ms", "no delay given between %q and %q", a.Name, b.Name)
			}
		}
	}
	if err := checkMs("network.jitter_ms", n.JitterMs); err != nil {
		return err
	}
	if !(n.Loss >= 0 && n.Loss < 1) {
		return bad("network.loss", "must be in [0,1)")
	}
	if err := checkMs("network.registry_ms", *n.RegistryMs); err != nil {
		return err
	}
	// Rule.
	r := &sc.Rule
	if !(r.Rate > 0) || !finite(r.Rate) {
		return bad("rule.rate", "%v: must be a positive number", r.Rate)
	}
	if !(r.Burst > 0) || !finite(r.Burst) {
		return bad("rule.burst", "%v: must be a positive number", r.Burst)
	}
	if r.Burst != math.Trunc(r.Burst) {
		what := ""
		if r.Window == 0 && r.Burst == r.Rate {
			what = " (burst defaults to rate)"
		}
		return bad("rule.burst", "%s is not a whole number: a rule's capacity (a window's limit) is whole tokens%s", num(r.Burst), what)
	}
	if !(r.MinShare >= 0 && r.MinShare <= 1) {
		return bad("rule.min_share", "must be in [0,1]")
	}
	if w := r.Window.D(); w < 0 {
		return bad("rule.window", "must not be negative")
	}
	switch r.Allocation {
	case "max_min_fair", "proportional", "static":
	default:
		return bad("rule.allocation", "unknown allocation %q (max_min_fair, proportional, static)", r.Allocation)
	}
	var sum float64
	for _, k := range sortedKeys(r.Weights) {
		if sc.Index(k) < 0 {
			return bad("rule.weights."+k, "unknown region %q", k)
		}
		if w := r.Weights[k]; !(w > 0) || !finite(w) {
			return bad("rule.weights."+k, "weight must be positive")
		}
		sum += r.Weights[k]
	}
	for _, reg := range sc.Regions {
		if _, ok := r.Weights[reg.Name]; !ok {
			return bad("rule.weights", "no weight for region %q", reg.Name)
		}
	}
	if math.Abs(sum-1) > 1e-6 {
		return bad("rule.weights", "weights add up to %.6g, not 1", sum)
	}
	if err := sc.checkRule(); err != nil {
		return err
	}
	// Sync.
	s := &sc.Sync
	for _, d := range []struct {
		field  string
		v      Duration
		zeroOK bool
	}{
		{"sync.interval", s.Interval, false},
		{"sync.lease", s.Lease, false},
		{"sync.margin", s.Margin, true},
		{"sync.store_timeout", s.StoreTimeout, false},
		{"sync.registry_poll", s.RegistryPoll, false},
		{"sync.etcd_timeout", s.EtcdTimeout, false},
	} {
		switch {
		case d.v < 0:
			return bad(d.field, "%v: must not be negative", d.v.D())
		case d.v == 0 && !d.zeroOK:
			return bad(d.field, "must be positive")
		}
	}
	if *s.Heartbeat < 0 {
		return bad("sync.heartbeat", "must not be negative")
	}
	if w := *s.WitnessLease; w < 0 || w > 0 && w < s.Lease {
		return bad("sync.witness_lease", "%v must be 0s or at least the lease %v", w.D(), s.Lease.D())
	}
	if !(*s.DemandBand >= 0 && *s.DemandBand < 1) {
		return bad("sync.demand_band", "must be in [0, 1)")
	}
	if !(*s.GiftBand >= 0 && *s.GiftBand < 1) {
		return bad("sync.gift_band", "must be in [0, 1)")
	}
	if w := *s.GiftWait; w < 0 || w > maxGiftWaitIntervals*s.Interval {
		return bad("sync.gift_wait", "%v must be in [0, %d intervals] (%v at sync.interval %v)", w.D(), maxGiftWaitIntervals, (maxGiftWaitIntervals * s.Interval).D(), s.Interval.D())
	}
	if !(*s.ClockError >= 0 && *s.ClockError < 0.5) {
		return bad("sync.clock_error", "must be in [0,0.5)")
	}
	rho := *s.ClockError
	if float64(s.Lease)*(1-rho)/(1+rho) <= float64(s.StoreTimeout+s.Interval) {
		return bad("sync.lease", "lease %v must exceed interval + store_timeout with the clock margin", s.Lease.D())
	}
	if err := checkMs("sync.store_ms", *s.StoreMs); err != nil {
		return err
	}
	if time.Duration(*s.StoreMs*1e6) >= s.StoreTimeout.D() {
		return bad("sync.store_ms", "must be >= 0 and below store_timeout")
	}
	if *s.HalfLife < 0 {
		return bad("sync.half_life", "must not be negative")
	}
	// Demand.
	if len(sc.Demand) == 0 {
		return bad("demand", "at least one demand entry is required")
	}
	for i := range sc.Demand {
		if err := sc.validateDemand(i); err != nil {
			return err
		}
	}
	// Events.
	for i, e := range sc.Events {
		f := fmt.Sprintf("events[%d]", i)
		switch e.Kind {
		case "partition", "region_loss", "agent_restart", "store_reset", "loss":
		default:
			return bad(f+".kind", "unknown kind %q (partition, region_loss, agent_restart, store_reset, loss)", e.Kind)
		}
		if len(e.Regions) == 0 {
			return bad(f+".regions", "at least one region")
		}
		for j, name := range e.Regions {
			if sc.Index(name) < 0 {
				return bad(fmt.Sprintf("%s.regions[%d]", f, j), "unknown region %q", name)
			}
			if k := slices.Index(e.Regions, name); k < j {
				return bad(fmt.Sprintf("%s.regions[%d]", f, j), "region %q listed twice (first as regions[%d])", name, k)
			}
		}
		if e.At < 0 || e.At > sc.Duration {
			return bad(f+".at", "must be within the duration")
		}
		if e.For < 0 {
			return bad(f+".for", "must not be negative")
		}
		if e.Kind == "store_reset" && e.For != 0 {
			return bad(f+".for", "a store_reset is instantaneous: the store restarts empty at once (drop for)")
		}
		switch {
		case e.Kind == "loss" && !(e.Loss > 0 && e.Loss <= 1):
			return bad(f+".loss", "%v: a loss event drops messages with a probability in (0, 1]", e.Loss)
		case e.Kind != "loss" && e.Loss != 0:
			return bad(f+".loss", "only a loss event has a loss (this is a %s)", e.Kind)
		}
		if err := sc.checkOverlap(i); err != nil {
			return err
		}
	}
	return nil
}

// span returns when an event is in force: [from, to], to math.MaxInt64 for
// one that lasts to the end (a partition, region_loss or loss without
// for), from for a store_reset (an instant).
func (e *Event) span() (from, to time.Duration) {
	from = e.At.D()
	switch {
	case e.Kind == "store_reset":
		return from, from
	case e.For == 0 && e.Kind != "agent_restart":
		return from, math.MaxInt64
	case e.For.D() > math.MaxInt64-from:
		return from, math.MaxInt64
	}
	return from, from + e.For.D()
}

// describe says what an event does when: "a partition of a from 5s to 15s".
func (e *Event) describe() string {
	from, to := e.span()
	article := "a"
	if strings.ContainsRune("aeiou", rune(e.Kind[0])) {
		article = "an"
	}
	what := fmt.Sprintf("%s %s of %s", article, e.Kind, strings.Join(e.Regions, ", "))
	switch {
	case e.Kind == "store_reset":
		return fmt.Sprintf("%s at %v", what, from)
	case to == math.MaxInt64:
		return fmt.Sprintf("%s from %v to the end", what, from)
	}
	return fmt.Sprintf("%s from %v to %v", what, from, to)
}

// checkOverlap refuses event i when an earlier event of the same kind
// touches one of its regions while it is in force, or ends as it starts:
// the simulator does not merge them (the first end would end both: the
// heal of a partition, the return of a region or of an agent), nor do the
// convergence measurements (faultEnds). One event must say it.
func (sc *Scenario) checkOverlap(i int) error {
	e := &sc.Events[i]
	from, to := e.span()
	for k := range i {
		o := &sc.Events[k]
		if o.Kind != e.Kind {
			continue
		}
		ofrom, oto := o.span()
		if from > oto || ofrom > to {
			continue
		}
		for _, name := range e.Regions {
			if slices.Contains(o.Regions, name) {
				other := fmt.Sprintf("events[%d]", k)
				return badSee(fmt.Sprintf("events[%d]", i), []string{other},
					"%s overlaps or adjoins %s, %s, on region %s: events of one kind on one region must not overlap; merge them into one event",
					e.describe(), other, o.describe(), name)
			}
		}
	}
	return nil
}

// StoreRule returns the rule the scenario's rule stands for, as the rule
// store would hold it: a global token bucket of capacity burst refilled at
// rate tokens/s or, with a window, a global fixed window of burst requests
// per window (rate is then only the unit of the demand levels); weighted by
// region, with min_share. A burst beyond int64 is cut to 2^62 (the rule
// store refuses both).
func (r *Rule) StoreRule() rules.Rule {
	c := int64(1) << 62
	if r.Burst < float64(c) {
		c = int64(r.Burst)
	}
	rr := rules.Rule{ID: "scenario", Scope: rules.Global, Algorithm: rules.TokenBucket, Capacity: c,
		RefillPerSecond: r.Rate, MinShare: r.MinShare, Regions: r.Weights}
	if r.Window > 0 {
		rr.Algorithm, rr.Capacity, rr.RefillPerSecond = rules.FixedWindow, 0, 0
		rr.Limit, rr.Window = c, rules.Duration(r.Window)
	}
	return rr
}

// checkRule applies the rule store's checks (rules.Rule.Validate, then
// CheckFloors, as a put does) to the scenario's rule (StoreRule): the
// capacity, refill and window ranges of the store, the regions' names and
// weights, floors that leave every region a whole token. The field it
// names is the scenario's. With a window, rate is only the demand's unit
// (a daily quota's is below the refill's minimum), held to the refill's
// maximum.
func (sc *Scenario) checkRule() error {
	r := &sc.Rule
	if r.Window > 0 && r.Rate > rules.MaxRefillPerSecond {
		return bad("rule.rate", "%s: must be at most %g tokens/s (a rule's refill_per_second maximum; with a window, rate is the unit of the demand levels)",
			num(r.Rate), rules.MaxRefillPerSecond)
	}
	rr := r.StoreRule()
	err := rr.Validate()
	if err == nil {
		err = rr.CheckFloors()
	}
	var fe *rules.FieldError
	if !errors.As(err, &fe) {
		return err
	}
	field, value := "rule", ""
	switch {
	case fe.Field == "capacity" || fe.Field == "limit":
		field, value = "rule.burst", num(r.Burst)
		if r.Window == 0 && r.Burst == r.Rate {
			value += " (burst defaults to rate)"
		}
	case fe.Field == "refill_per_second":
		field, value = "rule.rate", num(r.Rate)
	case fe.Field == "window":
		field, value = "rule.window", r.Window.D().String()
	case fe.Field == "min_share":
		return bad("rule.min_share", "%s", fe.Msg)
	case strings.HasPrefix(fe.Field, "regions."):
		name := strings.TrimPrefix(fe.Field, "regions.")
		if i := sc.Index(name); i >= 0 && strings.HasPrefix(fe.Msg, "region name: ") {
			return bad(fmt.Sprintf("regions[%d].name", i), "%s (a rule's region names)", strings.TrimPrefix(fe.Msg, "region name: "))
		}
		field = "rule.weights." + name
	}
	msg := fe.Msg
	if i := strings.LastIndex(msg, ", got "); i >= 0 {
		msg = msg[:i] // the rule's value, which value says as the file does
	}
	if value != "" {
		msg = value + ": " + msg
	}
	return bad(field, "%s (the rule store refuses this %s)", msg, fe.Field)
}

func (sc *Scenario) validateDemand(i int) error {
	d := &sc.Demand[i]
	f := fmt.Sprintf("demand[%d]", i)
	switch {
	case d.Region != "" && d.Split != nil:
		return bad(f, "give region or split, not both")
	case d.Region == "" && d.Split == nil:
		return bad(f, "region or split is required")
	case d.Region != "" && sc.Index(d.Region) < 0:
		return bad(f+".region", "unknown region %q", d.Region)
	}
	if d.Split != nil {
		var sum float64
		for _, k := range sortedKeys(d.Split) {
			if sc.Index(k) < 0 {
				return bad(f+".split."+k, "unknown region %q", k)
			}
			if v := d.Split[k]; !(v >= 0) || !finite(v) {
				return bad(f+".split."+k, "fraction must be >= 0")
			}
			sum += d.Split[k]
		}
		if math.Abs(sum-1) > 1e-6 {
			return bad(f+".split", "fractions add up to %.6g, not 1", sum)
		}
	}
	if d.Key != "" && d.Keys != nil {
		return bad(f, "give key or keys, not both")
	}
	if d.Keys != nil {
		if d.Keys.Count < 1 || d.Keys.Count > MaxKeys {
			return bad(f+".keys.count", "must be in [1, %d]", MaxKeys)
		}
		if !(d.Keys.S > 1) || !finite(d.Keys.S) {
			return bad(f+".keys.zipf_s", "must be > 1")
		}
	}
	nonneg := func(field string, v float64) error {
		if !(v >= 0) || !finite(v) {
			return bad(f+"."+field, "level must be >= 0")
		}
		return nil
	}
	switch d.Shape {
	case "constant":
		if err := nonneg("level", d.Level); err != nil {
			return err
		}
	case "steps":
		if len(d.Steps) == 0 {
			return bad(f+".steps", "at least one step")
		}
		for j, st := range d.Steps {
			if err := nonneg(fmt.Sprintf("steps[%d].level", j), st.Level); err != nil {
				return err
			}
			if st.At < 0 || (j > 0 && st.At <= d.Steps[j-1].At) {
				return bad(fmt.Sprintf("%s.steps[%d].at", f, j), "steps must be in increasing time order")
			}
		}
	case "ramp":
		if err := nonneg("from", d.From); err != nil {
			return err
		}
		if err := nonneg("to", d.To); err != nil {
			return err
		}
		if d.End <= d.Start {
			return bad(f+".end", "must be after start")
		}
	case "sinusoid":
		if err := nonneg("level", d.Level); err != nil {
			return err
		}
		if d.Period <= 0 {
			return bad(f+".period", "must be positive")
		}
		if !(d.Amplitude >= 0) || !finite(d.Amplitude) {
			return bad(f+".amplitude", "%v: must be >= 0 (the level moves amplitude above and below level; shift it with phase)", d.Amplitude)
		}
	default:
		return bad(f+".shape", "unknown shape %q (constant, steps, ramp, sinusoid)", d.Shape)
	}
	switch d.Arrivals {
	case "poisson", "uniform":
	default:
		return bad(f+".arrivals", "unknown arrivals %q (poisson, uniform)", d.Arrivals)
	}
	if d.Cost < 1 || d.Cost > rules.MaxCapacity {
		return bad(f+".cost", "%d: must be in [1, %d] (0 or absent: 1; the most a bucket of the rule store holds)", d.Cost, int64(rules.MaxCapacity))
	}
	if float64(d.Cost) > sc.Rule.Burst {
		what := "burst"
		if sc.Rule.Window > 0 {
			what = "limit per window"
		}
		return bad(f+".cost", "%d is above rule.burst %s (the rule's %s): no request of this cost can ever be admitted", d.Cost, num(sc.Rule.Burst), what)
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
