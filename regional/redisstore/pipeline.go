package redisstore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// decide tells a waiting caller whether to give up, and else when to look
// again (0: never). A call queued past b.Queue fails with ErrQueueTimeout
// (never sent). A sent call fails with ErrTimeout when Redis has answered
// nothing, to anyone, for b.RoundTrip since it was sent: Redis is down or
// stalled. While Redis keeps answering other pipelines the call is behind
// this process's own backlog in Redis: that is overload, not a store
// failure, and the call may wait until b.Queue + b.RoundTrip has passed
// since Do began, then fails with ErrQueueTimeout.
//
// Redis is the Redis of c's lane: on a Cluster, the master of c's keys.
func (s *Store) decide(c *call, b Budget, start time.Time) (time.Duration, error) {
	l := c.lane
	if l == nil {
		l = &s.main
	}
	el := time.Since(start)
	if c.state.Load() == callQueued {
		// Queued behind workers that wait on a silent Redis: the store
		// has failed, whatever the queue budget says.
		if b.RoundTrip > 0 {
			if silent, since := s.workerSilence(l); since != 0 && s.redisSilent(l, max(since, s.answered(l)), b.RoundTrip) {
				if c.state.CompareAndSwap(callQueued, callAbandoned) {
					l.queued.Add(-1)
					return 0, fmt.Errorf("%w: queued behind pipelines Redis has not answered for %v", ErrTimeout, silent.Round(time.Millisecond))
				}
			}
		}
		if el < b.Queue {
			return s.decideNext(c, b, start), nil
		}
		if c.state.CompareAndSwap(callQueued, callAbandoned) {
			l.queued.Add(-1)
			return 0, ErrQueueTimeout
		}
	}
	if b.RoundTrip <= 0 {
		return 0, nil
	}
	sent := c.sent.Load()
	if sent == 0 { // taken, about to be sent
		return b.RoundTrip, nil
	}
	if !s.written(l, sent) {
		// Taken, and no write to Redis completed (nor dial begun)
		// since: the worker waits for a CPU before or in its write. Not
		// in Redis yet: this process's delay, bounded as a queued call is.
		if el >= b.Queue+b.RoundTrip {
			return 0, fmt.Errorf("%w: not written to Redis after %v", ErrQueueTimeout, el.Round(time.Millisecond))
		}
		return min(b.RoundTrip, b.Queue+b.RoundTrip-el), nil
	}
	inRedis := time.Since(time.Unix(0, sent))
	if inRedis < b.RoundTrip {
		return b.RoundTrip - inRedis, nil
	}
	lag := s.lag.current()
	from := max(sent, s.answered(l))
	if s.redisSilent(l, from, b.RoundTrip) {
		return 0, fmt.Errorf("%w: no answer from Redis for %v (this process's network lag %v)", ErrTimeout, time.Since(time.Unix(0, from)).Round(time.Millisecond), lag.Round(time.Millisecond))
	}
	if el >= b.Queue+b.RoundTrip {
		return 0, fmt.Errorf("%w: still behind this process's backlog in Redis after %v", ErrQueueTimeout, el.Round(time.Millisecond))
	}
	return min(b.RoundTrip, b.Queue+b.RoundTrip-el), nil
}

// workerSilence is how long l's Redis has answered nothing while some
// worker of l waits on it (since != 0), measured from the oldest pipeline
// in flight.
func (s *Store) workerSilence(l *lane) (silent time.Duration, since int64) {
	for i := range l.busy {
		if t := l.busy[i].Load(); t != 0 && (since == 0 || t < since) {
			since = t
		}
	}
	if since == 0 {
		return 0, 0
	}
	return time.Since(time.Unix(0, max(since, s.answered(l)))), since
}

// allowance is how long Redis may stay silent before a check blames it:
// the round-trip budget, plus 5x this process's network lag, plus twice the
// time Redis needs for the scripts this process has in Redis (Redis runs
// them one after another and writes the replies of one event-loop turn
// together, so a burst of our own makes Redis silent for that long).
func (s *Store) allowance(l *lane, rt time.Duration) time.Duration {
	return rt + lagFactor*s.lag.current() + 2*time.Duration(s.inRedis(l)*l.perScript.Load())
}

