package scenario

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

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
		if _, err := Load(f); err != nil {
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
		{"wrong type", "rate: 100", "rate: fast", "line 10", "cannot unmarshal"},
		{"unknown shape", "    level: 1.5\n", "    level: 1.5\n    shape: square\n", "line 15", "unknown shape"},
		{"unknown region in demand", "{a: 0.7, b: 0.3}", "{a: 0.7, c: 0.3}", "line 13", `unknown region "c"`},
		{"demand band out of range", "    level: 1.5\n", "    level: 1.5\nsync:\n  demand_band: 1.5\n", "line 16", "sync.demand_band"},
		{"a region that can never hold a whole token", "  rate: 100\n", "  rate: 100\n  burst: 1\n  min_share: 0.1\n", "line 12", "rule.min_share: 0.1 leaves region a at most 0.95 of a token"},
		{"negative heartbeat", "    level: 1.5\n", "    level: 1.5\nsync:\n  heartbeat: -1s\n", "line 16", "sync.heartbeat"},
		{"gift band out of range", "    level: 1.5\n", "    level: 1.5\nsync:\n  gift_band: 1\n", "line 16", "sync.gift_band"},
		{"a store reset that lasts", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: store_reset, regions: [a], at: 10s, for: 5s}\n", "line 16", "events[0].for: a store_reset is instantaneous"},
		{"unknown event kind", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: redis_crash, regions: [a], at: 10s}\n", "line 16", `unknown kind "redis_crash" (partition, region_loss, agent_restart, store_reset, loss)`},
		{"a loss event without a loss", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: loss, regions: [a], at: 10s, for: 5s}\n", "line 16", "events[0].loss: 0: a loss event drops messages with a probability in (0, 1]"},
		{"a loss on a partition", "    level: 1.5\n", "    level: 1.5\nevents:\n  - {kind: partition, regions: [a], at: 10s, loss: 0.5}\n", "line 16", "events[0].loss: only a loss event has a loss (this is a partition)"},
		{"gift wait beyond 255 intervals", "    level: 1.5\n", "    level: 1.5\nsync:\n  gift_wait: 30s\n", "line 16", "sync.gift_wait: 30s must be in [0, 255 intervals] (25.5s)"},
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
