package regional

import (
	"time"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
)

// compiled is an immutable rule set with per-rule derived bucket parameters.
type compiled struct {
	index  *rules.Index
	params map[string]bucketParams // by rule id; absent: rule not enforced in this region
}

type bucketParams struct {
	global    *redisstore.Global // coordinated global token bucket or window; nil otherwise
	algorithm rules.Algorithm
	capacity  int64 // thousandths
	rate      int64 // thousandths per second
	limit     int64
	window    time.Duration
	windowMs  int64
	// invalid is why the store cannot hold this rule's bucket; its checks
	// are answered by its failure_mode without the store.
	invalid error
	// unlisted: a global rule whose regions do not include this one. Its
	// whole limit belongs to the regions it lists, so here it admits
	// nothing (unlistedAnswer), without the store: admitting would put
	// this region's traffic on top of the limit.
	unlisted bool
}

// params derives the bucket parameters a rule has in this region.
func (e *Enforcer) params(r rules.Rule) (bucketParams, bool) {
	frac := 1.0
	if r.Scope == rules.Global {
		f, ok := r.StaticShare(e.cfg.Region)
		if !ok {
			return bucketParams{algorithm: r.Algorithm, unlisted: true}, true
		}
		frac = f
	}
	p := bucketParams{algorithm: r.Algorithm}
	if r.Coordinated() && !e.cfg.StaticGlobal {
		// The store enforces floor(global x units / Units): the agent's share,
		// or this region's floor while no agent lease is valid.
		floor, ok := globalFloor(r, e.cfg.Region)
		if !ok {
			return bucketParams{}, false
		}
		if r.Algorithm == rules.TokenBucket {
			p.capacity = r.Capacity * 1000
			p.rate = allocation.Thousandths(r.RefillPerSecond)
			p.windowMs = p.capacity * 1000 / p.rate
		} else { // a global window: its global limit per window
			p.limit = r.Limit
			p.window = time.Duration(r.Window)
			p.windowMs = p.window.Milliseconds()
		}
		p.global = &redisstore.Global{Rule: r.ID, Units: allocation.DefaultUnits, Floor: floor}
		return p, true
	}
	if r.Split >= 2 {
		frac /= float64(r.Split) // each sub-bucket holds 1/split of the limit
	}
	switch r.Algorithm {
	case rules.TokenBucket, rules.LeakyBucket:
		p.capacity = int64(float64(r.Capacity) * 1000 * frac)
		p.rate = int64(float64(allocation.Thousandths(r.RefillPerSecond)) * frac)
		if p.rate > 0 {
			p.windowMs = p.capacity * 1000 / p.rate
		}
	default:
		p.limit = int64(float64(r.Limit) * frac)
		p.window = time.Duration(r.Window)
		p.windowMs = p.window.Milliseconds()
	}
	return p, true
}

// globalFloor is the region's floor units of a global rule: the static
// split the sync agent's ledger starts from (allocation.Floors).
func globalFloor(r rules.Rule, region string) (int64, bool) {
	names, floor, _ := allocation.Floors(allocation.DefaultUnits, r.MinShare, r.Regions)
	for i, n := range names {
		if n == region {
			return floor[i], true
		}
	}
	return 0, false
}

// bucket is the store bucket of this rule for one key.
func (p bucketParams) bucket(key string, r *rules.Rule) redisstore.Bucket {
	return redisstore.Bucket{Key: redisstore.AlgorithmKey(key, p.algorithm), Algorithm: p.algorithm, Capacity: p.capacity, Rate: p.rate,
		Limit: p.limit, Window: p.window, Shadow: r.Shadow, Global: p.global}
}
