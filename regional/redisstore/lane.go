package redisstore

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Lanes. A lane is one way to Redis: a queue, its workers, and what the
// store knows of the Redis at its end (when it last answered, its round
// trip, the scripts in flight). A standalone Redis has one, the store's
// main lane. A Redis Cluster has one per master besides (a failure domain:
// Domain), made when a key of that master is first seen, whose pipelines
// go to the master's own go-redis client: a master that is killed, stopped
// or slow fails and holds only the calls of its own keys, while the other
// masters' calls neither wait behind it in a pipeline nor in a queue, and
// their silence is told apart (each lane hears its own master, through the
// Activity's record of that address). The main lane then carries only the
// keys whose master the client does not know yet (no slot map), through
// the Cluster client. A lane of an address that stops being a master (a
// failover) keeps its idle workers.

// lane is one way to Redis (see above).
type lane struct {
	id     int                          // its index in laneSet.all (Domain); the main lane's is 0
	addr   string                       // its master's address; "" for the main lane
	client atomic.Pointer[redis.Client] // its master's go-redis client; nil for the main lane
	node   *nodeActivity                // the Activity's record of addr; nil: the whole Activity's
	queue  chan *call
	queued atomic.Int64 // calls waiting for a worker (Load)
	// roundTrip is the moving average of a pipeline's round trip, ns (Load).
	roundTrip  atomic.Int64
	lastAnswer atomic.Int64   // unix ns when a pipeline last got a reply from Redis
	inflight   atomic.Int64   // scripts sent and not yet answered
	perScript  atomic.Int64   // ns: Redis time per script in flight, a moving average
	busy       []atomic.Int64 // per worker: unix ns when its pipeline in flight was sent; 0 when idle
	scripts    []atomic.Int64 // per worker: the script calls of its pipeline in flight (set while busy)
}

// laneSet is a Cluster store's lanes, replaced whole when one is added.
type laneSet struct {
	all    []*lane          // by id; all[0] is the main lane
	byAddr map[string]*lane // the masters' lanes by address
}

// noMapRetry is how long a Cluster store sends every key to its main lane
// after a lookup found no slot map.
const noMapRetry = 100 * time.Millisecond

// noWait is a context already done: looking up a key's master never waits
// for the slot map (without one, the key goes to the main lane).
var noWait = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// laneFor is the lane of key: the main lane for a standalone Redis, and on
// a Cluster the lane of the master the client's slot map has for key's
// slot (the main lane while it has no slot map: the main lane's Cluster
// client loads one; meanwhile a lookup is tried at most every noMapRetry).
func (s *Store) laneFor(key string) *lane {
	if s.cluster == nil {
		return &s.main
	}
	if t := s.noMap.Load(); t != 0 && time.Now().UnixNano()-t < int64(noMapRetry) {
		return &s.main
	}
	cl, err := s.cluster.MasterForKey(noWait, key)
	if err != nil || cl == nil {
		s.noMap.Store(time.Now().UnixNano())
		return &s.main
	}
	if s.noMap.Load() != 0 {
		s.noMap.Store(0)
	}
	addr := cl.Options().Addr
	l := s.lanes.Load().byAddr[addr]
	if l == nil {
		if l = s.addLane(addr); l == nil {
			return &s.main // closed
		}
	}
	if l.client.Load() != cl {
		l.client.Store(cl) // the client of a master seen again may be a new one
	}
	return l
}

// addLane makes the lane of the master at addr and starts its workers; nil
// once the store is closed.
func (s *Store) addLane(addr string) *lane {
	s.laneMu.Lock()
	defer s.laneMu.Unlock()
	set := s.lanes.Load()
	if l := set.byAddr[addr]; l != nil {
		return l
	}
	select {
	case <-s.done:
		return nil
	default:
	}
	l := &lane{id: len(set.all), addr: addr, queue: make(chan *call, s.opts.batch*s.opts.workers),
		busy: make([]atomic.Int64, s.opts.workers), scripts: make([]atomic.Int64, s.opts.workers)}
	if a := s.opts.activity; a != nil {
		l.node = a.node(addr)
	}
	next := &laneSet{all: append(slices.Clip(set.all), l), byAddr: maps.Clone(set.byAddr)}
	next.byAddr[addr] = l
	s.lanes.Store(next)
	s.wg.Add(len(l.busy))
	for i := range l.busy {
		go s.worker(l, i)
	}
	return l
}

// lanesOf is the lane of calls' first call with buckets, and whether some
// other call has another lane (a Cluster Do over several masters).
func (s *Store) lanesOf(calls []Call) (first *lane, split bool) {
	for _, cl := range calls {
		if len(cl.Buckets) == 0 {
			continue
		}
		l := s.laneFor(cl.Buckets[0].Key)
		switch {
		case first == nil:
			first = l
		case l != first:
			return first, true
		}
	}
	if first == nil {
		first = &s.main
	}
	return first, false
}

