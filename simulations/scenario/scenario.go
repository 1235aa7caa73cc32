// Package scenario is the YAML schema of a simulation: regions and the
// one-way delay matrix between them, the global rule, the sync settings,
// demand per region over time and disruptions (partitions, region loss, agent
// restarts). Decoding is strict: an unknown field, a value of the wrong
// type, a second YAML document, a bad value or an inconsistent file is
// refused with an error that names the file's line and the field. The rule
// is held to the rule store's limits (rules.Rule.Validate), an explicit 0 is
// never taken for a default (Parse), and CheckSize refuses a run larger
// than the simulator runs.
//
// Invariant: a Scenario returned by Parse or Load is valid (Validate returns
// nil), so the simulator never has to second-guess it.
package scenario

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	yaml "go.yaml.in/yaml/v3"
)

// ErrInvalid is wrapped by every error Parse and Load return for a bad file.
var ErrInvalid = errors.New("scenario: invalid")

// Error is a validation error that names the line and the field.
type Error struct {
	File  string
	Line  int    // 0: unknown
	Field string // dotted path, e.g. regions[2].name
	Msg   string
	// see lists other fields (dotted paths) that Msg names; Parse adds
	// their lines to Msg.
	see []string
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("scenario: ")
	if e.File != "" {
		b.WriteString(e.File)
		b.WriteString(": ")
	}
	if e.Line > 0 {
		fmt.Fprintf(&b, "line %d: ", e.Line)
	}
	if e.Field != "" {
		b.WriteString(e.Field)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// Unwrap makes errors.Is(err, ErrInvalid) true.
func (e *Error) Unwrap() error { return ErrInvalid }

// Duration is a time.Duration written as "250ms", "60s", "24h".
type Duration time.Duration

// durationError is the error of Duration.UnmarshalYAML; Parse names the
// field from its line and value.
type durationError struct {
	line  int
	value string
}

func (e *durationError) Error() string {
	return fmt.Sprintf("line %d: bad duration %q (use e.g. 250ms, 60s, 1h)", e.line, e.value)
}

// UnmarshalYAML parses a Go duration string.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	var s string
	if err := n.Decode(&s); err != nil {
		return err
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return &durationError{line: n.Line, value: s}
	}
	*d = Duration(v)
	return nil
}

// MarshalYAML writes the duration as a string.
func (d Duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

// D returns d as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// Scenario is one simulation. Field comments give the YAML name, the unit and
// the default.
type Scenario struct {
	Name        string   `yaml:"name"`        // required
	Description string   `yaml:"description"` // free text
	Seed        uint64   `yaml:"seed"`        // default 1 (0: 1); --seed overrides
	Duration    Duration `yaml:"duration"`    // required, > 0
	// Regions, in order (the order of every table and plot). At least one.
	Regions []Region `yaml:"regions"`
	Network Network  `yaml:"network"`
	Rule    Rule     `yaml:"rule"`
	Sync    Sync     `yaml:"sync"`
	Demand  []Demand `yaml:"demand"` // at least one entry
	Events  []Event  `yaml:"events"`
	// Sample is the period of the time series and share samples (default
	// 1s; an explicit 0 is refused).
	Sample Duration `yaml:"sample"`

	// src is the file the scenario was parsed from (nil: built in code),
	// for the lines of errors found after Parse (CheckSize).
	src *source
}

// source is a parsed file: its name and its YAML tree.
type source struct {
	file string
	root *yaml.Node
}

// Region is one region.
type Region struct {
	Name string `yaml:"name"`
	// AgentClock is this region's agent clock rate error (e.g. 0.004 runs
	// 0.4% fast); absent: drawn uniformly in +-sync.clock_error.
	AgentClock *float64 `yaml:"agent_clock"`
	// StoreClock is this region's store (Redis TIME) clock rate error
	// (default 0). A fast store clock refills every bucket faster than real
	// time: every strategy, the ideal included, then admits that much more.
	StoreClock float64 `yaml:"store_clock"`
}

// Network is the virtual WAN.
type Network struct {
	// DelayMs is the one-way delay matrix in milliseconds, by region name.
	// A pair given once applies both ways; every pair of regions must be
	// given. Every delay in ms (these, JitterMs, RegistryMs, Sync.StoreMs)
	// is finite and at most MaxDelay.
	DelayMs map[string]map[string]float64 `yaml:"delay_ms"`
	// JitterMs adds a uniform [0, jitter] ms to every message (default 0).
	JitterMs float64 `yaml:"jitter_ms"`
	// Loss is the probability that a message is lost (default 0).
	Loss float64 `yaml:"loss"`
	// RegistryMs is the one-way delay to the reclaim registry, etcd (default 20).
	RegistryMs *float64 `yaml:"registry_ms"`
}

// Rule is the global limit, per key.
type Rule struct {
	Rate     float64 `yaml:"rate"`      // tokens per second, in the rule store's refill range
	Burst    float64 `yaml:"burst"`     // capacity in whole tokens, in the rule store's range (default: rate)
	MinShare float64 `yaml:"min_share"` // fraction held as floors, [0,1] (default 0, as in a rule: no floor)
	// Weights per region; they must name every region once and add up to 1
	// (default: equal).
	Weights map[string]float64 `yaml:"weights"`
	// Allocation is max_min_fair (default), proportional or static.
	Allocation string `yaml:"allocation"`
	// Window, if set, makes the rule a fixed window of burst requests per
	// window (a global fixed_window: a daily quota); rate then defaults to
	// burst / window, the rate demand levels are multiples of.
	Window Duration `yaml:"window"`
}

// Sync holds the sync agent's settings (the ledger's Config and the agent's
// own) and the usage sync interval of the async strategy. Every default is
// the production default (sync/agent.DefaultConfig).
type Sync struct {
	// Interval, Lease, StoreTimeout, RegistryPoll and EtcdTimeout are
	// positive (an explicit 0 is refused); Margin 0 is no margin.
	Interval     Duration `yaml:"interval"`      // default 100ms
	Lease        Duration `yaml:"lease"`         // default 3s
	ClockError   *float64 `yaml:"clock_error"`   // the ledger's Rho: agent clock rate bound (default 0.01)
	Margin       Duration `yaml:"margin"`        // reclaim margin (default 500ms; 0s: none)
	StoreTimeout Duration `yaml:"store_timeout"` // default 100ms
	RegistryPoll Duration `yaml:"registry_poll"` // how often an agent reads the reclaim registry (default 500ms)
	EtcdTimeout  Duration `yaml:"etcd_timeout"`  // a registry call without a reply is given up after it (default 5s)
	// StoreMs is the delay of a store write and of its confirmation (default 1).
	StoreMs *float64 `yaml:"store_ms"`
	// HalfLife is the half-life of the ledger's demand estimate (an EWMA;
	// default 250ms, the agent's; 0 keeps only the newest interval):
	// shorter follows shifts faster, longer is steadier under noisy arrivals.
	HalfLife *Duration `yaml:"half_life"`
	// Heartbeat is the ledger's HeartbeatEvery: a Tick with nothing changed
	// sends no report unless this long has passed since the last one
	// (bounded by the lease; default 1s, the agent's; 0: a report every
	// interval).
	Heartbeat *Duration `yaml:"heartbeat"`
	// DemandBand is the ledger's DemandBand: a key's demand counts as
	// changed only past this fraction of the value last reported
	// (default 0.25, the agent's; 0: every change). A move past a tenth
	// of it is reported within the ledger's DemandRefresh (3 s).
	DemandBand *float64 `yaml:"demand_band"`
	// GiftBand and GiftWait are the ledger's: an excess over a key's
	// target of at most gift_band of the limit is given only once it has
	// lasted gift_wait (defaults 0.02 and 1s, the agent's; gift_wait 0s:
	// at once).
	GiftBand *float64  `yaml:"gift_band"`
	GiftWait *Duration `yaml:"gift_wait"`
	// WitnessLease is the ledger's WitnessLease, between two regions: a
	// region cut off from its peer and from etcd keeps its position this
	// long after its last renewal of its witness key in etcd, and a region
	// silent that long (times (1+clock_error)/(1-clock_error), plus the
	// margin) is reclaimed by the other (default 1m, the agent's; 0s: no
	// witness, and neither of two regions is ever reclaimed).
	WitnessLease *Duration `yaml:"witness_lease"`
}

// Demand is one stream of requests. Levels are multiples of rule.rate.
type Demand struct {
	// Region sends this stream; or Split divides it among regions by
	// fractions that add up to 1.
	Region string             `yaml:"region"`
	Split  map[string]float64 `yaml:"split"`
	// Key is the key the requests use (default "k0"); or Keys spreads them
	// over many keys.
	Key  string  `yaml:"key"`
	Keys *KeySet `yaml:"keys"`
	// Shape: constant (default), steps, ramp, sinusoid.
	Shape string  `yaml:"shape"`
	Level float64 `yaml:"level"` // constant; sinusoid mean
	Steps []Step  `yaml:"steps"` // steps: level from each at on (0 before the first)
	// ramp: From until Start, linear to To at End, To after.
	From  float64  `yaml:"from"`
	To    float64  `yaml:"to"`
	Start Duration `yaml:"start"`
	End   Duration `yaml:"end"`
	// sinusoid: Level + Amplitude*sin(2*pi*(t+Phase)/Period), clamped at
	// 0; Amplitude >= 0.
	Amplitude float64  `yaml:"amplitude"`
	Period    Duration `yaml:"period"`
	Phase     Duration `yaml:"phase"`
	// Arrivals: poisson (default) or uniform (evenly spaced).
	Arrivals string `yaml:"arrivals"`
	Cost     int64  `yaml:"cost"` // tokens per request, a whole number (default 1; 0 means 1, as in CheckLimit)
}

// Step is a level from a time on.
type Step struct {
	At    Duration `yaml:"at"`
	Level float64  `yaml:"level"`
}

// KeySet is many keys with a Zipf popularity: key i (0-based) is drawn with
// probability proportional to 1/(1+i)^S.
type KeySet struct {
	Count  int     `yaml:"count"`  // 1 to MaxKeys
	S      float64 `yaml:"zipf_s"` // > 1 (default 1.1)
	Prefix string  `yaml:"prefix"` // key names are prefix + index (default "key")
}

// Event is a disruption.
type Event struct {
	// Kind: partition (the regions are cut off from the others and from the
	// registry), region_loss (the region's traffic, agent and store are gone),
	// agent_restart (the agent loses its state and restarts after For),
	// store_reset (the region's Redis restarts empty, with a new run id;
	// its traffic and agent carry on; For does not apply), loss (every
	// message between the regions and any other region is dropped with
	// probability Loss, on top of network.loss; the registry is not
	// affected). Two events of one kind that touch a common region must
	// not overlap or adjoin in time: Validate refuses them (the simulator
	// would end both at the first end).
	Kind    string   `yaml:"kind"`
	Regions []string `yaml:"regions"` // each once
	At      Duration `yaml:"at"`
	// For is how long (partition, region_loss, loss: 0 means until the
	// end; agent_restart: downtime, default 1s, an explicit 0 refused).
	For Duration `yaml:"for"`
	// Loss is a loss event's drop probability, in (0, 1].
	Loss float64 `yaml:"loss"`
}

// Index returns the position of the region called name, or -1.
func (sc *Scenario) Index(name string) int {
	for i, r := range sc.Regions {
		if r.Name == name {
			return i
		}
	}
	return -1
}

func (sc *Scenario) delay(a, b string) (float64, bool) {
	if v, ok := sc.Network.DelayMs[a][b]; ok {
		return v, true
	}
	v, ok := sc.Network.DelayMs[b][a]
	return v, ok
}

// Delay returns the one-way delay from region i to region j.
func (sc *Scenario) Delay(i, j int) time.Duration {
	if i == j {
		return 0
	}
	v, _ := sc.delay(sc.Regions[i].Name, sc.Regions[j].Name)
	return time.Duration(v * 1e6)
}

// Weights returns the rule's weights in region order.
func (sc *Scenario) Weights() []float64 {
	w := make([]float64, len(sc.Regions))
	for i, r := range sc.Regions {
		w[i] = sc.Rule.Weights[r.Name]
	}
	return w
}

// OutsideClockGuarantee lists the clocks of the scenario that run outside
// the guarantee the ledger's bounds rest on (docs/design.md section 8:
// every agent and store clock within sync.clock_error of real time). Agent
// clocks are validated to be within it; a store clock may be set outside
// it, to show what happens then. Empty: the bounds apply.
func (sc *Scenario) OutsideClockGuarantee() []string {
	var out []string
	rho := *sc.Sync.ClockError
	for i, r := range sc.Regions {
		if math.Abs(r.StoreClock) > rho {
			out = append(out, fmt.Sprintf("regions[%d] %s: store_clock %v outside sync.clock_error %v", i, r.Name, r.StoreClock, rho))
		}
	}
	return out
}
