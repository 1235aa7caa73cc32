package ledger

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/apportion/apportion/allocation"
)

// Errors returned by the ledger. Inputs that return an error change nothing.
var (
	ErrConfig            = errors.New("ledger: invalid config")
	ErrUnknownRegion     = errors.New("ledger: unknown region")
	ErrMalformed         = errors.New("ledger: malformed report")
	ErrStaleIncarnation  = errors.New("ledger: stale incarnation")
	ErrFrozenIncarnation = errors.New("ledger: incarnation frozen for reclaim")
	ErrBackwards         = errors.New("ledger: counter went backwards")
	ErrFenced            = errors.New("ledger: fenced; restart under a new incarnation")
	// ErrLapsed is New's answer to a first life whose own lease (Lease
	// from Start.Sent) ended before New was called: it would fence at its
	// first Tick, holding a part it may not enforce. Start another.
	ErrLapsed = errors.New("ledger: the registry's answer came after the life's lease; start another")
)

// Want is one region's input to an Allocator: its weight and its demand
// above its floor, in units.
type Want struct {
	Weight float64
	Demand int64
}

// Allocator splits pool units (the dynamic pool among the live regions) into
// integer targets that sum exactly to pool. It must be pure. The agent injects
// allocation.SplitUnits with the rule's strategy; WaterFill is the default.
type Allocator func(pool int64, wants []Want) []int64

// RegionSpec names a region and its static weight.
type RegionSpec struct {
	Name   string
	Weight float64
}

