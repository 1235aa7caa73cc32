package strategy

import "github.com/apportion/apportion/simulations/sim"

// Independent has no coordination: every region enforces the full limit, so
// n regions can admit up to n times it.
type Independent struct {
	env *sim.Env
	b   []buckets
}

func (s *Independent) Name() string { return "independent" }

func (s *Independent) Start(env *sim.Env) error {
	s.env = env
	for r := 0; r < env.Regions(); r++ {
		s.b = append(s.b, newBuckets(env.Keys()))
	}
	return nil
}

func (s *Independent) Admit(region, key int, cost int64) bool {
	ms := s.env.StoreMs(region)
	b := &s.b[region][key]
	if !b.Init {
		k := s.env.Keys()[key]
		b.Start(ms, int64(k.Burst*1000), int64(k.Rate*1000))
	}
	return b.Take(ms, cost)
}
