package strategy

import (
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/sync/ledger"
)

// Static splits the limit once by weight: each region enforces its floor plus
// its initial part (the ledger's static share, ledger.Split) forever.
type Static struct {
	env   *sim.Env
	units []int64
	total int64
	b     []buckets
}

func (s *Static) Name() string { return "static" }

func (s *Static) Start(env *sim.Env) error {
	s.env = env
	cfg, specs := LedgerConfig(env.Scenario())
	floor, initial := ledger.Split(cfg, specs)
	s.total = cfg.Units
	for r := range floor {
		s.units = append(s.units, floor[r]+initial[r])
		s.b = append(s.b, newBuckets(env.Keys()))
	}
	return nil
}

func (s *Static) Admit(region, key int, cost int64) bool {
	ms := s.env.StoreMs(region)
	b := &s.b[region][key]
	if !b.Init {
		k := s.env.Keys()[key]
		b.Start(ms, k.CapMilli(s.units[region], s.total), k.RateMilli(s.units[region], s.total))
	}
	return b.Take(ms, cost)
}

// StoreReset empties the region's buckets: each starts again full, as a
// bucket does in a Redis that restarted empty.
func (s *Static) StoreReset(region int) { s.b[region] = newBuckets(s.env.Keys()) }

// Share returns the static share.
func (s *Static) Share(region, key int) float64 {
	return float64(s.units[region]) / float64(s.total)
}