// inRedis is how many script calls of l's pipelines in flight Redis may be
// running: with an Activity, those of the workers whose pipeline's script
// calls have been written since it was sent (Activity.scripts). A worker
// still getting a connection (dialing, or in the handshake of a new one:
// its HELLO written, Redis silent) has put no script in Redis, and Redis's
// silence towards it is Redis's own, not the time our scripts take.
// Without an Activity: every script call in flight.
func (s *Store) inRedis(l *lane) int64 {
	a := s.opts.activity
	if a == nil {
		return l.inflight.Load()
	}
	w := a.scripts.Load()
	if l.node != nil {
		w = l.node.scripts.Load()
	}
	var n int64
	for i := range l.busy {
		if t := l.busy[i].Load(); t != 0 && w >= t {
			n += l.scripts[i].Load()
		}
	}
	return n
}

// dialedSince reports a dial to l's Redis begun at or after t (unix ns):
// a pipeline sent at t may have waited for a new connection.
func (s *Store) dialedSince(l *lane, t int64) bool {
	a := s.opts.activity
	if a == nil {
		return false
	}
	if l.node != nil {
		return l.node.dialed.Load() >= t
	}
	return a.dialed.Load() >= t
}

// lagFactor scales the measured lag into the silence a check forgives:
// replies wait for the process (the lag) and Redis waits for the same busy
// CPUs; measured on a 2-core machine at load 15, a healthy Redis was silent
// for up to about 3.5 x the lag.
const lagFactor = 5

// decideNext is when a queued call looks again: at its queue budget, or
// sooner to watch the round trip once it has been taken.
func (s *Store) decideNext(c *call, b Budget, start time.Time) time.Duration {
	next := b.Queue - time.Since(start)
	if b.RoundTrip > 0 && b.RoundTrip < next {
		next = b.RoundTrip
	}
	return max(next, time.Microsecond)
}

// worker takes a call from l, yields once, drains l's pending calls up to
// the batch size (in script calls) and sends them in one pipeline. The
// batch belongs to this goroutine.
func (s *Store) worker(l *lane, w int) {
	defer s.wg.Done()
	busy := &l.busy[w]
	batch := make([]*call, 0, s.opts.batch)
	var sc scratch
	for {
		select {
		case <-s.done:
			return
		case c := <-l.queue:
			batch = batch[:0]
			n := 0
			if s.take(l, c) {
				batch, n = append(batch, c), len(c.items)
			}
			// Let the goroutines that are runnable now (handlers of
			// requests that arrived together) queue their calls first:
			// they join this pipeline instead of each sending its own
			// round trip. With nothing else runnable this returns at once.
			runtime.Gosched()
		drain:
			for n < s.opts.batch {
				select {
				case c := <-l.queue:
					if s.take(l, c) {
						batch, n = append(batch, c), n+len(c.items)
					}
				default:
					break drain
				}
			}
			if len(batch) > 0 {
				l.scripts[w].Store(int64(n))
				busy.Store(time.Now().UnixNano())
				s.run(l, batch, &sc)
				busy.Store(0)
			}
			clear(batch)
		}
	}
}

// take claims c, queued on l, for this worker; false when its caller has
// given up.
func (s *Store) take(l *lane, c *call) bool {
	if !c.state.CompareAndSwap(callQueued, callTaken) {
		return false
	}
	l.queued.Add(-1)
	if c.ctx.Err() != nil {
		c.done <- struct{}{} // the caller is gone (and may read it: see call)
		return false
	}
	return true
}

// scratch is a worker's buffers for its pipelines, reused from one to the
// next (run and scriptPipeline: fewer allocations per check); nil for a
// one-off pipeline.
type scratch struct {
	its    []*item
	units  []int
	cmds   []*redis.IntSliceCmd
	sent   []redis.Cmder
	idx    []int
	pipe   redis.Pipeliner
	pipeOf piper // the client pipe belongs to
}

// piper is a go-redis client that makes pipelines: the store's client, or
// a Cluster master's own (a lane's). Both are redis.Scripter too (load).
type piper interface{ Pipeline() redis.Pipeliner }

