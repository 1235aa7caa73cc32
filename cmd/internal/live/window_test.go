package live

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
)

// windowScenario is a per-window quota: 50 requests per 10 s.
func windowScenario(t *testing.T) *scenario.Scenario {
	t.Helper()
	return parseScenario(t, `name: quota
duration: 30s
regions: [{name: a}, {name: b}]
network: {delay_ms: {a: {b: 50}}}
rule: {burst: 50, window: 10s}
demand:
  - {region: a, shape: constant, level: 1}
`)
}

// parseScenario parses a scenario written in the test.
func parseScenario(t *testing.T, yaml string) *scenario.Scenario {
	t.Helper()
	sc, err := scenario.Parse("quota", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	return sc
}

// TestRulesYAMLWindow: a scenario with rule.window is loaded live as the
// global fixed window the simulator models (it was once a token bucket of
// capacity burst refilled at burst / window).
func TestRulesYAMLWindow(t *testing.T) {
	sc := windowScenario(t)
	rs, err := rules.ParseRules(rulesYAML(sc))
	if err != nil {
		t.Fatalf("%v\n%s", err, rulesYAML(sc))
	}
	want := sc.Rule.StoreRule()
	if len(rs) != 1 || rs[0].Algorithm != rules.FixedWindow || rs[0].Limit != 50 || rs[0].Window != want.Window || rs[0].Scope != rules.Global {
		t.Fatalf("rules %+v, want a global fixed_window of 50 per 10s", rs)
	}
	sc.Rule.Window = 0
	if rs, err = rules.ParseRules(rulesYAML(sc)); err != nil || rs[0].Algorithm != rules.TokenBucket || rs[0].Capacity != 50 {
		t.Fatalf("without a window: %+v, %v; want a token bucket of 50", rs, err)
	}
}

// TestScoreWindowMax: the live column's WindowMax is the most admitted
// for one key in one window of the stores' clock (windows of the Unix
// epoch), not 0.
func TestScoreWindowMax(t *testing.T) {
	sc := windowScenario(t)
	start := time.UnixMilli(1_000_000_000_000 + 7_000) // 7 s into a 10 s window
	var reqs []request
	var dec []decision
	add := func(at time.Duration, n int) {
		for range n {
			reqs = append(reqs, request{at: at, cost: 1})
			dec = append(dec, decision{sent: at, recv: at + time.Millisecond, allowed: true})
		}
	}
	add(time.Second, 30)   // window 0 of the epoch's: 30
	add(4*time.Second, 40) // the next window (7 s + 4 s = 11 s): 40
	add(12*time.Second, 5) // still it (19 s): 45
	vres := &sim.Result{Demand: make([]float64, 30), Strategies: []sim.StrategyResult{{Name: "ideal", Admitted: 75}}}
	var info Info
	sr := score(sc, vres, reqs, []string{"k"}, &replayed{dec: dec, start: start}, &info)
	if sr.WindowMax != 45 || sr.Admitted != 75 {
		t.Fatalf("window max %d, admitted %d; want 45 of 75", sr.WindowMax, sr.Admitted)
	}
	sc.Rule.Window = 0
	if sr = score(sc, vres, reqs, []string{"k"}, &replayed{dec: dec, start: start}, &info); sr.WindowMax != 0 {
		t.Fatalf("token bucket: window max %d, want 0", sr.WindowMax)
	}
}

// A quota of 50 requests per 5 s played live for 20 s, 30 requests/s
// offered (150 per window): the real stores enforce the global fixed
// window (once played as a token bucket, which admitted 78 in a 10 s
// window of 50 while the quota line read "live 0"): the most admitted
// in one window is the limit, give or take a request sent just before a
// window's end and decided in the next, and live admits what the
// simulator's ledger does within UtilizationTolerance.
func TestLiveWindow(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts two regions and plays 20 s of load")
	}
	testutil.RedisServerPath(t)
	sc := parseScenario(t, `name: quota
duration: 20s
regions: [{name: a}, {name: b}]
network: {delay_ms: {a: {b: 30}}}
rule: {burst: 50, window: 5s}
demand:
  - {region: a, shape: constant, level: 2, arrivals: uniform}
  - {region: b, shape: constant, level: 1, arrivals: uniform}
`)
	res := runTwoRegions(t, sc, Options{})
	live, ledger := res.Strategies[2], res.Strategies[1]
	if live.WindowMax < 45 || live.WindowMax > 52 {
		t.Errorf("live admitted at most %d in one window, want the quota's 50 (45 to 52)", live.WindowMax)
	}
	if d := math.Abs(live.Utilization - ledger.Utilization); d > UtilizationTolerance {
		t.Errorf("live utilization %.2f%%, simulated ledger %.2f%%", 100*live.Utilization, 100*ledger.Utilization)
	}
	if !strings.Contains(res.Table(), "quota 50 per 5s: most admitted in one window: ideal 50, ledger 50, live ") {
		t.Errorf("no quota line:\n%s", res.Table())
	}
}