// Config holds the ledger's settings. All durations are on the agent's own
// monotonic clock, whose rate is within Rho of real time.
type Config struct {
	// Units is the integer count of the whole global limit (default 1,000,000).
	Units int64
	// MinShare is the fraction of the limit held as never-moved floors (default 0.1).
	MinShare float64
	// Interval is the sync interval: Tick is called once per Interval (default 250ms).
	Interval time.Duration
	// Lease is L: among three regions or more, a region whose reports no peer
	// has acknowledged within L fences itself (with one or two it never does:
	// see the package doc, invariant 3); the marker's store lease is at most L
	// (default 3s). Must exceed RTT + 2 Interval + StoreTimeout comfortably.
	Lease time.Duration
	// WitnessLease is W, the witness's lease between two regions (witness.go;
	// the package doc, Two regions and the witness): a renewal of this
	// region's witness key keeps the incarnation's lease for W after it was
	// sent, without a peer's acknowledgement, and a peer silent with its key
	// unchanged for W(1+Rho)/(1-Rho) + Margin is frozen and reclaimed.
	// 0 (the default here; the agent's is driver.DefaultWitnessLease): no
	// witness, and a two-region incarnation never fences on silence nor is
	// reclaimed. At least Lease when set.
	WitnessLease time.Duration
	// Rho bounds every clock's rate error: rates are within [1-Rho, 1+Rho] (default 0.01).
	Rho float64
	// Margin is added to the reclaim wait L(1+Rho)/(1-Rho) (default 500ms).
	Margin time.Duration
	// StoreTimeout bounds, in real time, how long a store write can take to take
	// effect; a write not applied within it never is (default 100ms).
	StoreTimeout time.Duration
	// RetryWrite re-emits a write not confirmed within this time (default 1s).
	RetryWrite time.Duration
	// FullEvery makes every FullEvery-th report of Tick carry all active
	// keys, which repairs lost reports within FullEvery reports (default 8).
	FullEvery int
	// PaceKeys paces the reports to the peers' acknowledgements
	// (pace.go): each peer has a window of our key reports that may be in
	// flight (sent in reports it has not acknowledged yet), PaceKeys at
	// first, doubling while it acknowledges within a second and halved
	// (never below PaceKeys) when it acknowledges later; a report carries
	// only the keys that fit in every window, the others stay due and the
	// next report starts where it stopped. A link slower than the reports
	// then holds about a second of them, not a backlog that grows for as
	// long as the link is slow with every gift in it in flight. Default
	// 1024; 0: no pacing.
	PaceKeys int
	// HeartbeatEvery is how often Tick reports when nothing worth sending
	// changed: a report goes out at a Tick only if a key changed (a
	// counter, a position, its activity, retirement, or its demand past
	// DemandBand) or the heartbeat has passed since the last report. The
	// heartbeat carries the acknowledgements that renew the lease, so it
	// is at most a quarter of what the lease leaves after StoreTimeout and
	// Interval: min(HeartbeatEvery, (Lease(1-Rho)/(1+Rho) - StoreTimeout -
	// Interval)/4), 685 ms with the default lease of 3 s (the package doc,
	// Leases). A heartbeat of at most Interval reports at every Tick. The
	// liveness bound's steps that wait for a report or an acknowledgement
	// take the heartbeat instead of the interval (the package doc,
	// Invariant 4). Default 1s (685 ms at the default lease), with
	// DemandBand; 0 reports at every Tick.
	HeartbeatEvery time.Duration
	// DemandBand is the demand dead band: a key's demand counts as
	// changed only when it moved from the value last reported by more
	// than DemandBand of that value (or of the new one, if larger), and
	// at least Hysteresis units, or to or from zero. Every region
	// allocates with the demands as last reported, its own included, so
	// targets do not move on noise. Default 0.25, with HeartbeatEvery 1s
	// and DemandRefresh 3s; 0 reports every change. With the three, rlsim's
	// sync bytes per key and second fall 1.4x (flash-crowd) to 8.6x
	// (daily-quota), ten-regions' from 272,560 to 116,388 (about 1.3 KB
	// sent per region and second), and hot-key's from 638 to 461 over
	// 3,090 keys (694, 9% up, until an idle key's stay in full reports
	// was counted in reports: Ledger.idleDone), while utilization holds
	// or gains in nine scenarios of thirteen (ten-regions 95.34% to
	// 98.23%, skewed 96.73% to 97.89%) and falls in four: daily-quota
	// 97.35% to 96.25%, limit-1-per-second-moving 92.44% to 91.60%,
	// limit-1-per-second 43.57% to 43.31%, shift 99.84% to 99.67%
	// (simulations/README.md). Measured before the refresh: daily-quota
	// 90.77% at 0.25 and 94.88% at 0.15. (TestRandomized's seeds 35 and
	// 202 that stayed off the targets at 0.15 were a settlement going round
	// for good, reached without the band too, since fixed: the package
	// doc, Settling cycles; and the whole-token seeds that failed with the
	// band and the heartbeat on settle since give holds whole-token gifts
	// on views that disagree. At 0.15 with the heartbeat, seed 1414's
	// settlement ends 0.4 s past the liveness bound.)
	DemandBand float64
	// DemandRefresh is, with DemandBand, how long a key's demand may stay
	// within the band of the value last reported: every DemandRefresh,
	// one Tick counts a move past a tenth of the band as a change (default
	// 3s; 0: never). Without it a demand that drifts slowly stays up to
	// the band away from what the regions allocate with: rlsim's
	// daily-quota lost 6.6 points of utilization at a band of 0.25 with a
	// heartbeat of 1 s (90.77% against 97.35% without either). (Counting
	// every move past Hysteresis at a refresh moved the targets on the
	// estimates' last creeping, a few dozen units, with gifts in flight
	// after every refresh.)
	DemandRefresh time.Duration
	// HalfLife is the demand estimate's half-life: the weight of a sample
	// halves every HalfLife, so an interval of dt seconds enters the EWMA
	// with weight 1-2^(-dt/HalfLife) whatever the interval (default 250ms:
	// 0.5 at a 250 ms interval, 0.24 at 100 ms). 0 keeps only the newest
	// interval.
	HalfLife time.Duration
	// IdleAfter is how long without usage before a key may leave coordination (default 10s).
	IdleAfter time.Duration
	// Hysteresis is the smallest excess (units) worth a gift (default
	// Units/10000) while some region wants more than its floor. At rest
	// (nobody does) every excess is given, so that the positions reach the
	// bases exactly and the key can go idle and be forgotten.
	Hysteresis int64
	// GiftBand and GiftWait keep a key's units from moving on noise: while
	// some region wants more than its floor, an excess over the target of
	// at most GiftBand of the limit (Units) is given only once it has been
	// there GiftWait in a row (rounded up to Ticks, at most 255 of them); a larger
	// one is given at once. With many regions a move of one region's
	// reported demand shifts every other region's target a little, and
	// each of them gave its few units at once, in a report that all the
	// regions receive. GiftBand 0.02 and GiftWait 1s took rlsim's
	// ten-regions (seed 1, 5 min) from 116,770 to 57,332 sync bytes per
	// key and second at a higher utilization (98.21% to 99.04%: the units
	// no longer travel back and forth on the noise), flash-crowd from
	// 19,573 to 9,700 (98.98% to 99.03%), skewed from 9,512 to 8,534
	// (97.88% to 98.04%); partition and shift lost 0.02 points
	// (simulations/README.md). An
	// excess that stays is still given, so the targets are reached exactly,
	// GiftWait later (the package doc, Invariant 4). Whole-token keys
	// (Quantum) do not wait: KeepToken weighs their moves. Defaults 0.02
	// and 1s; GiftWait 0 gives every excess at once.
	GiftBand float64
	GiftWait time.Duration
	// DemandTokens makes the demand estimate of a key average over at least
	// the time its limit takes to admit this many requests (DemandTokens/rate
	// seconds), so that at a few requests per second the estimate does not
	// jump with every single request: the EWMA weight of an interval of dt
	// seconds is min(1-2^(-dt/HalfLife), dt*rate/DemandTokens). Limits above
	// about DemandTokens/(1.44*HalfLife) per second are unaffected (demand.go has
	// the rest: the start of an average and silence). Default 40; 0 disables.
	DemandTokens float64
	// Quantum is the number of units per whole token of the limit's capacity
	// (Units/capacity rounded up: QuantumOf), when the agent knows it; 0 (the
	// default) means none.
	// With it, targets are rounded so that regions hold whole tokens
	// (allocation.WholeTokens): a region whose capacity is below one token
	// cannot admit anything; and a Registry pays out reclaims in whole
	// quanta (Registry.split). The capacity of a rule may change at any
	// time: Ledger.SetQuantum and Registry.SetQuantum change it live.
	Quantum int64
	// KeepToken is the hysteresis of whole tokens (with Quantum): a region
	// that holds a whole token keeps it unless another region's demand is
	// KeepToken times its own (allocation.WholeTokensHeld). A move clamps the
	// giver's banked tokens away and the receiver starts empty, so moving one
	// of a few tokens on noise in the estimates costs more than it gains.
	// Default 3; 0 or 1 disables.
	KeepToken float64
	// EvenBand is the dead band of small limits (with Quantum, and a rate
	// slow enough for DemandTokens to slow the estimate): when every
	// live region wants at least 1-EvenBand of its fair share (its weight's
	// part of the pool), the wants count as the fair shares, so the targets
	// are the static split by weight (Config.evenBand). With even demand a
	// region's estimate averages over about DemandTokens/regions requests
	// (10 at 4 regions: a standard deviation of about 30%), and a dip below
	// the fair share moved a fraction of a token back and forth, each move
	// clamping the giver's banked tokens away: in limit-10-per-second 10 of
	// the 20 requests the ledger admitted below the static split. Faster
	// limits, whose estimates are not that noisy, follow their demand as
	// it is (follow-the-sun, 100/s: 94.80% with the band, 94.93% without).
	// Default 0.35; 0 disables.
	EvenBand float64
	// MaxClosureBytes bounds the closures one report carries (Report.Closes,
	// counted as the key's length plus 24 bytes each, at least the wire's
	// size of a closure), default 256 KiB: a quarter of NATS's default
	// payload of 1 MiB, so that a split report, which repeats its closures
	// in every part, still has room for keys. Closures beyond it wait for
	// acknowledgements of those carried (retire.go); at least one per
	// peer is carried whatever its size, so a report carries at most one
	// closure per region more than the room.
	MaxClosureBytes int
	// Allocate computes targets (default WaterFill).
	Allocate Allocator
}