// run executes one batch of l in one pipeline. Its context ends at the latest of
// the calls' ends, each call ending at its caller's deadline or when its
// whole budget (Queue + 2 x RoundTrip) has passed since the send, whichever
// is first (or at Close when a call has neither): the callers decide what a
// late answer means (see Do); this only bounds how long a dead Redis holds
// a worker.
//
// On a Cluster master's lane the pipeline goes to that master's own client
// (no redirection, no retry: a master that fails holds no other master's
// calls); the calls it answers MOVED or ASK, and those of a multi-call
// script call it answers TRYAGAIN (a slot half migrated), are sent again
// through the Cluster client, which follows the redirection (redirect),
// and only their callers wait for that.
func (s *Store) run(l *lane, batch []*call, sc *scratch) {
	sent := time.Now()
	var deadline time.Time
	bounded := true
	n := 0
	for _, c := range batch {
		c.sent.Store(sent.UnixNano())
		n += len(c.items)
		end, ok := c.ctx.Deadline()
		if c.budget.RoundTrip > 0 {
			if rt := sent.Add(max(c.budget.Queue, 0) + 2*c.budget.RoundTrip); !ok || rt.Before(end) {
				end, ok = rt, true
			}
		}
		if !ok {
			bounded = false
		} else if end.After(deadline) {
			deadline = end
		}
	}
	ctx, cancel := s.ctx, context.CancelFunc(func() {})
	if bounded {
		ctx, cancel = context.WithDeadline(s.ctx, deadline)
	}
	defer cancel()

	s.pipelines.Add(1)
	s.batched.Add(uint64(n))
	ahead := l.inflight.Add(int64(n)) // scripts in Redis, this pipeline's included
	defer l.inflight.Add(-int64(n))
	its, units := s.units(batch, n, sc.its[:0], sc.units[:0])
	cmds := slices.Grow(sc.cmds[:0], len(units)-1)[:len(units)-1]
	defer func() { // nothing of this pipeline stays reachable from sc
		clear(its)
		clear(cmds)
		sc.its, sc.units, sc.cmds = its[:0], units[:0], cmds[:0]
	}()
	scripts := [2]*redis.Script{s.check, s.multi}
	nsc := 1
	if len(cmds) < len(its) {
		nsc = 2
	}
	s.scriptPipeline(ctx, sc, s.pipeClient(l), len(cmds), func(i int) redis.Cmder {
		if u := its[units[i]:units[i+1]]; len(u) == 1 {
			cmds[i] = redis.NewIntSliceCmd(ctx, u[0].args...)
		} else {
			cmds[i] = redis.NewIntSliceCmd(ctx, s.multiArgs(u)...)
		}
		cmds[i].SetFirstKeyPos(3) // Cluster routing: the first key
		return cmds[i]
	}, scripts[:nsc]...)
	rt := time.Since(sent)
	for _, cmd := range cmds {
		if err := cmd.Err(); err == nil || isReply(err) {
			l.lastAnswer.Store(time.Now().UnixNano())
			break
		}
	}
	if old := l.roundTrip.Load(); old == 0 {
		l.roundTrip.Store(int64(rt))
	} else {
		l.roundTrip.Store(old + (int64(rt)-old)/8)
	}
	// Redis's time per script: not measured by a pipeline that may have
	// waited for a new connection (a dial and handshake are no script
	// time), and one sample counts as at most 4x the average, so raises
	// it by at most three eighths (a pipeline answered after a stall,
	// Redis's or this process's, measured the stall, not scripts: a real
	// rise shows in every pipeline and is followed within a few). An
	// overestimate would excuse a stalled Redis's silence as our own
	// scripts' time, past the queue budget: checks shed instead of
	// answered by the failure policy.
	if per := int64(rt) / max(ahead, 1); ctx.Err() == nil && cmds[0].Err() == nil && !s.dialedSince(l, sent.UnixNano()) {
		if old := l.perScript.Load(); old == 0 {
			l.perScript.Store(per)
		} else {
			l.perScript.Store(old + (min(per, 4*old)-old)/8)
		}
	}
	timedOut := ctx.Err() != nil
	redo := 0
	for k, cmd := range cmds {
		u := its[units[k]:units[k+1]]
		val, err := cmd.Val(), cmd.Err()
		switch {
		case err == nil:
		case l != &s.main && isRedirect(err, len(u)):
			for _, it := range u {
				it.redo = true
			}
			redo += len(u)
			continue
		case timedOut || isTimeout(err):
			err = s.late(l, sent, rt, err)
		case !isReply(err) && isParseError(err):
			// A reply that is not an array of integers: go-redis
			// stopped reading this connection there (the calls after
			// it carry the same error).
			err = fmt.Errorf("%w: %w", ErrBadReply, err)
		}
		if len(u) == 1 || err != nil {
			for _, it := range u {
				it.val, it.err = val, err
			}
			continue
		}
		splitMulti(val, u)
	}
	if redo > 0 {
		s.redirect(l, batch, redo, deadline, bounded)
		return
	}
	for _, c := range batch {
		c.done <- struct{}{} // the last touch of c (see call)
	}
}

