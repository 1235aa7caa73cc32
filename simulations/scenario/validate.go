package scenario

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/apportion/apportion/rules"
)

func bad(field, format string, args ...any) error {
	return &Error{Field: field, Msg: fmt.Sprintf(format, args...)}
}

func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

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
			if v := n.DelayMs[from][to]; !(v >= 0) || !finite(v) {
				return bad(f, "negative or invalid delay %v ms", v)
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
	if !(n.JitterMs >= 0) || !finite(n.JitterMs) {
		return bad("network.jitter_ms", "must be >= 0")
	}
	if !(n.Loss >= 0 && n.Loss < 1) {
		return bad("network.loss", "must be in [0,1)")
	}
	if !(*n.RegistryMs >= 0) {
		return bad("network.registry_ms", "negative delay")
	}
	// Rule.
	r := &sc.Rule
	if !(r.Rate > 0) || !finite(r.Rate) {
		return bad("rule.rate", "must be positive")
	}
	if !(r.Burst > 0) || !finite(r.Burst) {
		return bad("rule.burst", "must be positive")
	}
	if !(r.MinShare >= 0 && r.MinShare <= 1) {
		return bad("rule.min_share", "must be in [0,1]")
	}
	if w := r.Window.D(); w < 0 || w%time.Millisecond != 0 || w > 0 && r.Burst != float64(int64(r.Burst)) {
		return bad("rule.window", "must be whole milliseconds, with a whole number of requests as burst")
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
	// As the rule store refuses such a rule (rules.Rule.CheckFloors): a
	// region that could never hold a whole token.
	rr := rules.Rule{ID: "scenario", Scope: rules.Global, Algorithm: rules.TokenBucket, Capacity: int64(r.Burst), MinShare: r.MinShare, Regions: r.Weights}
	if r.Window > 0 {
		rr.Algorithm, rr.Capacity, rr.Limit = rules.FixedWindow, 0, int64(r.Burst)
	}
	var fe *rules.FieldError
	if err := rr.CheckFloors(); errors.As(err, &fe) {
		return bad("rule.min_share", "%s", fe.Msg)
	}
	// Sync.
	s := &sc.Sync
	if s.Interval <= 0 || s.Lease <= 0 || s.Margin < 0 || s.StoreTimeout < 0 || s.RegistryPoll <= 0 || s.EtcdTimeout <= 0 {
		return bad("sync", "durations must be positive")
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
	if w := *s.GiftWait; w < 0 || w > 255*s.Interval {
		return bad("sync.gift_wait", "%v must be in [0, 255 intervals] (%v)", w.D(), (255 * s.Interval).D())
	}
	if !(*s.ClockError >= 0 && *s.ClockError < 0.5) {
		return bad("sync.clock_error", "must be in [0,0.5)")
	}
	rho := *s.ClockError
	if float64(s.Lease)*(1-rho)/(1+rho) <= float64(s.StoreTimeout+s.Interval) {
		return bad("sync.lease", "lease %v must exceed interval + store_timeout with the clock margin", s.Lease.D())
	}
	if !(*s.StoreMs >= 0) || float64(time.Duration(*s.StoreMs*1e6)) >= float64(s.StoreTimeout) {
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
	}
	return nil
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
		if d.Keys.Count < 1 || d.Keys.Count > 10_000_000 {
			return bad(f+".keys.count", "must be in [1, 10000000]")
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
		if !finite(d.Amplitude) {
			return bad(f+".amplitude", "must be finite")
		}
	default:
		return bad(f+".shape", "unknown shape %q (constant, steps, ramp, sinusoid)", d.Shape)
	}
	switch d.Arrivals {
	case "poisson", "uniform":
	default:
		return bad(f+".arrivals", "unknown arrivals %q (poisson, uniform)", d.Arrivals)
	}
	if d.Cost < 1 {
		return bad(f+".cost", "must be >= 1")
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
