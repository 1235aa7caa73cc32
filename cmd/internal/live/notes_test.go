package live

import (
	"strings"
	"testing"

	"github.com/apportion/apportion/simulations/scenario"
)

// TestSyncNotes: every sync setting the live agents do not get (all but
// interval, lease and witness_lease) is named in the notes when it
// differs from the agent's default, with both values; a scenario on the
// defaults has no such note.
func TestSyncNotes(t *testing.T) {
	sc, err := scenario.Parse("hl", []byte(`name: hl
duration: 10s
regions: [{name: a}, {name: b}]
network: {delay_ms: {a: {b: 50}}}
rule: {rate: 100}
sync: {half_life: 5s, heartbeat: 2s, demand_band: 0.1, gift_band: 0.05, gift_wait: 0s, margin: 0s, clock_error: 0.02,
  registry_poll: 1s, etcd_timeout: 2s, store_timeout: 200ms, interval: 50ms, lease: 2s}
demand:
  - {region: a, shape: constant, level: 1}
`))
	if err != nil {
		t.Fatal(err)
	}
	notes, err := unsupported(sc)
	if err != nil {
		t.Fatal(err)
	}
	all := strings.Join(notes, "\n")
	for _, want := range []string{
		"live ignores sync.half_life (5s): the agents run their default 250ms",
		"live ignores sync.heartbeat (2s): the agents run their default 1s",
		"live ignores sync.demand_band (0.1): the agents run their default 0.25",
		"live ignores sync.gift_band (0.05): the agents run their default 0.02",
		"live ignores sync.gift_wait (0s): the agents run their default 1s",
		"live ignores sync.margin (0s): the agents run their default 500ms",
		"live ignores sync.clock_error (0.02): the agents run their default 0.01",
		"live ignores sync.registry_poll (1s): the agents run their default 500ms",
		"live ignores sync.etcd_timeout (2s): the agents run their default 5s",
		"live ignores sync.store_timeout (200ms): the agents run their default 100ms",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("no note %q in:\n%s", want, all)
		}
	}
	for _, applied := range []string{"sync.interval", "sync.lease", "sync.witness_lease"} {
		if strings.Contains(all, applied) {
			t.Errorf("a note on %s, which live applies:\n%s", applied, all)
		}
	}
	if notes, _ = unsupported(load(t, "shift.yaml")); strings.Contains(strings.Join(notes, "\n"), "live ignores sync.") {
		t.Errorf("shift.yaml, on the agent's defaults, has a sync note:\n%s", strings.Join(notes, "\n"))
	}
}

// TestScaledCostAboveBurst: a scale that leaves a demand's cost above the
// scaled burst is refused saying the run was scaled, and by --max-load.
func TestScaledCostAboveBurst(t *testing.T) {
	sc, err := scenario.Parse("cost", []byte(`name: cost
duration: 10s
regions: [{name: a}]
rule: {rate: 1000}
demand:
  - {region: a, shape: constant, level: 1, cost: 100}
`))
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = Scaled(sc, 0, 1, 0.5)
	if err == nil || !strings.Contains(err.Error(), "scaled x 0.05 to keep the peak offered load at --max-load 0.5") || !strings.Contains(err.Error(), "demand[0].cost: 100 is above rule.burst 50") {
		t.Fatalf("error %v", err)
	}
}