// late classifies a pipeline that hit its deadline: Redis silent (as in
// decide) is ErrTimeout; Redis answering others meanwhile means this process's
// own backlog, ErrQueueTimeout.
func (s *Store) late(l *lane, sent time.Time, rt time.Duration, err error) error {
	budget := time.Duration(0)
	if d, ok := s.roundTripBudget.Load().(time.Duration); ok {
		budget = d
	}
	from := max(sent.UnixNano(), s.answered(l))
	if budget > 0 && (!s.written(l, sent.UnixNano()) || !s.redisSilent(l, from, budget)) {
		return fmt.Errorf("%w: behind this process's backlog in Redis after %v: %w", ErrQueueTimeout, rt.Round(time.Millisecond), err)
	}
	return fmt.Errorf("%w after %v: %w", ErrTimeout, rt.Round(time.Millisecond), err)
}

// written reports whether a pipeline of l stamped sent at sent (unix ns)
// may be in Redis: some write to l's Redis has completed since, or a dial
// has begun (one that hangs is Redis unreachable; an Activity's), or the
// store cannot tell (no Activity).
func (s *Store) written(l *lane, sent int64) bool {
	a := s.opts.activity
	if a == nil {
		return true
	}
	if l.node != nil {
		return l.node.wrote.Load() >= sent
	}
	return a.wrote.Load() >= sent
}

// redisSilent reports whether l's Redis has been silent since from (unix
// ns) for the allowance of round trip rt, and the silence is Redis's own:
// no reply waits unread, a local Redis was not waiting for a CPU, and
// nothing was heard while these were asked.
func (s *Store) redisSilent(l *lane, from int64, rt time.Duration) bool {
	return time.Since(time.Unix(0, from)) >= s.allowance(l, rt) && !s.replyWaiting(l) && !s.redisStarved(from) && s.answered(l) <= from
}

// replyWaiting reports a reply from l's Redis received by the kernel and
// not yet read by this process (Activity.Unread), and counts it as Redis
// heard now: Redis has answered; the silence is this process's, waiting
// for a CPU.
func (s *Store) replyWaiting(l *lane) bool {
	a := s.opts.activity
	if a == nil || !a.unread(l.node) {
		return false
	}
	now := time.Now().UnixNano()
	a.last.Store(now)
	if l.node != nil {
		l.node.last.Store(now)
	}
	return true
}

// answered is the unix ns when l's Redis was last heard answering (a
// Cluster master's lane: that master; the main lane: any).
func (s *Store) answered(l *lane) int64 {
	v := l.lastAnswer.Load()
	if a := s.opts.activity; a != nil {
		if l.node != nil {
			v = max(v, l.node.last.Load())
		} else {
			v = max(v, a.last.Load())
		}
	}
	return v
}

// isReply reports an error reply from Redis (as opposed to no reply).
func isReply(err error) bool {
	var re redis.Error
	return errors.As(err, &re)
}

// isParseError reports go-redis refusing a reply it read whole (an
// IntSliceCmd's element that is no integer), as opposed to a failed read.
func isParseError(err error) bool {
	var ne *strconv.NumError
	return strings.HasPrefix(err.Error(), "redis: can't parse") || errors.As(err, &ne)
}