// wholeTokens rounds targets (above the floors, in units) to whole tokens
// by demand, with KeepToken's preference for the regions holding one now
// (held: their positions, floors included). give and the tests' convergence
// check both use it.
func (c Config) wholeTokens(targets, floors, demand, held []int64) []int64 {
	return allocation.WholeTokensHeld(targets, floors, c.Quantum, demand, held, c.KeepToken)
}

// evenBand applies EvenBand to wants (demand above the floors, in units,
// of the live regions sharing pool) of a key whose limit is rate per
// second: with a Quantum and an estimate slowed by DemandTokens (a few
// requests per averaging window: below about 110/s by default), if every want is at
// least 1-EvenBand of its fair share pool*weight/sum(weights), the wants
// below their fair share are raised to it, and the allocator then returns
// the split by weight. It depends only on the wants, like the allocator, so
// targets stay a function of the reported state (give and the tests'
// convergence check both use it).
func (c Config) evenBand(pool int64, wants []Want, rate float64) {
	if _, slow := c.demandWeight(c.Interval.Seconds(), rate); !slow || c.Quantum <= 1 || !(c.EvenBand > 0) || pool <= 0 {
		return
	}
	var sumW float64
	for _, w := range wants {
		sumW += w.Weight
	}
	if !(sumW > 0) {
		return
	}
	fair := func(w Want) int64 { return int64(float64(pool) * w.Weight / sumW) }
	for _, w := range wants {
		if float64(w.Demand) < (1-c.EvenBand)*float64(fair(w)) {
			return
		}
	}
	for j, w := range wants { // no allocation: it runs per key and tick
		wants[j].Demand = max(w.Demand, fair(w))
	}
}

