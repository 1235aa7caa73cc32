// Package scenario is the YAML schema of a simulation: regions and the
// one-way delay matrix between them, the global rule, the sync settings,
// demand per region over time and disruptions (partitions, region loss, agent
// restarts). Decoding is strict: an unknown field, a bad value or an
// inconsistent file is refused with an error that names the file's line.
//
// Invariant: a Scenario returned by Parse or Load is valid (Validate returns
// nil), so the simulator never has to second-guess it.
package scenario

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"regexp"
	"sort"
	"strconv"
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

// UnmarshalYAML parses a Go duration string.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	var s string
	if err := n.Decode(&s); err != nil {
		return err
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("line %d: bad duration %q (use e.g. 250ms, 60s, 1h)", n.Line, s)
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
	Seed        uint64   `yaml:"seed"`        // default 1; --seed overrides
	Duration    Duration `yaml:"duration"`    // required, > 0
	// Regions, in order (the order of every table and plot). At least one.
	Regions []Region `yaml:"regions"`
	Network Network  `yaml:"network"`
	Rule    Rule     `yaml:"rule"`
	Sync    Sync     `yaml:"sync"`
	Demand  []Demand `yaml:"demand"` // at least one entry
	Events  []Event  `yaml:"events"`
	// Sample is the period of the time series and share samples (default 1s).
	Sample Duration `yaml:"sample"`
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
	// A pair given once applies both ways; every pair of regions must be given.
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
	Rate     float64 `yaml:"rate"`      // tokens per second, > 0
	Burst    float64 `yaml:"burst"`     // capacity in tokens, > 0 (default: rate)
	MinShare float64 `yaml:"min_share"` // fraction held as floors, [0,1] (default 0, as in a rule: no floor)
	// Weights per region; they must name every region once and add up to 1
	// (default: equal).
	Weights map[string]float64 `yaml:"weights"`
	// Allocation is max_min_fair (default), proportional or static.
	Allocation string `yaml:"allocation"`
}

// Sync holds the sync agent's settings (the ledger's Config) and the usage
// sync interval of the async strategy.
type Sync struct {
	Interval     Duration `yaml:"interval"`      // default 250ms
	Lease        Duration `yaml:"lease"`         // default 3s
	ClockError   *float64 `yaml:"clock_error"`   // the ledger's Rho: agent clock rate bound (default 0.01)
	Margin       Duration `yaml:"margin"`        // reclaim margin (default 500ms)
	StoreTimeout Duration `yaml:"store_timeout"` // default 100ms
	// StoreMs is the delay of a store write and of its confirmation (default 1).
	StoreMs *float64 `yaml:"store_ms"`
	// ActivateAbove: a key's usage reaches the ledger (and the key becomes
	// coordinated) once a region used more than this fraction of its static
	// share of the key in one interval (default 0.25). Keys below it run on
	// static shares: only keys with traffic are coordinated (docs/design.md section 7).
	ActivateAbove *float64 `yaml:"activate_above"`
	// Alpha is the weight of the newest interval in the ledger's demand
	// estimate (an EWMA; default 0.5, the agent's): higher follows shifts
	// faster, lower is steadier under noisy arrivals.
	Alpha *float64 `yaml:"alpha"`
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
	// sinusoid: Level + Amplitude*sin(2*pi*(t+Phase)/Period), clamped at 0.
	Amplitude float64  `yaml:"amplitude"`
	Period    Duration `yaml:"period"`
	Phase     Duration `yaml:"phase"`
	// Arrivals: poisson (default) or uniform (evenly spaced).
	Arrivals string `yaml:"arrivals"`
	Cost     int64  `yaml:"cost"` // tokens per request (default 1)
}

// Step is a level from a time on.
type Step struct {
	At    Duration `yaml:"at"`
	Level float64  `yaml:"level"`
}

// KeySet is many keys with a Zipf popularity: key i (0-based) is drawn with
// probability proportional to 1/(1+i)^S.
type KeySet struct {
	Count  int     `yaml:"count"`  // >= 1
	S      float64 `yaml:"zipf_s"` // > 1 (default 1.1)
	Prefix string  `yaml:"prefix"` // key names are prefix + index (default "key")
}