// isTimeout reports a network timeout or an expired deadline.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// evalShas runs sc n times in one pipeline, call i with keys(i) and args(i),
// and returns the n commands with their replies or errors (NOSCRIPT: see
// scriptPipeline).
func (s *Store) evalShas(ctx context.Context, sc *redis.Script, n int, keys func(i int) []string, args func(i int) []any) []*redis.Cmd {
	cmds := make([]*redis.Cmd, n)
	s.scriptPipeline(ctx, nil, s.client, n, func(i int) redis.Cmder {
		k, a := keys(i), args(i)
		cmdArgs := make([]any, 0, 3+len(k)+len(a))
		cmdArgs = append(cmdArgs, "evalsha", sc.Hash(), len(k))
		for _, key := range k {
			cmdArgs = append(cmdArgs, key)
		}
		cmds[i] = redis.NewCmd(ctx, append(cmdArgs, a...)...)
		if len(k) > 0 {
			cmds[i].SetFirstKeyPos(3)
		}
		return cmds[i]
	}, sc)
	return cmds
}

// scriptPipeline sends the n EVALSHA commands (of the scripts scs) that
// cmd(i) makes in one pipeline of client p, with sc's buffers and pipeline
// (nil: new ones). Calls that find their script missing
// (NOSCRIPT: a restarted or flushed server) are made again and sent in a
// second pipeline, once the scripts are loaded; if loading fails, they carry that error. This is the
// store's one NOSCRIPT retry.
func (s *Store) scriptPipeline(ctx context.Context, sc *scratch, p piper, n int, cmd func(i int) redis.Cmder, scs ...*redis.Script) {
	if sc == nil {
		sc = &scratch{}
	}
	if sc.pipe == nil || sc.pipeOf != p {
		sc.pipe, sc.pipeOf = p.Pipeline(), p
	}
	cmds := slices.Grow(sc.sent[:0], n)[:n]
	all := slices.Grow(sc.idx[:0], n)[:n]
	defer func() {
		clear(cmds)
		sc.sent, sc.idx = cmds[:0], all[:0]
	}()
	send := func(idx []int) {
		for _, i := range idx {
			cmds[i] = cmd(i)
			_ = sc.pipe.Process(ctx, cmds[i])
		}
		_, _ = sc.pipe.Exec(ctx) // errors are per command
	}
	for i := range all {
		all[i] = i
	}
	send(all)
	var retry []int
	for i, c := range cmds {
		if err := c.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			retry = append(retry, i)
		}
	}
	if len(retry) == 0 {
		return
	}
	for _, sc := range scs {
		if err := s.load(ctx, p, sc); err != nil {
			for _, i := range retry {
				cmds[i].SetErr(err)
			}
			return
		}
	}
	send(retry)
}

// load loads sc through p: the store's client (on a Cluster, every node),
// or a Cluster master's own client (that master alone: one that is down
// fails no other master's reload).
func (s *Store) load(ctx context.Context, p piper, sc *redis.Script) error {
	sp, ok := p.(redis.Scripter)
	if !ok {
		sp = s.client
	}
	if err := sc.Load(ctx, sp).Err(); err != nil {
		return fmt.Errorf("redisstore: load script: %w", err)
	}
	s.scriptLoads.Add(1)
	return nil
}

