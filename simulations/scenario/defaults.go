package scenario

import (
	"time"

	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
)

func fptr(v float64) *float64 { return &v }

// defaults fills in what the file leaves out; set reports whether the file
// gives a field (a dotted path; nil: none), for a field whose 0 is a value
// of its own (sync.margin). Every other zero is the default: Parse refuses
// an explicit 0 where it is not a value (Scenario.checkWritten).
func (sc *Scenario) defaults(set func(path string) bool) {
	if set == nil {
		set = func(string) bool { return false }
	}
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
	lc := ledger.DefaultConfig()
	if s.Interval == 0 {
		s.Interval = Duration(driver.DefaultInterval)
	}
	if s.Lease == 0 {
		s.Lease = Duration(lc.Lease)
	}
	if s.ClockError == nil {
		s.ClockError = fptr(lc.Rho)
	}
	if s.Margin == 0 && !set("sync.margin") {
		s.Margin = Duration(lc.Margin)
	}
	if s.StoreTimeout == 0 {
		s.StoreTimeout = Duration(lc.StoreTimeout)
	}
	if s.RegistryPoll == 0 {
		s.RegistryPoll = Duration(driver.DefaultRegistryPoll)
	}
	if s.EtcdTimeout == 0 {
		s.EtcdTimeout = Duration(driver.DefaultEtcdTimeout)
	}
	if s.StoreMs == nil {
		s.StoreMs = fptr(1)
	}
	if s.HalfLife == nil {
		h := Duration(lc.HalfLife)
		s.HalfLife = &h
	}
	if s.Heartbeat == nil {
		h := Duration(lc.HeartbeatEvery)
		s.Heartbeat = &h
	}
	if s.DemandBand == nil {
		s.DemandBand = fptr(lc.DemandBand)
	}
	if s.GiftBand == nil {
		s.GiftBand = fptr(lc.GiftBand)
	}
	if s.GiftWait == nil {
		w := Duration(lc.GiftWait)
		s.GiftWait = &w
	}
	if s.WitnessLease == nil {
		w := Duration(driver.DefaultWitnessLease)
		s.WitnessLease = &w
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