// Event is a disruption.
type Event struct {
	// Kind: partition (the regions are cut off from the others and from the
	// registry), region_loss (the region's traffic, agent and store are gone),
	// agent_restart (the agent loses its state and restarts after For).
	Kind    string   `yaml:"kind"`
	Regions []string `yaml:"regions"`
	At      Duration `yaml:"at"`
	// For is how long (partition, region_loss: 0 means until the end;
	// agent_restart: downtime, default 1s).
	For Duration `yaml:"for"`
}

// Load reads and parses a scenario file.
func Load(path string) (*Scenario, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("scenario: %w", err)
	}
	return Parse(path, b)
}

var lineRE = regexp.MustCompile(`line (\d+): `)

// Parse decodes and validates a scenario; name is used in error messages.
func Parse(name string, data []byte) (*Scenario, error) {
	var sc Scenario
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&sc); err != nil {
		msg := err.Error()
		var te *yaml.TypeError
		if errors.As(err, &te) && len(te.Errors) > 0 {
			msg = te.Errors[0]
		}
		msg = strings.TrimPrefix(msg, "yaml: ")
		line := 0
		if m := lineRE.FindStringSubmatch(msg); m != nil {
			line, _ = strconv.Atoi(m[1])
			msg = strings.Replace(msg, m[0], "", 1)
		}
		if strings.Contains(msg, " not found in type ") {
			f := strings.TrimPrefix(msg, "field ")
			f = f[:strings.Index(f, " not found")]
			msg = fmt.Sprintf("unknown field %q", f)
		}
		return nil, &Error{File: name, Line: line, Msg: msg}
	}
	var root yaml.Node
	_ = yaml.Unmarshal(data, &root)
	sc.defaults()
	if err := sc.Validate(); err != nil {
		var e *Error
		if errors.As(err, &e) {
			e.File = name
			if e.Line == 0 {
				e.Line = lineOf(&root, e.Field)
			}
		}
		return nil, err
	}
	return &sc, nil
}

// lineOf finds the line of a dotted path (a.b[2].c) in the document.
func lineOf(root *yaml.Node, path string) int {
	n := root
	if n.Kind == yaml.DocumentNode && len(n.Content) > 0 {
		n = n.Content[0]
	}
	line := n.Line
	for _, part := range splitPath(path) {
		next := (*yaml.Node)(nil)
		switch {
		case n.Kind == yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				if n.Content[i].Value == part {
					line = n.Content[i].Line
					next = n.Content[i+1]
					break
				}
			}
		case n.Kind == yaml.SequenceNode:
			if i, err := strconv.Atoi(part); err == nil && i >= 0 && i < len(n.Content) {
				next = n.Content[i]
				line = next.Line
			}
		}
		if next == nil {
			return line
		}
		n = next
	}
	return line
}

func splitPath(p string) []string {
	var out []string
	for _, s := range strings.Split(p, ".") {
		for s != "" {
			i := strings.IndexByte(s, '[')
			if i < 0 {
				out = append(out, s)
				break
			}
			if i > 0 {
				out = append(out, s[:i])
			}
			j := strings.IndexByte(s, ']')
			if j < i {
				out = append(out, s[i+1:])
				break
			}
			out = append(out, s[i+1:j])
			s = s[j+1:]
		}
	}
	return out
}

func fptr(v float64) *float64 { return &v }

