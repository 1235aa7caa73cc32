package sim

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/simulations/scenario"
)

// admitAll admits every request.
type admitAll struct{}

func (admitAll) Name() string                           { return "all" }
func (admitAll) Start(*Env) error                       { return nil }
func (admitAll) Admit(region, key int, cost int64) bool { return true }

// TestPartialLastSample: the rates of the last sample of a run whose
// duration is not a multiple of the sample period are its cost over the
// time it covers, not over the whole period: 100 requests/s evenly spaced
// read about 100/s in every sample (the last covers 0.5 s of 2.5 s, or
// 2 s of 30 s with a 7 s sample), not half of it or less.
func TestPartialLastSample(t *testing.T) {
	for _, c := range []struct {
		duration, sample string
		samples          int
	}{{"2500ms", "1s", 3}, {"30s", "7s", 5}, {"30s", "1h", 1}} {
		t.Run(c.duration+"/"+c.sample, func(t *testing.T) {
			sc, err := scenario.Parse("series", []byte(`
name: series
duration: `+c.duration+`
sample: `+c.sample+`
regions: [{name: a}]
rule: {rate: 100}
demand: [{region: a, level: 1, arrivals: uniform}]
`))
			if err != nil {
				t.Fatal(err)
			}
			res, err := Run(context.Background(), sc, []Strategy{admitAll{}}, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Demand) != c.samples {
				t.Fatalf("%d samples, want %d", len(res.Demand), c.samples)
			}
			for i, v := range res.Demand {
				if a := res.Strategies[0].AdmittedRate[i]; math.Abs(v-100) > 3 || a != v {
					t.Errorf("sample %d: demand %v/s, admitted %v/s, want 100/s both", i, v, a)
				}
			}
		})
	}
}

// TestRunRefusesARunawayRun: a run of more requests than the simulator
// can hold is refused before it starts (scenario.CheckSize), naming the
// field to lower, rather than running for minutes and out of memory.
func TestRunRefusesARunawayRun(t *testing.T) {
	sc, err := scenario.Parse("big.yaml", []byte(`
name: big
duration: 60s
regions: [{name: a}]
rule: {rate: 200000}
demand: [{region: a, level: 1.5}]
`))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	_, err = Run(ctx, sc, []Strategy{admitAll{}}, Options{})
	if !errors.Is(err, scenario.ErrInvalid) || !strings.Contains(err.Error(), "big.yaml: line 5: rule.rate: 200000/s at the demand's peak levels offers up to 1.8e+07 requests in a minute") {
		t.Fatalf("Run = %v after %v, want a refusal naming rule.rate", err, time.Since(start))
	}
	// --duration shortens it enough.
	if _, err := Run(ctx, sc, []Strategy{admitAll{}}, Options{Duration: time.Second}); err != nil {
		t.Fatal(err)
	}
}