// heartbeat is the longest time between two reports of Tick
// (HeartbeatEvery, bounded by the lease): an acknowledgement of a report
// comes back within 2 heartbeats + RTT, which leaves at least half the
// lease beyond StoreTimeout and Interval for the RTT and lost heartbeats.
func (c Config) heartbeat() time.Duration {
	lease := time.Duration(float64(c.Lease) * (1 - c.Rho) / (1 + c.Rho))
	return max(0, min(c.HeartbeatEvery, (lease-c.StoreTimeout-c.Interval)/4))
}

// holdTicks bounds how many Ticks in a row give holds a key's whole-token
// gifts back while its views disagree (Ledger.consistent): a report period
// and an interval, rounded up to Ticks, and one more (3 Ticks without a
// heartbeat).
func (c Config) holdTicks() int {
	return int((c.reportEvery()+c.Interval+c.Interval-1)/c.Interval) + 1
}

// silence is how long a peer is not heard (or does not acknowledge our
// reports) before the next report is a full one (Ledger.resync): two
// report periods, and half an interval more for the jitter when a report
// goes at every Tick.
func (c Config) silence() time.Duration {
	if c.heartbeat() <= c.Interval {
		return 2*c.Interval + c.Interval/2
	}
	return 2 * c.reportEvery()
}

// maxGiftWaitTicks is the longest GiftWait in Ticks: the key counts them
// in one byte (key.waited).
const maxGiftWaitTicks = 255

// giftWaitTicks is GiftWait in Ticks, rounded up (Validate keeps it within
// maxGiftWaitTicks): how many Ticks in a row give holds a small excess
// back.
func (c Config) giftWaitTicks() int {
	if c.GiftWait <= 0 || c.Interval <= 0 {
		return 0
	}
	return int(min(maxGiftWaitTicks, (c.GiftWait+c.Interval-1)/c.Interval))
}

// smallGift reports whether an excess of units, while some region wants
// more than its floor, is within GiftBand of the limit: give holds it
// back for giftWaitTicks.
func (c Config) smallGift(units int64) bool {
	return c.Quantum <= 1 && float64(units) <= c.GiftBand*float64(c.Units)
}

// reportEvery is the longest time between two reports of a healthy
// ledger: the heartbeat, or the interval if that is longer.
func (c Config) reportEvery() time.Duration {
	return max(c.Interval, c.heartbeat())
}

