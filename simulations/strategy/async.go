package strategy

import (
	"slices"
	"time"

	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/simulations/sim"
)

// natsOverhead is the framing a NATS message adds on the wire per recipient
// ("MSG <subject> <sid> <size>\r\n" plus the trailing CRLF, subject
// ratelimit.<kind>.<region>): about 40 bytes.
const natsOverhead = 40

// Async is async usage sync without a ledger, the common industry approach:
// each region enforces a local copy of the whole global bucket (rate and
// burst) and, every sync interval, sends the others the cost it admitted per
// key since the last message; a receiver debits that usage from its own copy
// (the copy may go into debt, the most favourable variant: nothing is
// forgotten). Lost messages are not resent. Sync bytes are the exact size of
// the usage deltas in regional/usage's binary Batch encoding, plus NATS framing.
type Async struct {
	env     *sim.Env
	b       []buckets
	pending []map[int]int64 // per region: key -> admitted cost since the last send
	seq     []uint64
	recent  map[int]time.Duration // key -> last time any region sent it
}

func (s *Async) Name() string { return "async" }

func (s *Async) Start(env *sim.Env) error {
	s.env = env
	s.recent = map[int]time.Duration{}
	interval := env.Scenario().Sync.Interval.D()
	for r := 0; r < env.Regions(); r++ {
		s.b = append(s.b, newBuckets(env.Keys()))
		s.pending = append(s.pending, map[int]int64{})
		s.seq = append(s.seq, 0)
		r := r
		var tick func()
		tick = func() {
			s.flush(r)
			env.AgentAfter(r, interval, tick)
		}
		env.AgentAfter(r, interval, tick)
	}
	return nil
}

// StoreReset empties the region's local copies: each starts again full, as
// a bucket does in a Redis that restarted empty (usage not yet sent is
// still sent: the agent kept it).
func (s *Async) StoreReset(region int) { s.b[region] = newBuckets(s.env.Keys()) }

func (s *Async) bucket(region, key int) (*sim.Bucket, int64) {
	ms := s.env.StoreMs(region)
	b := &s.b[region][key]
	if !b.Init {
		k := s.env.Keys()[key]
		b.Start(ms, int64(k.Burst*1000), int64(k.Rate*1000))
	}
	return b, ms
}

func (s *Async) Admit(region, key int, cost int64) bool {
	b, ms := s.bucket(region, key)
	if !b.Take(ms, cost) {
		return false
	}
	s.pending[region][key] += cost
	return true
}

func (s *Async) flush(r int) {
	p := s.pending[r]
	if len(p) == 0 || s.env.Lost(r) {
		clear(p)
		return
	}
	keys := make([]int, 0, len(p))
	for k := range p {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	names := s.env.Keys()
	s.seq[r]++
	batch := usage.Batch{Region: s.env.Scenario().Regions[r].Name, Enforcer: "agent", Seq: s.seq[r]}
	deltas := make([]int64, len(keys))
	for i, k := range keys {
		batch.Deltas = append(batch.Deltas, usage.Delta{Rule: "global", Key: names[k].Name, Admitted: p[k]})
		deltas[i] = p[k]
		s.recent[k] = s.env.Now()
	}
	clear(p)
	size := natsOverhead
	if enc, err := usage.Encode(batch); err == nil {
		size += len(enc)
	}
	for q := 0; q < s.env.Regions(); q++ {
		if q == r {
			continue
		}
		q := q
		s.env.Send(r, q, size, func() {
			for i, k := range keys {
				b, ms := s.bucket(q, k)
				b.Debit(ms, deltas[i])
			}
		})
	}
}

// ActiveKeys counts the keys some region sent usage for in the last interval.
func (s *Async) ActiveKeys() int {
	now, iv := s.env.Now(), s.env.Scenario().Sync.Interval.D()
	n := 0
	for k, t := range s.recent {
		if now-t > 2*iv {
			delete(s.recent, k)
			continue
		}
		n++
	}
	return n
}
