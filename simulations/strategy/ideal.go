package strategy

import "github.com/apportion/apportion/simulations/sim"

// Ideal is the centralized ideal: one bucket per key that every region asks
// with zero latency, on a perfect clock. It never exceeds burst + rate x W in
// any window W, and it is the reference for utilization and wrong rejections.
type Ideal struct {
	env *sim.Env
	b   buckets
}

func (s *Ideal) Name() string { return "ideal" }

func (s *Ideal) Start(env *sim.Env) error {
	s.env, s.b = env, newBuckets(env.Keys())
	return nil
}

func (s *Ideal) Admit(region, key int, cost int64) bool {
	ms := int64(s.env.Now() / 1e6)
	b := &s.b[key]
	if !b.Init {
		k := s.env.Keys()[key]
		b.Start(ms, int64(k.Burst*1000), int64(k.Rate*1000))
	}
	return b.Take(ms, cost)
}
