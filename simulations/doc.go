// Package simulations runs the scenarios of simulations/scenarios against
// every strategy (simulations/strategy) in the deterministic simulator
// (simulations/sim) and sweeps one setting to draw a trade-off curve. See
// README.md for the scenario schema, the metrics and the results.
//
// Invariant: Run and Sweep are pure functions of the scenario, the options
// and the seed; the same inputs give byte-identical reports.
package simulations

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/simulations/strategy"
)

// Run simulates sc with every strategy.
func Run(ctx context.Context, sc *scenario.Scenario, opt sim.Options) (*sim.Result, error) {
	return sim.Run(ctx, sc, strategy.All(), opt)
}

// Params are the settings Sweep can vary.
var Params = []string{"rtt", "interval", "lease", "half-life"}

// Point is one run of a sweep.
type Point struct {
	Param  string      `json:"param"`
	Value  string      `json:"value"`
	X      float64     `json:"x"` // value in ms (rtt: the scale factor of the delay matrix)
	Result *sim.Result `json:"result"`
}

// Apply returns a copy of sc with param set to value: rtt scales the delay
// matrix by a factor (e.g. 0.5, 1, 2) or sets every delay to a duration
// (e.g. 50ms: one-way); interval, lease and half-life (of the ledger's
// demand estimate) take durations.
func Apply(sc *scenario.Scenario, param, value string) (*scenario.Scenario, float64, error) {
	c := *sc
	var x float64
	switch param {
	case "rtt":
		dm := map[string]map[string]float64{}
		if d, err := time.ParseDuration(value); err == nil {
			ms := float64(d) / 1e6
			for i, a := range sc.Regions {
				dm[a.Name] = map[string]float64{}
				for _, b := range sc.Regions[i+1:] {
					dm[a.Name][b.Name] = ms / 2
				}
			}
			x = ms
		} else if f, err := strconv.ParseFloat(value, 64); err == nil && f >= 0 && !math.IsInf(f, 0) {
			for a, row := range sc.Network.DelayMs {
				dm[a] = map[string]float64{}
				for b, v := range row {
					dm[a][b] = v * f
				}
			}
			x = f
		} else {
			return nil, 0, fmt.Errorf("simulations: rtt value %q: want a finite factor >= 0 (0.5) or a round-trip duration (100ms)", value)
		}
		c.Network.DelayMs = dm
	case "interval", "lease", "half-life":
		d, err := time.ParseDuration(value)
		switch {
		case err != nil:
			return nil, 0, fmt.Errorf("simulations: %s value %q: want a duration such as 250ms", param, value)
		case d < 0 && param == "half-life":
			return nil, 0, fmt.Errorf("simulations: half-life value %q: must not be negative (0s: the newest interval only)", value)
		case d <= 0 && param != "half-life":
			return nil, 0, fmt.Errorf("simulations: %s value %q: must be above 0", param, value)
		}
		switch param {
		case "interval":
			c.Sync.Interval = scenario.Duration(d)
		case "lease":
			c.Sync.Lease = scenario.Duration(d)
		default:
			h := scenario.Duration(d)
			c.Sync.HalfLife = &h
		}
		x = float64(d) / 1e6
	default:
		return nil, 0, fmt.Errorf("simulations: unknown parameter %q (%s)", param, strings.Join(Params, ", "))
	}
	if err := c.Validate(); err != nil {
		return nil, 0, fmt.Errorf("simulations: %s=%s: %w", param, value, err)
	}
	return &c, x, nil
}

// Sweep runs sc once per value of param.
func Sweep(ctx context.Context, sc *scenario.Scenario, param string, values []string, opt sim.Options) ([]Point, error) {
	var out []Point
	for _, v := range values {
		c, x, err := Apply(sc, param, v)
		if err != nil {
			return nil, err
		}
		res, err := Run(ctx, c, opt)
		if err != nil {
			return nil, err
		}
		out = append(out, Point{Param: param, Value: v, X: x, Result: res})
	}
	return out, nil
}
