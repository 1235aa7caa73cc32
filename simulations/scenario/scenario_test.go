package scenario

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/sync/agent"
)

const good = `name: t
duration: 60s
regions:
  - name: a
  - name: b
network:
  delay_ms:
    a: {b: 40}
rule:
  rate: 100
  weights: {a: 0.5, b: 0.5}
demand:
  - split: {a: 0.7, b: 0.3}
    level: 1.5
`

func TestParseGood(t *testing.T) {
	sc, err := Parse("good.yaml", []byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if sc.Rule.Burst != 100 || sc.Sync.Interval.D().String() != "100ms" || sc.Demand[0].Key != "k0" {
		t.Fatalf("defaults not applied: %+v", sc)
	}
	if d := sc.Delay(1, 0); d.Milliseconds() != 40 {
		t.Fatalf("delay b->a = %v, want 40ms both ways", d)
	}
}

// TestDefaultsAreProduction: a scenario that sets nothing runs the sync
// agent's production defaults.
func TestDefaultsAreProduction(t *testing.T) {
	sc, err := Parse("good.yaml", []byte(good))
	if err != nil {
		t.Fatal(err)
	}
	c, s := agent.DefaultConfig(), sc.Sync
	if s.Interval.D() != c.Interval || s.Lease.D() != c.Lease || *s.ClockError != c.Rho || s.Margin.D() != c.Margin ||
		s.StoreTimeout.D() != c.StoreTimeout || s.RegistryPoll.D() != c.RegistryPoll || s.EtcdTimeout.D() != c.EtcdTimeout ||
		s.HalfLife.D() != c.HalfLife || sc.Rule.MinShare != 0 || sc.Rule.Allocation != c.Strategy {
		t.Errorf("scenario defaults %+v (min_share %v, allocation %s) differ from the agent's %+v", s, sc.Rule.MinShare, sc.Rule.Allocation, c)
	}
}

// TestOutsideClockGuarantee: a store clock beyond sync.clock_error is named.
func TestOutsideClockGuarantee(t *testing.T) {
	sc, err := Parse("good.yaml", []byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if n := sc.OutsideClockGuarantee(); len(n) != 0 {
		t.Fatalf("default clocks reported outside the guarantee: %v", n)
	}
	sc.Regions[1].StoreClock = 0.02
	n := sc.OutsideClockGuarantee()
	if len(n) != 1 || !strings.Contains(n[0], "b: store_clock 0.02") {
		t.Fatalf("OutsideClockGuarantee = %v, want region b's store clock", n)
	}
}

func TestShippedScenariosParse(t *testing.T) {
	files, _ := filepath.Glob("../scenarios/*.yaml")
	if len(files) < 7 {
		t.Fatalf("found %d shipped scenarios", len(files))
	}
	for _, f := range files {
		sc, err := Load(f)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if err := sc.CheckSize(sc.Duration.D()); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
}

// TestBadFilesNameTheLine: each bad file fails with an error naming the line
// of the offending field.
func TestBadFilesNameTheLine(t *testing.T) {
	cases := []struct {
		name, from, to, line, msg string
	}{
		{"unknown field", "  rate: 100\n", "  rate: 100\n  rte: 5\n", "line 11", `unknown field "rte"`},
		{"negative delay", "a: {b: 40}", "a: {b: -40}", "line 8", "negative"},
		{"weights do not add up", "{a: 0.5, b: 0.5}", "{a: 0.5, b: 0.6}", "line 11", "add up to 1.1"},
		{"split does not add up", "{a: 0.7, b: 0.3}", "{a: 0.7, b: 0.2}", "line 13", "add up to 0.9"},
		{"region named twice", "  - name: b\n", "  - name: a\n", "line 5", `"a" named twice`},
		{"bad duration", "duration: 60s", "duration: 60 seconds", "line 2", "bad duration"},
		{"wrong type", "rate: 100", "rate: fast", "line 10", `rule.rate: want a number, got "fast"`},
		{"wrong type in a flow mapping", "a: {b: 40}", "a: {b: far}", "line 8", `network.delay_ms.a.b: want a number, got "far"`},
		{"wrong type in a list", "  - name: b\n", "  - name: [b]\n", "line 5", "regions[1].name: want a string, got a list"},
		{"bad duration names the field", "duration: 60s", "duration: 60", "line 2", `duration: bad duration "60"`},
		{"negative seed", "name: t\n", "name: t\nseed: -1\n", "line 2", "seed: want a whole number >= 0 (below 2^64), got -1"},
		{"fractional seed", "name: t\n", "name: t\nseed: 2.5\n", "line 2", "seed: 2.5 is not a whole number"},
		// The rule store's limits (rules.Rule.Validate), named as the scenario's fields.
		{"burst above the store's capacity", "  rate: 100\n", "  rate: 100\n  burst: 274877907\n", "line 11", "rule.burst: 274877907: must be at most 274877906"},
		{"burst defaulting to a rate above the store's capacity", "rate: 100", "rate: 1e9", "line 9", "rule.burst: 1000000000 (burst defaults to rate): must be at most 274877906"},
		{"rate above the store's refill", "rate: 100", "rate: 1e13\n  burst: 100", "line 10", "rule.rate: 10000000000000: must be at most 1e+09"},
		{"rate below the store's refill", "rate: 100", "rate: 0.0001\n  burst: 1", "line 10", "rule.rate: 0.0001: must be at least 0.001"},
		{"a fraction of a token as burst", "  rate: 100\n", "  rate: 100\n  burst: 0.001\n", "line 11", "rule.burst: 0.001 is not a whole number"},
		{"a window's rate out of the refill range", "rate: 100", "rate: 1e300\n  burst: 100\n  window: 1m", "line 10", "rule.rate: 1e+300: must be at most 1e+09 tokens/s"},
		{"a window of a fraction of a ms", "  rate: 100\n", "  rate: 100\n  window: 1500us\n", "line 11", "rule.window: 1.5ms: must be a whole number of milliseconds"},
		// Overlapping events of one kind on one region.
		{"overlapping partitions", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: partition, regions: [a], at: 5s, for: 10s}\n  - {kind: partition, regions: [a], at: 8s, for: 10s}\n", "line 17",
			"events[1]: a partition of a from 8s to 18s overlaps or adjoins events[0] (line 16), a partition of a from 5s to 15s, on region a"},
		{"overlapping agent restarts", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: agent_restart, regions: [b], at: 5s, for: 10s}\n  - {kind: agent_restart, regions: [b], at: 7s, for: 1s}\n", "line 17",
			"events[1]: an agent_restart of b from 7s to 8s overlaps or adjoins events[0] (line 16), an agent_restart of b from 5s to 15s, on region b"},
		{"adjoining partitions listed out of order", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: partition, regions: [a], at: 15s, for: 10s}\n  - {kind: partition, regions: [a], at: 5s, for: 10s}\n", "line 17",
			"events[1]: a partition of a from 5s to 15s overlaps or adjoins events[0] (line 16)"},
		{"a partition of a group overlapping one of its regions'", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: partition, regions: [a, b], at: 5s}\n  - {kind: loss, regions: [a], at: 6s, loss: 0.5}\n  - {kind: partition, regions: [b], at: 40s, for: 1s}\n", "line 18",
			"events[2]: a partition of b from 40s to 41s overlaps or adjoins events[0] (line 16), a partition of a, b from 5s to the end, on region b"},
		{"two store resets at once", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: store_reset, regions: [a], at: 5s}\n  - {kind: store_reset, regions: [b, a], at: 5s}\n", "line 17",
			"events[1]: a store_reset of b, a at 5s overlaps or adjoins events[0] (line 16), a store_reset of a at 5s, on region a"},
		{"a region twice in an event", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: partition, regions: [a, a], at: 5s}\n", "line 16", `events[0].regions[1]: region "a" listed twice (first as regions[0])`},
		// Whole costs.
		{"a fractional cost", "    level: 1.5\n", "    level: 1.5\n    cost: 2.9\n", "line 15", "demand[0].cost: 2.9 is not a whole number"},
		{"a fractional key count", "    level: 1.5\n", "    level: 1.5\n    keys: {count: 2.5}\n", "line 15", "demand[0].keys.count: 2.5 is not a whole number"},
		// Delays that do not fit a time.Duration, or are not finite.
		{"a delay beyond an hour", "a: {b: 40}", "a: {b: 1e13}", "line 8", "network.delay_ms.a.b: 10000000000000 ms is above the maximum of 3600000 ms (an hour)"},
		{"a delay of 1e300 ms", "a: {b: 40}", "a: {b: 1e300}", "line 8", "network.delay_ms.a.b: 1e+300 ms is above the maximum"},
		{"jitter of 1e300 ms", "  delay_ms:\n", "  jitter_ms: 1e300\n  delay_ms:\n", "line 7", "network.jitter_ms: 1e+300 ms is above the maximum"},
		{"an infinite registry delay", "  delay_ms:\n", "  registry_ms: .inf\n  delay_ms:\n", "line 7", "network.registry_ms: negative or invalid delay +Inf ms"},
		{"an infinite store delay", "    level: 1.5\n", "    level: 1.5\nsync:\n  store_ms: .inf\n", "line 16", "sync.store_ms: negative or invalid delay +Inf ms"},
		// An explicit 0 is not the default.
		{"sample 0", "duration: 60s", "duration: 60s\nsample: 0s", "line 3", "sample: 0 is not allowed: it must be positive (0 does not stand for the default: leave the field out for 1s)"},
		{"interval 0", "    level: 1.5\n", "    level: 1.5\nsync:\n  interval: 0s\n", "line 16", "sync.interval: 0 is not allowed"},
		{"lease 0", "    level: 1.5\n", "    level: 1.5\nsync:\n  lease: 0s\n", "line 16", "sync.lease: 0 is not allowed"},
		{"burst 0", "  rate: 100\n", "  rate: 100\n  burst: 0\n", "line 11", "rule.burst: 0 is not allowed"},
		{"an agent restart for 0", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: agent_restart, regions: [a], at: 5s, for: 0s}\n", "line 16", "events[0].for: 0 is not allowed"},
		// Messages.
		{"an interval too short for gift_wait's default blames the interval", "    level: 1.5\n", "    level: 1.5\nsync:\n  interval: 1ms\n", "line 16",
			"sync.interval: 1ms is too short for sync.gift_wait's default of 1s, which may be at most 255 intervals (255ms at this interval): use an interval of at least 3.921569ms, or set gift_wait"},
		{"a negative amplitude", "    level: 1.5\n", "    level: 1.5\n    shape: sinusoid\n    period: 1m\n    amplitude: -0.5\n", "line 17", "demand[0].amplitude: -0.5: must be >= 0"},
		{"unknown shape", "    level: 1.5\n", "    level: 1.5\n    shape: square\n", "line 15", "unknown shape"},
		// Fields the shape does not read, and a cost no bucket can admit.
		{"a level on steps", "    level: 1.5\n", "    level: 1.5\n    shape: steps\n    steps: [{at: 0s, level: 1}]\n", "line 14",
			"demand[0].level: does not apply to shape steps, which uses steps"},
		{"amplitude on steps", "    level: 1.5\n", "    shape: steps\n    steps: [{at: 0s, level: 1}]\n    amplitude: 3\n", "line 16",
			"demand[0].amplitude: does not apply to shape steps"},
		{"from on steps", "    level: 1.5\n", "    shape: steps\n    steps: [{at: 0s, level: 1}]\n    from: 2\n", "line 16", "demand[0].from: does not apply to shape steps"},
		{"a period on steps", "    level: 1.5\n", "    shape: steps\n    steps: [{at: 0s, level: 1}]\n    period: 1h\n", "line 16", "demand[0].period: does not apply to shape steps"},
		{"steps on the default constant", "    level: 1.5\n", "    level: 1.5\n    steps: [{at: 0s, level: 3}]\n", "line 15",
			"demand[0].steps: does not apply to shape constant, which uses level"},
		{"a level of 0 on a ramp", "    level: 1.5\n", "    level: 0\n    shape: ramp\n    to: 1\n    end: 10s\n", "line 14", "demand[0].level: does not apply to shape ramp, which uses from, to, start, end"},
		{"a cost above the burst", "    level: 1.5\n", "    level: 1.5\n    cost: 101\n", "line 15",
			"demand[0].cost: 101 is above rule.burst 100 (the rule's burst): no request of this cost can ever be admitted"},
		{"a cost above a window's limit", "  rate: 100\n  weights: {a: 0.5, b: 0.5}\ndemand:\n  - split: {a: 0.7, b: 0.3}\n",
			"  burst: 50\n  window: 10s\n  weights: {a: 0.5, b: 0.5}\ndemand:\n  - split: {a: 0.7, b: 0.3}\n    cost: 51\n", "line 15", "demand[0].cost: 51 is above rule.burst 50 (the rule's limit per window)"},
		{"unknown region in demand", "{a: 0.7, b: 0.3}", "{a: 0.7, c: 0.3}", "line 13", `unknown region "c"`},
		{"demand band out of range", "    level: 1.5\n", "    level: 1.5\nsync:\n  demand_band: 1.5\n", "line 16", "sync.demand_band"},
		{"a region that can never hold a whole token", "  rate: 100\n", "  rate: 100\n  burst: 1\n  min_share: 0.1\n", "line 12", "rule.min_share: 0.1 leaves region a at most 0.95 of a token"},
		{"negative heartbeat", "    level: 1.5\n", "    level: 1.5\nsync:\n  heartbeat: -1s\n", "line 16", "sync.heartbeat"},
		{"gift band out of range", "    level: 1.5\n", "    level: 1.5\nsync:\n  gift_band: 1\n", "line 16", "sync.gift_band"},
		{"a store reset that lasts", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: store_reset, regions: [a], at: 10s, for: 5s}\n", "line 16", "events[0].for: a store_reset is instantaneous"},
		{"unknown event kind", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: redis_crash, regions: [a], at: 10s}\n", "line 16", `unknown kind "redis_crash" (partition, region_loss, agent_restart, store_reset, loss)`},
		{"a loss event without a loss", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: loss, regions: [a], at: 10s, for: 5s}\n", "line 16", "events[0].loss: 0: a loss event drops messages with a probability in (0, 1]"},
		{"a loss on a partition", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: partition, regions: [a], at: 10s, loss: 0.5}\n", "line 16", "events[0].loss: only a loss event has a loss (this is a partition)"},
		{"gift wait beyond 255 intervals", "    level: 1.5\n", "    level: 1.5\nsync:\n  gift_wait: 30s\n", "line 16", "sync.gift_wait: 30s must be in [0, 255 intervals] (25.5s at sync.interval 100ms)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			src := strings.Replace(good, c.from, c.to, 1)
			if src == good {
				t.Fatal("replacement did not apply")
			}
			_, err := Parse("bad.yaml", []byte(src))
			if err == nil {
				t.Fatal("accepted")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error %v does not wrap ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), "bad.yaml: "+c.line+": ") || !strings.Contains(err.Error(), c.msg) {
				t.Errorf("error %q, want %q and %q", err, c.line, c.msg)
			}
		})
	}
}

