package agent

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
)

// runRules runs the rule source, restarting it with backoff when it fails.
func (a *Agent) runRules(ctx context.Context) {
	defer a.wg.Done()
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := a.src.Run(ctx, func(rs []rules.Rule) {
			select { // keep only the latest set
			case <-a.rulesCh:
			default:
			}
			a.rulesCh <- rs
		})
		if ctx.Err() != nil {
			return
		}
		a.logs.Log(slog.LevelError, "rules", "rule source stopped; retrying", logKeyErr, err, "retry_in", backoff.String())
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// coordinated reports whether r is a global rule this region shares: a
// token bucket, or a fixed or sliding window (rules.Rule.Coordinated).
func (a *Agent) coordinated(r rules.Rule) bool {
	if !r.Coordinated() || !(usageRate(r) > 0) || wholeLimit(r) <= 0 {
		return false
	}
	_, ok := r.StaticShare(a.cfg.Region)
	return ok
}

// usageRate is the rule's global rate per second, against which the ledger
// measures demand: a token bucket's refill, a window's limit per window.
func usageRate(r rules.Rule) float64 {
	if r.Algorithm == rules.TokenBucket {
		return r.RefillPerSecond
	}
	if w := time.Duration(r.Window).Seconds(); w > 0 {
		return float64(r.Limit) / w
	}
	return 0
}

// wholeLimit is the rule's limit in whole tokens (requests): a token
// bucket's capacity, a window's limit; the ledger's Quantum rounds to it.
func wholeLimit(r rules.Rule) int64 {
	if r.Algorithm == rules.TokenBucket {
		return r.Capacity
	}
	return r.Limit
}

// windowWait is how much longer than a token bucket's a survivor waits
// before it reclaims a silent region's share of a window rule
// (driver.WindowWait; docs/design.md, "Global windows").
func windowWait(r rules.Rule, rho float64) time.Duration {
	if r.Algorithm == rules.TokenBucket {
		return 0
	}
	return driver.WindowWait(time.Duration(r.Window), rho)
}

// storeRule is what the store needs of st's rule (driver.StoreWrites): a
// token bucket's capacity and refill, or a window's limit and window.
func storeRule(st *ruleState) driver.StoreRule {
	p := driver.StoreRule{Total: st.spec.Units, Floor: st.floor}
	if r := st.rule; r.Algorithm == rules.TokenBucket {
		p.Capacity, p.Rate = r.Capacity*1000, r.RefillPerSecond
	} else {
		p.Algorithm, p.Limit, p.Window = r.Algorithm, r.Limit, time.Duration(r.Window)
	}
	return p
}

func (a *Agent) specOf(r rules.Rule) Spec {
	return Spec{Units: a.cfg.Units, MinShare: r.MinShare, Regions: ledger.Regions(r.Regions),
		Quantum: ledger.QuantumOf(a.cfg.Units, float64(wholeLimit(r)))}
}

func (a *Agent) setRules(rs []rules.Rule) {
	want := map[string]rules.Rule{}
	for _, r := range rs {
		if a.coordinated(r) {
			want[r.ID] = r
		}
	}
	for id := range a.rules {
		if _, ok := want[id]; !ok {
			a.log.Info("rule no longer coordinated here; dropping its ledger", logKeyRule, id)
			delete(a.rules, id)
			a.drv.Remove(id)
			a.setRegistryLimit(id, 0)
			a.dropMarker(id) // the ledger is gone: no write of its follows (markers.go)
		}
	}
	for id, r := range want {
		st := a.rules[id]
		added := st == nil
		if added {
			st = &ruleState{Rule: a.drv.Add(id)}
			a.rules[id] = st
			a.keepMarker(id)
		} else if st.Led != nil && !a.specOf(r).equal(st.spec) {
			a.logs.Log(slog.LevelWarn, "spec/"+id, "rule's regions, weights or min_share changed; coordination keeps the spec it started with (use a new rule id to change it)", logKeyRule, id)
		}
		st.rule = r
		a.setRegistryLimit(id, wholeLimit(r))
		a.followCapacity(st)
		if added {
			// A new rule starts its incarnation now (the boot marker follows
			// one registry round trip later: driver.Started), not at the next tick.
			a.maybeStart(a.ctx, st)
		}
	}
	if len(want) == 0 {
		a.nothingToCoordinate(rs)
	}
	a.everRules = true
	a.ready.Store(a.everRules && a.runID != "")
	a.listChanged = true
	a.publishSnapshot()
}

// nothingToCoordinate warns that no rule of rs, a new rule set, is one
// this agent coordinates, and why: no rules at all where the agent reads
// them (--etcd-prefix), no global rule, or none listing this region
// (--region), or only such rules as are not coordinated. The agent is
// ready all the same (a rule set may list the region later), and drops
// every peer's report as unknown_rule: without this line, that was all
// its log said. Logged for every rule set that leaves it so.
func (a *Agent) nothingToCoordinate(rs []rules.Rule) {
	prefix := a.cfg.RulePrefix
	if len(rs) == 0 {
		a.log.Warn("no rules under the rule prefix: this agent has nothing to coordinate (check --etcd-prefix)", "prefix", prefix)
		return
	}
	global := 0
	listed := map[string]bool{}
	for _, r := range rs {
		if r.Scope != rules.Global {
			continue
		}
		global++
		for n := range r.Regions {
			listed[n] = true
		}
	}
	switch {
	case global == 0:
		a.log.Warn("no global rule under the rule prefix: this agent has nothing to coordinate", "prefix", prefix, "rules", len(rs))
	case !listed[a.cfg.Region]:
		a.log.Warn(fmt.Sprintf("no global rule lists region %s: this agent has nothing to coordinate (check --region)", a.cfg.Region),
			"prefix", prefix, "global_rules", global, "regions_listed", strings.Join(slices.Sorted(maps.Keys(listed)), ","))
	default:
		a.log.Warn(fmt.Sprintf("the global rules that list region %s are none this agent coordinates (a token_bucket, fixed_window or sliding_window with a positive rate and limit)", a.cfg.Region),
			"prefix", prefix, "global_rules", global)
	}
}

// followCapacity gives st's running ledger the Quantum of its rule's
// capacity (a token bucket's) or limit (a window's) as it is now: a rule's
// capacity may change at any time, and the ledger's whole tokens must be
// the new capacity's (ledger.Ledger.SetQuantum, which says why a change
// is safe at once). Without it the Quantum stayed the one the ledger
// started with: a cut from a capacity of 4 to 2 over three regions left
// two of them half a token each for good, admitting nothing. A ledger
// started later gets it in started.
func (a *Agent) followCapacity(st *ruleState) {
	if st.Led == nil {
		return
	}
	q := ledger.QuantumOf(st.spec.Units, float64(wholeLimit(st.rule)))
	old := st.Led.Quantum()
	if q == old {
		return
	}
	if err := st.Led.SetQuantum(q); err != nil {
		a.logs.Log(slog.LevelError, "quantum/"+st.ID, "cannot apply the rule's new capacity to its whole tokens", logKeyRule, st.ID, logKeyErr, err)
		return
	}
	a.log.Info("rule's capacity changed: whole tokens follow it", logKeyRule, st.ID, "limit", wholeLimit(st.rule), "quantum", q, "was", old)
}

// registryLimits is a Registry that pays reclaims out in whole tokens of
// each rule's current limit (EtcdRegistry.setLimit).
type registryLimits interface {
	setLimit(rule string, tokens int64)
}

// setRegistryLimit tells the registry rule's limit in whole tokens (0: the
// rule is gone), if it keeps them.
func (a *Agent) setRegistryLimit(rule string, tokens int64) {
	if rl, ok := a.reg.(registryLimits); ok {
		rl.setLimit(rule, tokens)
	}
}

// maybeStart asks the registry for a new incarnation of st's rule.
func (a *Agent) maybeStart(ctx context.Context, st *ruleState) {
	if st.Led != nil || st.starting || a.runID == "" || time.Now().Before(st.retryAt) || a.deletingMarker(st.ID) {
		return // a delete of the rule's old marker: started when it is done (markers.go)
	}
	st.starting = true
	id, spec, sent := st.ID, a.specOf(st.rule), a.now()
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		start, used, err := a.reg.Start(cctx, id, spec, a.cfg.Region)
		cancel()
		start.Sent = sent // the life's lease counts from before its allocation (ledger.Start)
		a.post(ctx, func(ctx context.Context) { a.started(ctx, st, start, used, err) })
	})
}

