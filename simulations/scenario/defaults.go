package scenario

import (
	"time"
)

func fptr(v float64) *float64 { return &v }

func (sc *Scenario) defaults() {
	if sc.Seed == 0 {
		sc.Seed = 1
	}
	if sc.Sample == 0 {
		sc.Sample = Duration(time.Second)
	}
	if sc.Rule.Window > 0 && sc.Rule.Rate == 0 && sc.Rule.Burst > 0 {
		sc.Rule.Rate = sc.Rule.Burst / sc.Rule.Window.D().Seconds()
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
