// Package sim is a deterministic discrete-event simulator of a global rate
// limit enforced in several regions. A virtual clock and an event heap with
// deterministic tie-breaking drive the regions' request streams, a virtual
// WAN (one-way delay matrix, jitter, loss, partitions, region loss) and every
// strategy under comparison; all randomness comes from math/rand/v2 PCG
// streams derived from the seed, one per request stream and one per strategy,
// so a strategy's own draws never perturb the requests or another strategy.
//
// Every strategy sees the very same requests at the same instants, and the
// centralized ideal (Strategy 0 in a run: one bucket per key, no latency)
// decides first, so "wrongly rejected" is counted per request.
//
// Invariant: Run is a pure function of (scenario, seed, strategies): the same
// inputs give a byte-identical Result.
package sim

import (
	"time"

	"github.com/apportion/apportion/simulations/scenario"
)

// Strategy is one way of enforcing the global limit in every region.
type Strategy interface {
	// Name is the column name in reports.
	Name() string
	// Start sets the strategy up; it may schedule events on env.
	Start(env *Env) error
	// Admit decides one request of cost tokens for key in region, now.
	Admit(region, key int, cost int64) bool
}

// Sharer is a Strategy that enforces a share of the limit per region.
type Sharer interface {
	// Share returns the fraction of the limit region enforces for key now.
	Share(region, key int) float64
}

// Disrupted is a Strategy that reacts to region loss and agent restarts.
// (Partitions only affect the network, which Env.Send models.)
type Disrupted interface {
	// RegionLost: the region's traffic, agent and store are gone.
	RegionLost(region int)
	// RegionBack: the region returns with an empty store and a new agent.
	RegionBack(region int)
	// AgentDown: the region's agent dies and loses its state.
	AgentDown(region int)
	// AgentUp: the region's agent starts again.
	AgentUp(region int)
}

// Reset is a Strategy whose regions keep state in a store that a
// store_reset event empties (a Redis restart: the region's traffic and
// agent carry on).
type Reset interface {
	// StoreReset: the region's store restarts empty, with a new run id.
	StoreReset(region int)
}

// ActiveKeys is a Strategy that coordinates only some keys: the metric sync
// bytes per active key per second divides by its count (sampled each second).
type ActiveKeys interface {
	ActiveKeys() int
}

// Key is one rate-limited key of the global rule.
type Key struct {
	Name  string
	Rate  float64 // tokens per second
	Burst float64 // capacity in tokens
	// WindowMs > 0: a fixed window of Burst requests per WindowMs (its
	// buckets count requests per window; Cap is the share of the limit).
	WindowMs int64
}

// CapMilli returns the capacity in thousandths for a share of units out of total.
func (k Key) CapMilli(units, total int64) int64 {
	return mulDiv(int64(k.Burst*1000), units, total)
}

// RateMilli returns the rate in thousandths per second for units out of total.
func (k Key) RateMilli(units, total int64) int64 {
	return mulDiv(int64(k.Rate*1000), units, total)
}

// mulDiv returns floor(a*b/c) for a, b, c >= 0 without overflow for the
// magnitudes used here (a < 2^40, b <= c < 2^31 in practice; falls back to
// float otherwise).
func mulDiv(a, b, c int64) int64 {
	if c <= 0 || a <= 0 || b <= 0 {
		return 0
	}
	if b < 1<<22 && a < 1<<40 {
		return a * b / c
	}
	hi := a / c * b
	return hi + (a%c)*b/c
}

// Windows are the overshoot windows (1 s, 10 s, 60 s).
var Windows = []time.Duration{time.Second, 10 * time.Second, time.Minute}

// ConvergeTolerance: shares are converged when every region's share (but
// that of a region lost at the shift: Shift.Lost) is within this fraction
// of the limit of its target.
const ConvergeTolerance = 0.05

// convergeSample is the period at which shares are sampled for convergence.
const convergeSample = 100 * time.Millisecond

// Scenario is re-exported for strategies' convenience.
type Scenario = scenario.Scenario