// HealBound is invariant 4's T_heal (the package doc, Liveness): how long
// after a fault heals, with every agent up and demand holding still, every
// key's positions take at most to reach the allocator's targets, given
// registry, the longest time for a registry change to reach a ledger
// (an etcd round trip, plus the agent's poll period for a change made by
// another region), and rtt, the longest round trip between two regions:
// two registry delays, two report periods and round trips, three rounds
// of gifts (an interval, a store write, a round trip and the gift wait
// each), the ledger's times stretched by its clock's rate bound.
func (c Config) HealBound(registry, rtt time.Duration) time.Duration {
	iv := time.Duration(float64(c.Interval) * (1 + c.Rho))
	rep := time.Duration(float64(c.reportEvery()) * (1 + c.Rho))
	wait := time.Duration(float64(time.Duration(c.giftWaitTicks())*c.Interval) * (1 + c.Rho))
	return 2*registry + 2*(rep+rtt) + 3*(iv+c.StoreTimeout+rtt+wait)
}

// DefaultConfig returns the defaults documented on Config.
func DefaultConfig() Config {
	return Config{
		Units:           allocation.DefaultUnits,
		MinShare:        0.1,
		Interval:        250 * time.Millisecond,
		Lease:           3 * time.Second,
		Rho:             0.01,
		Margin:          500 * time.Millisecond,
		StoreTimeout:    100 * time.Millisecond,
		RetryWrite:      time.Second,
		FullEvery:       8,
		PaceKeys:        1024,
		HeartbeatEvery:  time.Second,
		DemandBand:      0.25,
		DemandRefresh:   3 * time.Second,
		HalfLife:        250 * time.Millisecond,
		IdleAfter:       10 * time.Second,
		Hysteresis:      100,
		GiftBand:        0.02,
		GiftWait:        time.Second,
		DemandTokens:    40,
		KeepToken:       3,
		EvenBand:        0.35,
		MaxClosureBytes: 256 << 10,
		Allocate:        WaterFill,
	}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	switch {
	case c.Units <= 0:
		return fmt.Errorf("%w: Units must be positive", ErrConfig)
	case !(c.MinShare >= 0 && c.MinShare <= 1):
		return fmt.Errorf("%w: MinShare must be in [0,1]", ErrConfig)
	case c.Interval <= 0:
		return fmt.Errorf("%w: Interval must be positive", ErrConfig)
	case !(c.Rho >= 0 && c.Rho < 0.5):
		return fmt.Errorf("%w: Rho must be in [0,0.5)", ErrConfig)
	case c.StoreTimeout < 0 || c.Margin < 0:
		return fmt.Errorf("%w: StoreTimeout and Margin must not be negative", ErrConfig)
	case float64(c.Lease)*(1-c.Rho)/(1+c.Rho) <= float64(c.StoreTimeout+c.Interval):
		return fmt.Errorf("%w: Lease must exceed Interval+StoreTimeout with the clock margin", ErrConfig)
	case c.WitnessLease < 0 || c.WitnessLease > 0 && c.WitnessLease < c.Lease:
		return fmt.Errorf("%w: WitnessLease %v must be 0 or at least Lease %v", ErrConfig, c.WitnessLease, c.Lease)
	case c.RetryWrite <= 0:
		return fmt.Errorf("%w: RetryWrite must be positive", ErrConfig)
	case c.FullEvery <= 0:
		return fmt.Errorf("%w: FullEvery must be positive", ErrConfig)
	case c.PaceKeys < 0:
		return fmt.Errorf("%w: PaceKeys %d must not be negative", ErrConfig, c.PaceKeys)
	case c.HeartbeatEvery < 0:
		return fmt.Errorf("%w: HeartbeatEvery %v must not be negative", ErrConfig, c.HeartbeatEvery)
	case !(c.DemandBand >= 0 && c.DemandBand < 1):
		return fmt.Errorf("%w: DemandBand %v must be in [0, 1)", ErrConfig, c.DemandBand)
	case c.DemandRefresh < 0:
		return fmt.Errorf("%w: DemandRefresh must not be negative", ErrConfig)
	case c.HalfLife < 0:
		return fmt.Errorf("%w: HalfLife must not be negative", ErrConfig)
	case c.IdleAfter <= 0:
		return fmt.Errorf("%w: IdleAfter must be positive", ErrConfig)
	case c.Hysteresis < 0:
		return fmt.Errorf("%w: Hysteresis must not be negative", ErrConfig)
	case !(c.GiftBand >= 0 && c.GiftBand < 1):
		return fmt.Errorf("%w: GiftBand %v must be in [0, 1)", ErrConfig, c.GiftBand)
	case c.GiftWait < 0 || c.GiftWait > maxGiftWaitTicks*c.Interval:
		return fmt.Errorf("%w: GiftWait %v must be in [0, %d intervals] (%v)", ErrConfig, c.GiftWait, maxGiftWaitTicks, maxGiftWaitTicks*c.Interval)
	case !(c.DemandTokens >= 0) || math.IsInf(c.DemandTokens, 0):
		return fmt.Errorf("%w: DemandTokens must be finite and not negative", ErrConfig)
	case !(c.KeepToken >= 0) || math.IsInf(c.KeepToken, 0):
		return fmt.Errorf("%w: KeepToken must be finite and not negative", ErrConfig)
	case !(c.EvenBand >= 0 && c.EvenBand <= 1):
		return fmt.Errorf("%w: EvenBand must be in [0, 1]", ErrConfig)
	case c.Quantum < 0 || c.Quantum > c.Units:
		return fmt.Errorf("%w: Quantum must be in [0, Units]", ErrConfig)
	case c.MaxClosureBytes <= 0:
		return fmt.Errorf("%w: MaxClosureBytes must be positive", ErrConfig)
	case c.Allocate == nil:
		return fmt.Errorf("%w: Allocate is nil", ErrConfig)
	}
	return nil
}