// units orders the items of batch for the pipeline (into the arrays of its
// and units, grown as needed): its, with the items that share a script call
// next to each other, and units, where unit k (one script call) is
// its[units[k]:units[k+1]]. All the items of a batch share one script call
// (multiSrc: in it a call costs Redis about a quarter less than alone, the
// EVALSHA and TIME being shared), in a Cluster one per hash slot, and one
// per time argument (the multi-call script takes one for all its calls:
// with Redis TIME, the default, every call's is the same; a WithClock clock
// may give the Dos of one pipeline different ones), in the order of each
// group's first item; a unit of one item is a check script call
// (checkSrc), as a batch of one single call is.
func (s *Store) units(batch []*call, n int, its []*item, units []int) ([]*item, []int) {
	its, units = slices.Grow(its[:0], n), append(slices.Grow(units[:0], n+1), 0)
	for _, c := range batch {
		for i := range c.items {
			its = append(its, &c.items[i])
		}
	}
	type group struct {
		slot int
		now  any
	}
	groupOf := func(it *item) group {
		g := group{now: nowOf(it)}
		if s.cluster != nil {
			g.slot = HashSlot(it.args[3].(string))
		}
		return g
	}
	one := true
	g0 := groupOf(its[0])
	for _, it := range its[1:] {
		if groupOf(it) != g0 {
			one = false
			break
		}
	}
	if one {
		return its, append(units, n)
	}
	// By group, stable, in the order of each group's first item.
	groups := make([]group, n)
	rank := make(map[group]int, 4)
	for i, it := range its {
		groups[i] = groupOf(it)
		if _, ok := rank[groups[i]]; !ok {
			rank[groups[i]] = len(rank)
		}
	}
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int { return rank[groups[a]] - rank[groups[b]] })
	sorted := make([]*item, n)
	for i, j := range idx {
		sorted[i] = its[j]
	}
	copy(its, sorted)
	for i := 1; i < n; i++ {
		if groups[idx[i]] != groups[idx[i-1]] {
			units = append(units, i)
		}
	}
	return its, append(units, n)
}

// nowOf is the time argument of an item's check command (see scriptArgs):
// "" (Redis TIME) or milliseconds from a WithClock clock.
func nowOf(it *item) any {
	return it.args[3+it.args[2].(int)+1]
}

// multiArgs is the multi-call script's EVALSHA command for the items u,
// made of their check commands (see scriptArgs).
func (s *Store) multiArgs(u []*item) []any {
	nk, na := 0, 0
	for _, it := range u {
		k := it.args[2].(int)
		nk += k
		na += len(it.args) - 3 - k
	}
	args := make([]any, 0, 5+nk+na)
	args = append(args, "evalsha", s.multiHash, nk)
	for _, it := range u {
		k := it.args[2].(int)
		args = append(args, it.args[3:3+k]...)
	}
	args = append(args, nowOf(u[0]), s.slackArg) // now (the same for all of u: units), slack
	for _, it := range u {
		k := it.args[2].(int)
		vals := it.args[3+k+3:]
		args = append(args, k, len(vals), it.args[3+k])
		args = append(args, vals...)
	}
	return args
}

// splitMulti gives each item of u its part of the multi-call script's
// reply v: its check reply (1+5n integers), or the error the script
// caught for it (a Redis error reply, as a script call of its own would
// fail with). A reply too short, or of another shape, is ErrBadReply.
func splitMulti(v []int64, u []*item) {
	off := 0
	for k, it := range u {
		switch {
		case off < len(v) && v[off] == -1 && off+1 < len(v) && v[off+1] >= 0 && v[off+1] <= int64(len(v)-off-2):
			msg := make([]byte, v[off+1])
			for i := range msg {
				msg[i] = byte(v[off+2+i])
			}
			it.val, it.err = nil, scriptError(msg)
			off += 2 + len(msg)
		case off+1+5*it.n <= len(v) && (v[off] == 0 || v[off] == 1):
			it.val = v[off : off+1+5*it.n : off+1+5*it.n]
			off += 1 + 5*it.n
		default:
			for _, it := range u[k:] {
				it.val, it.err = nil, fmt.Errorf("%w: %d integers for the %d calls of a multi-call script call", ErrBadReply, len(v), len(u))
			}
			return
		}
	}
	if off != len(v) {
		for _, it := range u {
			it.val, it.err = nil, fmt.Errorf("%w: %d integers for the %d calls of a multi-call script call, %d read", ErrBadReply, len(v), len(u), off)
		}
	}
}

// scriptError is an error the multi-call script caught for one call: the
// error reply that call would have had as a script call of its own.
type scriptError string

func (e scriptError) Error() string { return string(e) }

// RedisError marks scriptError as an error reply (redis.Error).
func (scriptError) RedisError() {}

// CheckScriptSource is the Lua source of the check script, for comparing
// the store with redis-benchmark running the same script (see the README).
func CheckScriptSource() string { return checkSrc }
