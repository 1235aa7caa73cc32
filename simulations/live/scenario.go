package live

import (
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/apportion/apportion/simulations/scenario"
)

// Scaled returns a copy of sc as the live run plays it: the timeline
// (demand changes, events, the duration, cut to duration when > 0, in the
// scenario's own time) played speed times faster, then rate and burst (and
// with them every demand, which is a multiple of the rate) multiplied by
// the factor that keeps the peak offered load at or below maxLoad
// requests/s. It returns that factor (1: unscaled).
func Scaled(sc *scenario.Scenario, duration time.Duration, speed, maxLoad float64) (*scenario.Scenario, float64, error) {
	if speed <= 0 || math.IsNaN(speed) || math.IsInf(speed, 0) {
		return nil, 0, fmt.Errorf("live: speed must be > 0, got %v", speed)
	}
	c := *sc
	if duration > 0 && duration < c.Duration.D() {
		c.Duration = scenario.Duration(duration)
	}
	div := func(d scenario.Duration) scenario.Duration { return scenario.Duration(float64(d) / speed) }
	c.Duration = div(c.Duration)
	c.Demand = make([]scenario.Demand, len(sc.Demand))
	for i, d := range sc.Demand {
		d.Steps = append([]scenario.Step(nil), d.Steps...)
		for j := range d.Steps {
			d.Steps[j].At = div(d.Steps[j].At)
		}
		d.Start, d.End, d.Period, d.Phase = div(d.Start), div(d.End), div(d.Period), div(d.Phase)
		c.Demand[i] = d
	}
	c.Events = append([]scenario.Event(nil), sc.Events...)
	for i := range c.Events {
		c.Events[i].At, c.Events[i].For = div(c.Events[i].At), div(c.Events[i].For)
	}
	factor := 1.0
	if peak := PeakLoad(&c); maxLoad > 0 && peak > maxLoad {
		factor = maxLoad / peak
		c.Rule.Rate *= factor
		c.Rule.Burst = math.Max(1, math.Floor(c.Rule.Burst*factor))
	} else {
		c.Rule.Burst = math.Max(1, math.Floor(c.Rule.Burst)) // the enforcer's capacity is whole tokens
	}
	if err := c.Validate(); err != nil {
		return nil, 0, err
	}
	return &c, factor, nil
}

// PeakLoad returns the highest total offered request rate of sc, in
// requests/s, sampled every 100 ms (the mean: Poisson arrivals scatter
// around it).
func PeakLoad(sc *scenario.Scenario) float64 {
	peak := 0.0
	step := 100 * time.Millisecond
	for t := time.Duration(0); t <= sc.Duration.D(); t += step {
		sum := 0.0
		for i := range sc.Demand {
			d := &sc.Demand[i]
			sum += d.LevelAt(t) * sc.Rule.Rate / float64(d.Cost)
		}
		peak = math.Max(peak, sum)
	}
	return peak
}

// unsupported lists what the live run cannot reproduce: events are refused,
// the rest are notes in the report.
func unsupported(sc *scenario.Scenario) (notes []string, err error) {
	if len(sc.Events) > 0 {
		var kinds []string
		for _, e := range sc.Events {
			kinds = append(kinds, e.Kind)
		}
		return nil, fmt.Errorf("%w: events (%s) are not played live yet; run the scenario without them or use 'rlsim run'",
			ErrUnsupported, strings.Join(kinds, ", "))
	}
	if sc.Network.JitterMs > 0 || sc.Network.Loss > 0 {
		notes = append(notes, fmt.Sprintf("network jitter (%g ms) and loss (%g) are not injected live: the gateways are TCP, the proxy adds the fixed one-way delay only",
			sc.Network.JitterMs, sc.Network.Loss))
	}
	if sc.Rule.Allocation != "max_min_fair" {
		notes = append(notes, fmt.Sprintf("allocation %s: the live agents use their default, max_min_fair", sc.Rule.Allocation))
	}
	notes = append(notes, "registry (etcd), store and clock settings are the real ones on loopback, not the scenario's registry_ms, store_ms, clock errors")
	return notes, nil
}