// WholeTokensUpTo is the largest capacity, in tokens, for which QuantumOf
// asks for whole tokens: above it a region's share is many tokens, and a
// fraction of one changes what it admits by 1% or less.
const WholeTokensUpTo = 100

// QuantumOf returns the Quantum for a limit of capacity tokens over units:
// units/capacity rounded up, for a capacity of 1 to WholeTokensUpTo tokens,
// else 0. Rounded up, because the store enforces the capacity of u units
// rounded down (floor(capacity*u/units), in thousandths of a token): with
// units/capacity rounded down, a region holding one quantum of a capacity
// that does not divide units (3 of 1,000,000: 333,333 units) would
// enforce 0.999 of a token and admit nothing.
func QuantumOf(units int64, capacity float64) int64 {
	if !(capacity >= 1) || capacity > WholeTokensUpTo {
		return 0
	}
	c := int64(math.Floor(capacity))
	return (units + c - 1) / c
}

// ReclaimAfter is how long, on a survivor's clock, a peer incarnation must be
// silent before the survivor freezes it and contributes to its reclaim:
// L(1+Rho)/(1-Rho) + Margin. By then the silent region's store lease has
// lapsed in real time (see the package doc).
func (c Config) ReclaimAfter() time.Duration {
	return time.Duration(math.Ceil(float64(c.Lease)*(1+c.Rho)/(1-c.Rho))) + c.Margin
}

// AllocatorOf adapts an allocation strategy to the ledger: the wants (demand
// above the floor, in units) become allocation.Regions with a zero floor,
// and allocation.SplitUnits returns integer targets summing exactly to the
// pool. The agent and the simulator both build their ledgers' Allocate with
// it.
func AllocatorOf(f allocation.Func) Allocator {
	return func(pool int64, wants []Want) []int64 {
		rs := make([]allocation.Region, len(wants))
		for i, w := range wants {
			rs[i] = allocation.Region{Weight: w.Weight, Demand: float64(w.Demand)}
		}
		return allocation.SplitUnits(f, pool, rs)
	}
}

// WaterFill is the default Allocator: allocation.WaterFillUnits of the
// wants' weights and demands.
func WaterFill(pool int64, wants []Want) []int64 {
	var wb [16]float64 // on the stack for up to 16 regions: it runs per key and tick
	var db [16]int64
	w, d := wb[:0], db[:0]
	for _, x := range wants {
		w, d = append(w, x.Weight), append(d, x.Demand)
	}
	return allocation.WaterFillUnits(pool, w, d)
}
