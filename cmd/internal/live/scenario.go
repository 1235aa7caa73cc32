package live

import (
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/sync/agent"
)

// Scaled returns a copy of sc as the live run plays it: the timeline
// (demand changes, events, the duration, cut to duration when > 0, in the
// scenario's own time; events that start after it are dropped) played speed
// times faster, then rate and burst (and with them every demand, which is a
// multiple of the rate) multiplied by the factor that keeps the peak offered
// load at or below maxLoad requests/s. It returns that factor (1: unscaled).
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
	c.Events = nil
	for _, e := range sc.Events {
		e.Regions = append([]string(nil), e.Regions...)
		e.At, e.For = div(e.At), div(e.For)
		if e.At <= c.Duration { // an event after a cut duration is not played
			c.Events = append(c.Events, e)
		}
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
		if factor < 1 { // e.g. a demand cost above the scaled burst
			return nil, 0, fmt.Errorf("live: rate and burst scaled x %.4g to keep the peak offered load at --max-load %g: %w", factor, maxLoad, err)
		}
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

// unsupported lists what the live run cannot reproduce: events of one
// region are played (the stack cuts its gateways, stops and starts its
// sync agent, restarts its Redis), events of a group are refused, the rest
// are notes in the report.
func unsupported(sc *scenario.Scenario) (notes []string, err error) {
	seen := map[string]bool{}
	for i, e := range sc.Events {
		switch {
		case e.Kind == "loss":
			return nil, fmt.Errorf("%w: events[%d] is a loss event: message loss is not injected live (the gateways are TCP); use 'rlsim run'",
				ErrUnsupported, i)
		case e.Kind != "partition" && e.Kind != "region_loss" && e.Kind != "agent_restart" && e.Kind != "store_reset":
			return nil, fmt.Errorf("%w: events[%d] is a %s event: live plays partition, region_loss, agent_restart and store_reset events",
				ErrUnsupported, i, e.Kind)
		case len(e.Regions) != 1:
			return nil, fmt.Errorf("%w: events[%d] is a %s of a group (%s): live, an event concerns one region",
				ErrUnsupported, i, e.Kind, strings.Join(e.Regions, ", "))
		}
		seen[e.Kind] = true
		if e.Kind == "region_loss" && e.For > 0 {
			seen["region_back"] = true
		}
	}
	if seen["partition"] {
		notes = append(notes, "partition: live, the NATS gateway connections between the region and every other region are cut (the proxies drop them and refuse new ones until the end of the event); the registry (etcd) stays reachable for every region, while in the simulator a partitioned region also loses the registry")
	}
	if seen["region_loss"] {
		notes = append(notes, "region_loss: live, the region's gateways are cut and its sync agent stopped (its reports and witness renewals end); its Redis and enforcer keep running, but its requests are gone as in the simulator")
	}
	if seen["region_back"] {
		notes = append(notes, "region_loss with for: live, the region comes back with its redis-server restarted empty, its gateways healed and its sync agent started again with no state")
	}
	if seen["agent_restart"] {
		notes = append(notes, "agent_restart: live, the region's sync agent is stopped and started again after for, with no state (a new process would have none), on the same address; its Redis and enforcer keep running")
	}
	if seen["store_reset"] {
		notes = append(notes, "store_reset: live, the region's redis-server is killed and started empty on the same port (a new run id)")
	}
	if restartsRedis(sc) {
		notes = append(notes, "a region's Redis restarts in this run, so the rule fails closed: checks in the moment Redis is down are rejected, not admitted by the failure policy")
	}
	if sc.Network.JitterMs > 0 || sc.Network.Loss > 0 {
		notes = append(notes, fmt.Sprintf("network jitter (%g ms) and loss (%g) are not injected live: the gateways are TCP, the proxy adds the fixed one-way delay only",
			sc.Network.JitterMs, sc.Network.Loss))
	}
	if w := sc.Rule.Window.D(); w > maxAlignWait {
		notes = append(notes, fmt.Sprintf("rule.window %v: live, the rule is a global fixed_window whose windows are the stores' clock's (Unix time over the window), not aligned with the run's start as in the simulator (the replay waits for a window's start only up to a window of %v): the run may span one window more than the simulator's, and admit up to one limit more",
			w, maxAlignWait))
	}
	if sc.Rule.Allocation != "max_min_fair" {
		notes = append(notes, fmt.Sprintf("allocation %s: the live agents use their default, max_min_fair", sc.Rule.Allocation))
	}
	notes = append(notes, syncNotes(sc)...)
	notes = append(notes, "registry (etcd), store and clock settings are the real ones on loopback, not the scenario's registry_ms, store_ms, clock errors")
	return notes, nil
}

// syncNotes names every sync setting of sc that the live agents do not
// apply (the stack passes them interval, lease and witness_lease only)
// and that differs from the agent's default, which they run instead: the
// simulated ledger column uses the scenario's value, so the comparison
// is not like for like.
func syncNotes(sc *scenario.Scenario) []string {
	def := agent.DefaultConfig()
	s := &sc.Sync
	var notes []string
	dur := func(field string, got scenario.Duration, want time.Duration) {
		if got.D() != want {
			notes = append(notes, fmt.Sprintf("live ignores sync.%s (%v): the agents run their default %v", field, got.D(), want))
		}
	}
	num := func(field string, got, want float64) {
		if got != want {
			notes = append(notes, fmt.Sprintf("live ignores sync.%s (%g): the agents run their default %g", field, got, want))
		}
	}
	if s.HalfLife != nil {
		dur("half_life", *s.HalfLife, def.HalfLife)
	}
	if s.Heartbeat != nil {
		dur("heartbeat", *s.Heartbeat, def.Heartbeat)
	}
	if s.DemandBand != nil {
		num("demand_band", *s.DemandBand, def.DemandBand)
	}
	if s.GiftBand != nil {
		num("gift_band", *s.GiftBand, def.GiftBand)
	}
	if s.GiftWait != nil {
		dur("gift_wait", *s.GiftWait, def.GiftWait)
	}
	dur("margin", s.Margin, def.Margin)
	if s.ClockError != nil {
		num("clock_error", *s.ClockError, def.Rho)
	}
	dur("registry_poll", s.RegistryPoll, def.RegistryPoll)
	dur("etcd_timeout", s.EtcdTimeout, def.EtcdTimeout)
	dur("store_timeout", s.StoreTimeout, def.StoreTimeout)
	return notes
}

// restartsRedis reports whether playing sc restarts a region's Redis: a
// store_reset, or a region lost for a time (it comes back empty).
func restartsRedis(sc *scenario.Scenario) bool {
	for _, e := range sc.Events {
		if e.Kind == "store_reset" || e.Kind == "region_loss" && e.For > 0 {
			return true
		}
	}
	return false
}