func TestLevels(t *testing.T) {
	d := Demand{Shape: "steps", Steps: []Step{{At: 0, Level: 1}, {At: Duration(60e9), Level: 2}}}
	if d.LevelAt(59e9) != 1 || d.LevelAt(60e9) != 2 {
		t.Fatal("steps")
	}
	r := Demand{Shape: "ramp", From: 0, To: 1, Start: Duration(10e9), End: Duration(20e9)}
	if r.LevelAt(0) != 0 || r.LevelAt(15e9) != 0.5 || r.LevelAt(30e9) != 1 {
		t.Fatal("ramp")
	}
}

// TestRegionNames: a region is named as the rule store names a rule's
// regions.
func TestRegionNames(t *testing.T) {
	src := "name: t\nduration: 60s\nregions:\n  - name: \"a,b\"\nrule: {rate: 100}\ndemand:\n  - {region: \"a,b\", level: 1}\n"
	_, err := Parse("bad.yaml", []byte(src))
	if want := `scenario: bad.yaml: line 4: regions[0].name: "a,b" has character ','`; err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("error %v, want %q", err, want)
	}
}

// TestBadDocuments: a file that is not one scenario document says so.
func TestBadDocuments(t *testing.T) {
	for _, c := range []struct{ name, src, want string }{
		{"empty", "", "scenario: bad.yaml: the file is empty: no YAML document"},
		{"only comments", "# a scenario\n\n# to come\n", "scenario: bad.yaml: the file is empty: no YAML document"},
		{"a second document", good + "---\nname: other\n", "scenario: bad.yaml: line 16: a second YAML document (after ---): a scenario file holds one document"},
		{"a list", "- name: t\n", "scenario: bad.yaml: line 1: a scenario file is a mapping of its fields (name: ..., duration: ..., regions: ...), not a list"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse("bad.yaml", []byte(c.src))
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.HasPrefix(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
		})
	}
	if _, err := Parse("good.yaml", []byte(good+"---\n")); err != nil {
		t.Errorf("an empty document after the scenario: %v", err)
	}
}