func (a *Agent) failStart(st *ruleState, err error) {
	st.backoff = driver.StartBackoff(st.backoff)
	st.retryAt = time.Now().Add(st.backoff)
	if st.again { // sent in an outage that has ended (registryBack)
		st.again, st.retryAt = false, time.Time{}
	}
	a.logs.Log(slog.LevelError, "start/"+st.ID, "cannot start an incarnation; retrying", logKeyRule, st.ID, logKeyErr, err, "retry_in", max(0, time.Until(st.retryAt)).Round(time.Millisecond).String())
}

func (a *Agent) started(ctx context.Context, st *ruleState, start ledger.Start, spec Spec, err error) {
	st.starting = false
	if a.rules[st.ID] != st {
		return // the rule went away meanwhile
	}
	if err != nil {
		a.failStart(st, err)
		return
	}
	start.RunID = a.runID
	lcfg := spec.ledgerConfig(a.lcfg)
	lcfg.Quantum = ledger.QuantumOf(lcfg.Units, float64(wholeLimit(st.rule)))
	lcfg.Margin += windowWait(st.rule, lcfg.Rho)
	lcfg.MaxClosureBytes = closureRoom(a.nc, lcfg.MaxClosureBytes)
	led, err := ledger.New(lcfg, a.cfg.Region, spec.Regions, start, a.now())
	if err != nil {
		a.failStart(st, err)
		return
	}
	floors, _ := ledger.Split(spec.ledgerConfig(a.lcfg), spec.Regions)
	for i, r := range spec.Regions {
		if r.Name == a.cfg.Region {
			st.floor = floors[i]
		}
	}
	a.drv.Started(st.Rule, led)
	st.spec, st.backoff, st.again = spec, 0, false
	st.newLedger()
	a.log.Info("ledger started", logKeyRule, st.ID, logKeyInc, start.Inc)
	a.listChanged = true
	a.publishSnapshot()
}

// windowStore is a Store that answers how far it could lower a global
// window key whose record it refused (redisstore.Store and Model do).
type windowStore interface {
	WriteWindowShares(ctx context.Context, rule string, recs []redisstore.ShareRecord) ([]redisstore.WindowApplied, error)
}

// writeShares writes recs of rule: a window rule's records through
// WriteWindowShares where the store has it, so refusals come with their
// answer (the driver holds them, Ledger.Hold); any other through
// WriteShares.
func (a *Agent) writeShares(ctx context.Context, rule string, recs []redisstore.ShareRecord) ([]redisstore.WindowApplied, error) {
	if ws, ok := a.store.(windowStore); ok && recs[0].Algorithm != "" && recs[0].Algorithm != rules.TokenBucket {
		return ws.WriteWindowShares(ctx, rule, recs)
	}
	vs, err := a.store.WriteShares(ctx, rule, recs)
	return driver.Versions(vs), err
}