func (sc *Scenario) defaults() {
	if sc.Seed == 0 {
		sc.Seed = 1
	}
	if sc.Sample == 0 {
		sc.Sample = Duration(time.Second)
	}
	if sc.Rule.Burst == 0 {
		sc.Rule.Burst = sc.Rule.Rate
	}
	if sc.Rule.Allocation == "" {
		sc.Rule.Allocation = "max_min_fair"
	}
	if sc.Rule.Weights == nil && len(sc.Regions) > 0 {
		sc.Rule.Weights = map[string]float64{}
		for _, r := range sc.Regions {
			sc.Rule.Weights[r.Name] = 1 / float64(len(sc.Regions))
		}
	}
	if sc.Network.RegistryMs == nil {
		sc.Network.RegistryMs = fptr(20)
	}
	s := &sc.Sync
	if s.Interval == 0 {
		s.Interval = Duration(250 * time.Millisecond)
	}
	if s.Lease == 0 {
		s.Lease = Duration(3 * time.Second)
	}
	if s.ClockError == nil {
		s.ClockError = fptr(0.01)
	}
	if s.Margin == 0 {
		s.Margin = Duration(500 * time.Millisecond)
	}
	if s.StoreTimeout == 0 {
		s.StoreTimeout = Duration(100 * time.Millisecond)
	}
	if s.StoreMs == nil {
		s.StoreMs = fptr(1)
	}
	if s.ActivateAbove == nil {
		s.ActivateAbove = fptr(0.25)
	}
	if s.Alpha == nil {
		s.Alpha = fptr(0.5)
	}
	for i := range sc.Demand {
		d := &sc.Demand[i]
		if d.Shape == "" {
			d.Shape = "constant"
		}
		if d.Arrivals == "" {
			d.Arrivals = "poisson"
		}
		if d.Cost == 0 {
			d.Cost = 1
		}
		if d.Key == "" && d.Keys == nil {
			d.Key = "k0"
		}
		if d.Keys != nil {
			if d.Keys.S == 0 {
				d.Keys.S = 1.1
			}
			if d.Keys.Prefix == "" {
				d.Keys.Prefix = "key"
			}
		}
	}
	for i := range sc.Events {
		if sc.Events[i].Kind == "agent_restart" && sc.Events[i].For == 0 {
			sc.Events[i].For = Duration(time.Second)
		}
	}
}

func bad(field, format string, args ...any) error {
	return &Error{Field: field, Msg: fmt.Sprintf(format, args...)}
}

func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

// Index returns the position of the region called name, or -1.
func (sc *Scenario) Index(name string) int {
	for i, r := range sc.Regions {
		if r.Name == name {
			return i
		}
	}
	return -1
}

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
	// Sync.
	s := &sc.Sync
	if s.Interval <= 0 || s.Lease <= 0 || s.Margin < 0 || s.StoreTimeout < 0 {
		return bad("sync", "durations must be positive")
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
	if !(*s.Alpha > 0 && *s.Alpha <= 1) {
		return bad("sync.alpha", "must be in (0,1]")
	}
	if !(*s.ActivateAbove >= 0) {
		return bad("sync.activate_above", "must be >= 0")
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
		case "partition", "region_loss", "agent_restart":
		default:
			return bad(f+".kind", "unknown kind %q (partition, region_loss, agent_restart)", e.Kind)
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

// LevelAt returns the demand's level (multiple of rule.rate) at time t.
func (d *Demand) LevelAt(t time.Duration) float64 {
	switch d.Shape {
	case "steps":
		v := 0.0
		for _, s := range d.Steps {
			if t >= s.At.D() {
				v = s.Level
			}
		}
		return v
	case "ramp":
		switch {
		case t <= d.Start.D():
			return d.From
		case t >= d.End.D():
			return d.To
		}
		x := float64(t-d.Start.D()) / float64(d.End-d.Start)
		return d.From + (d.To-d.From)*x
	case "sinusoid":
		v := d.Level + d.Amplitude*math.Sin(2*math.Pi*float64(t+d.Phase.D())/float64(d.Period))
		return math.Max(0, v)
	}
	return d.Level
}

// Changes returns the times in (0, until) at which the demand changes in a
// step (the starts of steps), for convergence measurements.
func (d *Demand) Changes() []time.Duration {
	var out []time.Duration
	if d.Shape == "steps" {
		for _, s := range d.Steps {
			if s.At > 0 {
				out = append(out, s.At.D())
			}
		}
	}
	return out
}

// Fractions returns the part of the stream each region sends, in region order.
func (sc *Scenario) Fractions(d *Demand) []float64 {
	out := make([]float64, len(sc.Regions))
	if d.Region != "" {
		out[sc.Index(d.Region)] = 1
		return out
	}
	for k, v := range d.Split {
		out[sc.Index(k)] = v
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
