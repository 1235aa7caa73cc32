package live

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/simulations/scenario"
)

const scenarios = "../scenarios/"

// UtilizationTolerance is how far live utilization may be from the
// simulator's ledger, in fractions of the ideal (see simulations/README.md,
// "rlsim live": measured differences were within 3 points).
const UtilizationTolerance = 0.05

func load(t *testing.T, name string) *scenario.Scenario {
	t.Helper()
	sc, err := scenario.Load(scenarios + name)
	if err != nil {
		t.Fatal(err)
	}
	return sc
}

func TestScaled(t *testing.T) {
	sc := load(t, "shift.yaml")
	c, f, err := Scaled(sc, 160*time.Second, 4, 400)
	if err != nil {
		t.Fatal(err)
	}
	if c.Duration.D() != 40*time.Second {
		t.Errorf("duration %v, want 40s", c.Duration.D())
	}
	if got := c.Demand[1].Steps[1].At.D(); got != 15*time.Second {
		t.Errorf("us-west's first shift at %v, want 15s", got)
	}
	if math.Abs(f-400.0/900) > 1e-9 || math.Abs(c.Rule.Rate-1000*f) > 1e-9 || c.Rule.Burst != math.Floor(1000*f) {
		t.Errorf("factor %v rate %v burst %v", f, c.Rule.Rate, c.Rule.Burst)
	}
	if p := PeakLoad(c); math.Abs(p-400) > 1e-6 {
		t.Errorf("peak load %v, want 400", p)
	}
	if sc.Duration.D() != 20*time.Minute || sc.Rule.Rate != 1000 || sc.Demand[1].Steps[1].At.D() != time.Minute {
		t.Error("Scaled changed its input")
	}
	if _, _, err := Scaled(sc, 0, 0, 0); err == nil {
		t.Error("speed 0 accepted")
	}
}

func TestEventsRefused(t *testing.T) {
	_, err := Run(context.Background(), load(t, "partition.yaml"), Options{})
	if !errors.Is(err, ErrUnsupported) {
		t.Fatalf("partition: %v, want ErrUnsupported", err)
	}
}

// The first 160 s of shift.yaml at 4x speed (40 s, three demand shifts)
// and 400 requests/s, on the real stack: the enforcers never admit more
// than the global bound beyond what the test's own clock can explain, and
// their utilization matches the simulator's ledger within
// UtilizationTolerance.
func TestLiveShift(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack and plays 40 s of load")
	}
	testutil.RedisServerPath(t)
	sc := load(t, "shift.yaml")
	res, err := Run(context.Background(), sc, Options{Duration: 160 * time.Second, Speed: 4, MaxLoad: 400})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", res.Table())
	if len(res.Strategies) != 3 || res.Strategies[2].Name != "live" || res.Strategies[1].Name != "ledger" {
		t.Fatalf("strategies %v", res.Strategies)
	}
	if res.Live.Errors > 0 {
		t.Fatalf("%d calls failed, first: %s", res.Live.Errors, res.Live.FirstError)
	}
	if res.Live.Requests < 15000 {
		t.Fatalf("%d requests, want about 16,000", res.Live.Requests)
	}
	live, ledger := res.Strategies[2], res.Strategies[1]
	tol := res.Live.Tolerance()
	for k, o := range live.Overshoot {
		if o > tol[k] {
			t.Errorf("live overshoot %+.2f%% over %v, above the clock's tolerance %+.2f%%", 100*o, res.WindowsS[k], 100*tol[k])
		}
	}
	if d := math.Abs(live.Utilization - ledger.Utilization); d > UtilizationTolerance {
		t.Errorf("live utilization %.2f%%, simulated ledger %.2f%%: %.1f points apart, tolerance %.0f",
			100*live.Utilization, 100*ledger.Utilization, 100*d, 100*UtilizationTolerance)
	}
	if !strings.Contains(res.Table(), "scale 0.4444") {
		t.Error("the table does not say the run was scaled")
	}
}