// TestDailyQuota: a quota of a few requests a day, whose rate (burst /
// window, the demand's unit) is below a token bucket's minimum refill, is
// a valid fixed window.
func TestDailyQuota(t *testing.T) {
	src := strings.Replace(good, "  rate: 100\n", "  burst: 50\n  window: 24h\n", 1)
	sc, err := Parse("quota.yaml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	if sc.Rule.Rate >= 0.001 {
		t.Fatalf("rate %v", sc.Rule.Rate)
	}
}

// TestGoodEvents: events of one kind on different regions or at
// different times, and events of different kinds, may overlap.
func TestGoodEvents(t *testing.T) {
	src := good + `events:
  - {kind: partition, regions: [a], at: 5s, for: 10s}
  - {kind: partition, regions: [b], at: 8s, for: 10s}
  - {kind: partition, regions: [a], at: 16s, for: 2s}
  - {kind: agent_restart, regions: [a], at: 6s, for: 2s}
  - {kind: store_reset, regions: [a], at: 6s}
  - {kind: store_reset, regions: [a], at: 7s}
`
	if _, err := Parse("good.yaml", []byte(src)); err != nil {
		t.Fatal(err)
	}
}

// TestExplicitZeros: sync.margin 0s is no margin (left out: the agent's
// 500ms); cost 0 is 1, as in a CheckLimit request; an interval short
// enough for an explicit gift_wait is accepted.
func TestExplicitZeros(t *testing.T) {
	sc, err := Parse("good.yaml", []byte(good+"sync:\n  margin: 0s\n"))
	if err != nil {
		t.Fatal(err)
	}
	if sc.Sync.Margin != 0 {
		t.Errorf("margin: 0s parsed as %v", sc.Sync.Margin.D())
	}
	sc, err = Parse("good.yaml", []byte(good+"    cost: 0\n"))
	if err != nil {
		t.Fatal(err)
	}
	if sc.Sync.Margin.D() != 500*time.Millisecond || sc.Demand[0].Cost != 1 {
		t.Errorf("defaults: margin %v, cost %d", sc.Sync.Margin.D(), sc.Demand[0].Cost)
	}
	if _, err := Parse("good.yaml", []byte(good+"sync:\n  interval: 1ms\n  gift_wait: 200ms\n")); err != nil {
		t.Error(err)
	}
}