// doLanes is Do for calls over several lanes: each lane's calls are one
// call of their own, sent and waited for concurrently with the others.
func (s *Store) doLanes(ctx context.Context, b Budget, calls []Call, out []Answer, start time.Time, now any, nowErr error) {
	var lanes []*lane
	var idx [][]int
	var none []int // calls without buckets: answered by prepare, with the first lane's
	for i, cl := range calls {
		if len(cl.Buckets) == 0 {
			none = append(none, i)
			continue
		}
		l := s.laneFor(cl.Buckets[0].Key)
		k := slices.Index(lanes, l)
		if k < 0 {
			k = len(lanes)
			lanes, idx = append(lanes, l), append(idx, nil)
		}
		idx[k] = append(idx[k], i)
	}
	idx[0] = append(idx[0], none...)
	var wg sync.WaitGroup
	for k, l := range lanes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := getCall(ctx, b, len(idx[k]))
			c.lane = l
			if s.prepare(c, calls, out, idx[k], now, nowErr) {
				s.send(ctx, b, c, calls, out, start)
			}
		}()
	}
	wg.Wait()
}

// pipeClient is the client l's pipelines go through: its master's, or the
// store's.
func (s *Store) pipeClient(l *lane) piper {
	if l != &s.main {
		if cl := l.client.Load(); cl != nil {
			return cl
		}
	}
	return s.client
}

// Partitioned reports whether the store's keys fall in failure domains of
// their own (Domain): true for a Redis Cluster, whose masters fail apart;
// false for a standalone Redis, one domain.
func (s *Store) Partitioned() bool { return s.cluster != nil }

// Domain is the failure domain of key, a small integer: 0 for a standalone
// Redis; on a Cluster the master that the client's slot map has for key's
// slot now (0: none yet). A master keeps its number for the store's life;
// a replica promoted in its place has a new one. Calls of one domain never
// wait behind another's (see lane.go), and its Redis is heard apart
// (DomainLoad).
func (s *Store) Domain(key string) int { return s.laneFor(key).id }

// DomainLoad is Load of domain d alone (Load for an unknown d).
func (s *Store) DomainLoad(d int) Load {
	if set := s.lanes.Load(); set != nil && d >= 0 && d < len(set.all) {
		return s.loadOf(set.all[d])
	}
	return s.Load()
}

// DomainName is domain d's master's address ("" for domain 0 and an
// unknown d).
func (s *Store) DomainName(d int) string {
	if set := s.lanes.Load(); set != nil && d >= 0 && d < len(set.all) {
		return set.all[d].addr
	}
	return ""
}

// isRedirect reports a Cluster master's answer that a call of n items
// (one script call) belongs elsewhere, or must be tried again elsewhere:
// MOVED or ASK (the slot moved, or is moving and the keys are not here),
// or TRYAGAIN for a multi-call script call (n > 1: the keys of some calls
// of a half-migrated slot are here and those of others are not; each call
// alone may well succeed, here or, by ASK, on the slot's new master). The
// script did not run.
func isRedirect(err error, n int) bool {
	return isReply(err) && (redis.HasErrorPrefix(err, "MOVED") || redis.HasErrorPrefix(err, "ASK") ||
		(n > 1 && redis.HasErrorPrefix(err, "TRYAGAIN")))
}

// noRetry is a command the Cluster client's pipeline does not send again
// after an error (it still follows MOVED and ASK): a TRYAGAIN answers its
// call at once, by the failure policy, instead of after the client's
// backoffs, and a script whose reply was lost is not run twice.
type noRetry struct{ *redis.IntSliceCmd }

// NoRetry implements redis.Cmder.
func (noRetry) NoRetry() bool { return true }

// redirect sends the n items of batch marked redo again, one check script
// call each, through the Cluster client (which follows MOVED and ASK),
// and then signals their calls; the other calls of batch are signaled at
// once, so that a slot that moves holds only its own calls. It runs in
// the background: l's worker goes on to its next pipeline.
func (s *Store) redirect(l *lane, batch []*call, n int, deadline time.Time, bounded bool) {
	items := make([]*item, 0, n)
	var waiting []*call
	for _, c := range batch {
		mine := false
		for i := range c.items {
			if it := &c.items[i]; it.redo {
				it.redo = false
				items = append(items, it)
				mine = true
			}
		}
		if mine {
			waiting = append(waiting, c)
		} else {
			c.done <- struct{}{} // the last touch of c (see call)
		}
	}
	s.wg.Add(1) // while this worker runs: never from zero
	go func() {
		defer s.wg.Done()
		ctx, cancel := s.ctx, context.CancelFunc(func() {})
		if bounded {
			ctx, cancel = context.WithDeadline(s.ctx, deadline)
		}
		defer cancel()
		sent := time.Now()
		cmds := make([]*redis.IntSliceCmd, len(items))
		s.scriptPipeline(ctx, nil, s.client, len(items), func(i int) redis.Cmder {
			cmds[i] = redis.NewIntSliceCmd(ctx, items[i].args...)
			cmds[i].SetFirstKeyPos(3)
			return noRetry{cmds[i]}
		}, s.check)
		for i, it := range items {
			val, err := cmds[i].Val(), cmds[i].Err()
			switch {
			case err == nil:
			case ctx.Err() != nil || isTimeout(err):
				err = s.late(l, sent, time.Since(sent), err)
			case !isReply(err) && isParseError(err):
				err = fmt.Errorf("%w: %w", ErrBadReply, err)
			}
			it.val, it.err = val, err
		}
		for _, c := range waiting {
			c.done <- struct{}{} // the last touch of c (see call)
		}
	}()
}