// TestCheckSize: a run beyond what the simulator runs is refused before
// it starts, naming the field to lower and its line; a shorter run of the
// same scenario is not.
func TestCheckSize(t *testing.T) {
	parse := func(src string) *Scenario {
		t.Helper()
		sc, err := Parse("big.yaml", []byte(src))
		if err != nil {
			t.Fatal(err)
		}
		return sc
	}
	sc := parse(good)
	if err := sc.CheckSize(sc.Duration.D()); err != nil {
		t.Fatal(err)
	}
	manyRegions := func(n int) string {
		var b strings.Builder
		b.WriteString("name: t\nduration: 10s\nregions:\n")
		for i := range n {
			fmt.Fprintf(&b, "  - name: r%d\n", i)
		}
		b.WriteString("network:\n  delay_ms:\n")
		for i := range n - 1 {
			fmt.Fprintf(&b, "    r%d: {", i)
			for j := i + 1; j < n; j++ {
				fmt.Fprintf(&b, "r%d: 40, ", j)
			}
			b.WriteString("}\n")
		}
		b.WriteString("rule: {rate: 100}\ndemand:\n  - {region: r0, keys: {count: 600000}, level: 1}\n")
		return b.String()
	}
	for _, c := range []struct {
		name, src string
		dur       time.Duration
		want      string
	}{
		{"a million requests a second", strings.Replace(good, "rate: 100", "rate: 1e6", 1), time.Minute,
			"scenario: big.yaml: line 10: rule.rate: 1000000/s at the demand's peak levels offers up to 9e+07 requests in a minute, above the maximum of 10000000"},
		{"hours at 10,000 a second", strings.Replace(good, "rate: 100", "rate: 1e4", 1), 3 * time.Hour,
			"scenario: big.yaml: line 2: duration: a run of 3h0m0s at rule.rate 10000/s and the demand's peak levels offers up to 1.62e+08 requests, above the maximum of 100000000"},
		{"too many keys", good + "  - {region: a, keys: {count: 1000000}, level: 0.1}\n", time.Minute,
			"scenario: big.yaml: line 15: demand[1].keys.count: the demand uses 1000001 keys in all, above the maximum of 1000000"},
		{"too many keys times regions", manyRegions(20), 10 * time.Second,
			"scenario: big.yaml: line 47: demand[0].keys.count: 600000 keys in 20 regions (12000000 buckets per strategy, about 5.4 GB) are above the maximum of 10000000 keys x regions"},
		{"a sample of a nanosecond", strings.Replace(good, "duration: 60s", "duration: 60s\nsample: 1ns", 1), time.Minute,
			"scenario: big.yaml: line 3: sample: 1ns over a run of 1m0s is 60000000000 samples, above the maximum of 1000000"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sc := parse(c.src)
			err := sc.CheckSize(c.dur)
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.HasPrefix(err.Error(), c.want) {
				t.Fatalf("CheckSize(%v) = %v, want %q", c.dur, err, c.want)
			}
			if err := sc.CheckSize(time.Second); err != nil && strings.Contains(c.want, "requests") {
				t.Errorf("a shorter run: CheckSize(1s) = %v", err)
			}
		})
	}
}
