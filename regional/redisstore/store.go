package redisstore

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Store evaluates buckets in Redis. It is safe for concurrent use. Check
// and Do calls are pipelined by a fixed set of worker goroutines owned by the
// Store and stopped by Close.
type Store struct {
	client          redis.UniversalClient
	cluster         *redis.ClusterClient // set when client is a Cluster client
	cs              clusterState
	check           *redis.Script
	multi           *redis.Script // several calls of one Do in one script call (multiSrc)
	marker          *redis.Script
	shares          *redis.Script
	winShares       *redis.Script // global windows' records (global_window.go)
	opts            options
	slackMs         int64
	slackArg        any             // slackMs, boxed once for every check's command
	checkHash       any             // the check script's SHA1, boxed once
	multiHash       any             // the multi-call script's SHA1, boxed once
	ctx             context.Context // canceled by Close; parent of every pipeline's context
	cancel          context.CancelFunc
	done            chan struct{} // closed when Close starts
	stopped         chan struct{} // closed when the workers have exited
	wg              sync.WaitGroup
	closeOnce       sync.Once
	scriptLoads     atomic.Uint64
	pipelines       atomic.Uint64 // pipelines sent (for the benchmarks' batch figure)
	batched         atomic.Uint64 // checks sent in them
	lag             lagProbe
	roundTripBudget atomic.Value // time.Duration: the latest Do's RoundTrip, for late

	// main is the store's lane: a standalone Redis's only one; on a
	// Cluster the lane of keys whose master the client does not know
	// yet, and lanes holds one more per master (lane.go).
	main   lane
	lanes  atomic.Pointer[laneSet] // a Cluster's lanes; nil for a standalone Redis
	laneMu sync.Mutex              // held to add a lane, and by Close to close done
	noMap  atomic.Int64            // unix ns when a Cluster lookup last found no slot map (laneFor); 0: it found one since

	// watch is a local Redis's scheduling (WatchLocalRedis); nil: none.
	watch atomic.Pointer[procWatch]
}

// Call is one request's check for Do: cost and buckets, as for Check.
type Call struct {
	Cost    int64
	Buckets []Bucket
}

// Answer is one Call's outcome, as Check returns it.
type Answer struct {
	Allowed bool
	Results []Result
	Err     error
}

// Budget bounds the time one Do spends inside the store. A zero field
// leaves that part bounded by ctx alone.
type Budget struct {
	// Queue bounds the wait for a worker to take the calls: time spent
	// behind other callers in this process, not in Redis. Past it the
	// calls fail with ErrQueueTimeout and are never sent.
	Queue time.Duration
	// RoundTrip bounds the Redis round trip: from the moment the pipeline
	// holding the calls is sent until Redis has answered (NOSCRIPT reload
	// included). Past it the calls fail with ErrTimeout.
	RoundTrip time.Duration
}

// Load is the store's recent load, for overload shedding.
type Load struct {
	Queued    int           // calls waiting for a worker now
	RoundTrip time.Duration // moving average of recent pipelines' round trips
	Answered  time.Time     // when Redis was last heard answering (zero: never)
}

// call is one pending Do: its items go to Redis in one pipeline. Exactly one
// of the worker and the caller moves state out of callQueued; the worker
// sends on done (buffered, one value) once every item has its reply, or
// when it drops a call whose caller's ctx has ended, and does not touch the
// call after that send. A caller that received it puts the call back in
// callPool for the next Do (no allocation for the call and its channel); a
// caller that gave up without it leaves the call to the collector, since
// the worker may still hold it.
type call struct {
	ctx    context.Context
	budget Budget
	items  []item // in one (a single call: one allocation less) or their own array
	one    [1]item
	many   []item       // the array of an earlier Do of several calls, reused
	sent   atomic.Int64 // unix ns when the worker sent the pipeline
	state  atomic.Int32
	done   chan struct{}
	lane   *lane // the lane it is queued on (nil: the store's main lane)
}

// callPool holds the calls of answered Dos (see call).
var callPool sync.Pool

// getCall is a call in state callQueued, never sent, with room for n items.
func getCall(ctx context.Context, b Budget, n int) *call {
	c, ok := callPool.Get().(*call)
	if !ok {
		c = &call{done: make(chan struct{}, 1)}
	}
	c.ctx, c.budget = ctx, b
	switch {
	case n <= len(c.one):
		c.items = c.one[:0]
	case cap(c.many) >= n:
		c.items = c.many[:0]
	default:
		c.items = make([]item, 0, n)
		if n <= maxPooledItems {
			c.many = c.items
		}
	}
	return c
}

// putCall returns c, whose done value its caller has received, to callPool,
// keeping no reference to the Do's data.
func putCall(c *call) {
	clear(c.items)
	c.ctx, c.items, c.lane = nil, nil, nil
	c.sent.Store(0)
	c.state.Store(callQueued)
	callPool.Put(c)
}

// maxPooledItems bounds the array a pooled call keeps for a later Do of
// several calls (a CheckLimits batch), so that a pooled call never holds
// more than about 150 KB.
const maxPooledItems = 1024

// call states.
const (
	callQueued int32 = iota
	callTaken
	callAbandoned
)

// item is one script call of a Do. args is the whole EVALSHA command (name,
// hash, key count, keys, the script's arguments), built once in the form
// go-redis writes it; the limits of its first inlineBuckets buckets point
// into nums rather than being boxed one by one.
type item struct {
	args []any
	nums [2 * inlineBuckets]int64
	out  int      // index in Do's calls
	n    int      // its buckets
	res  []Result // the array Do's caller gave for its results (out[out].Results)
	val  []int64  // the script's reply, read by go-redis as integers
	err  error
	redo bool // to be sent again through the Cluster client (redirect)
}

// inlineBuckets is how many buckets of a call have their limits in
// item.nums (one allocation less each); the others' are boxed.
const inlineBuckets = 2

// New returns a Store on client and starts its workers. It does not touch
// the network: the scripts are loaded by Warm, or on first use (NOSCRIPT).
// Close stops the workers; the client stays open and belongs to the caller.
// With a go-redis client, set ContextTimeoutEnabled so that a round trip
// past its budget is abandoned at once rather than at ReadTimeout (the
// caller gets ErrTimeout at the budget either way; the worker is held).
func New(client redis.UniversalClient, opts ...Option) (*Store, error) {
	if client == nil {
		return nil, fmt.Errorf("redisstore: nil client")
	}
	o := options{batch: DefaultBatchSize, workers: DefaultWorkers, slack: DefaultTTLSlack}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Store{
		client:  client,
		check:   redis.NewScript(checkSrc),
		multi:   redis.NewScript(multiSrc),
		marker:  redis.NewScript(markerSrc),
		shares:  redis.NewScript(sharesSrc),
		opts:    o,
		slackMs: o.slack.Milliseconds(),
		ctx:     ctx,
		cancel:  cancel,
		done:    make(chan struct{}),
		stopped: make(chan struct{}),
	}
	s.winShares = redis.NewScript(winSharesSrc)
	s.slackArg, s.checkHash, s.multiHash = s.slackMs, s.check.Hash(), s.multi.Hash()
	if cc, ok := client.(*redis.ClusterClient); ok {
		s.cluster = cc
		s.cs.views = map[string]*clusterView{}
		s.cs.fanned = map[string]fanout{}
		s.cs.running = map[string]*fanJob{}
		s.cs.pending = map[string]*fanJob{}
	} else if o.slotHi != 0 {
		cancel()
		return nil, fmt.Errorf("redisstore: WithMarkerSlots needs a Redis Cluster client")
	}
	s.main.queue = make(chan *call, o.batch*o.workers)
	s.main.busy = make([]atomic.Int64, o.workers)
	s.main.scripts = make([]atomic.Int64, o.workers)
	if s.cluster != nil {
		s.lanes.Store(&laneSet{all: []*lane{&s.main}, byAddr: map[string]*lane{}})
	}
	s.wg.Add(o.workers + 1)
	for i := 0; i < o.workers; i++ {
		go s.worker(&s.main, i)
	}
	go func() {
		defer s.wg.Done()
		s.lag.run(s.done)
	}()
	return s, nil
}

// Warm prepares the store for its first checks: it loads the scripts on
// every connection the workers will use at once (one per worker, opened
// concurrently, so the client's pool holds them), so that no check pays for
// dialing or a NOSCRIPT reload. An error means Redis is not reachable yet.
func (s *Store) Warm(ctx context.Context) error {
	errs := make(chan error, s.opts.workers)
	for i := 0; i < s.opts.workers; i++ {
		go func() {
			var err error
			for _, sc := range []*redis.Script{s.check, s.multi, s.marker, s.shares, s.winShares} {
				if err = sc.Load(ctx, s.client).Err(); err != nil {
					break
				}
			}
			errs <- err
		}()
	}
	var first error
	for i := 0; i < s.opts.workers; i++ {
		if err := <-errs; err != nil && first == nil {
			first = fmt.Errorf("redisstore: warm: %w", err)
		}
	}
	if first != nil || s.cluster != nil {
		return first
	}
	return s.warmPipelines(ctx)
}

// warmPipelines opens the connections of go-redis's pipeline pool that the
// workers use at once: the workers' pipelines take their connections from
// that pool, apart from the one plain commands use, and go-redis keeps none
// idle there by itself. A round sends one pipeline per worker at once (a
// pipeline that ends before another starts reuses its connection, so a
// round may open fewer: a few rounds, until the pool holds one per worker
// or as many as it may).
func (s *Store) warmPipelines(ctx context.Context) error {
	scripts := []*redis.Script{s.check, s.multi, s.marker, s.shares, s.winShares}
	for range 5 {
		if st := s.client.PoolStats(); st == nil || st.PipelineStats == nil || int(st.PipelineStats.TotalConns) >= s.opts.workers {
			return nil
		}
		errs := make(chan error, s.opts.workers)
		start := make(chan struct{})
		for i := 0; i < s.opts.workers; i++ {
			go func() {
				p := s.client.Pipeline()
				for _, sc := range scripts {
					sc.Load(ctx, p)
				}
				<-start
				_, err := p.Exec(ctx)
				errs <- err
			}()
		}
		close(start)
		for i := 0; i < s.opts.workers; i++ {
			if err := <-errs; err != nil {
				return fmt.Errorf("redisstore: warm: %w", err)
			}
		}
	}
	return nil
}

// Close stops the workers and waits for them; checks still queued fail with
// ErrClosed. Safe to call twice. It does not close the client. A pipeline
// already sent to a server that never answers holds Close for at most its
// budget, or the client's dial and read timeouts without ContextTimeoutEnabled;
// callers of Check never wait for it.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.laneMu.Lock() // no lane starts its workers once done is closed
		close(s.done)
		s.laneMu.Unlock()
		s.cancel()
		s.wg.Wait()
		s.cs.wg.Wait() // Cluster marker fan-outs (canceled with s.ctx)
		close(s.stopped)
	})
	return nil
}

// ScriptLoads reports how many times a script was (re)loaded after a NOSCRIPT
// reply (the first use on a server counts once).
func (s *Store) ScriptLoads() uint64 { return s.scriptLoads.Load() }

// Pipelines reports the pipelines sent and the script calls in them, since New.
func (s *Store) Pipelines() (pipelines, checks uint64) {
	return s.pipelines.Load(), s.batched.Load()
}

// Load reports the calls waiting for a worker and the recent round trip.
// On a Redis Cluster it sums the calls waiting for every master and takes
// the slowest master's round trip and the latest answer of any; DomainLoad
// is one master's.
func (s *Store) Load() Load {
	set := s.lanes.Load()
	if set == nil {
		return s.loadOf(&s.main)
	}
	var all Load
	for _, l := range set.all {
		ld := s.loadOf(l)
		all.Queued += ld.Queued
		all.RoundTrip = max(all.RoundTrip, ld.RoundTrip)
		if ld.Answered.After(all.Answered) {
			all.Answered = ld.Answered
		}
	}
	return all
}

// loadOf is Load of one lane.
func (s *Store) loadOf(l *lane) Load {
	ld := Load{Queued: int(l.queued.Load()), RoundTrip: time.Duration(l.roundTrip.Load())}
	if a := s.answered(l); a != 0 {
		ld.Answered = time.Unix(0, a)
	}
	return ld
}

func (s *Store) nowArg() (any, error) {
	if s.opts.clock == nil {
		return "", nil
	}
	ms := s.opts.clock().UnixMilli()
	if ms < 0 || ms > MaxTime {
		return nil, fmt.Errorf("%w: %d ms", ErrClock, ms)
	}
	return ms, nil
}

// Check evaluates all buckets in one script call (EVALSHA, loading the
// script on NOSCRIPT). allowed is true iff every non-shadow bucket allows
// cost; if any non-shadow bucket rejects, nothing is consumed from any
// bucket. Otherwise every allowing bucket (shadow ones included) consumes
// cost. cost is in whole tokens (>= 1). Buckets must have distinct keys, and
// in Redis Cluster one hash tag (Key gives that for one client). A bucket
// with Global set enforces its share of the global capacity and rate (see
// the package doc); its rule's marker (on a Cluster, the copy in the
// buckets' slot) is read by the same script.
//
// Check returns ctx.Err() as soon as ctx is done, whatever Redis does; the
// script may still run after that. It is Do with one call and no budget.
func (s *Store) Check(ctx context.Context, cost int64, buckets []Bucket) (allowed bool, results []Result, err error) {
	var a [1]Answer
	s.Do(ctx, Budget{}, []Call{{Cost: cost, Buckets: buckets}}, a[:])
	return a[0].Allowed, a[0].Results, a[0].Err
}

// Do evaluates each call as Check does, all of them in one pipeline (one
// round trip; on a Redis Cluster one per master), and writes call i's outcome to out[i] (len(out) must be at
// least len(calls)). Each call is atomic on its own; calls are independent
// of each other. An invalid call fails alone (ErrInvalidBucket,
// ErrInvalidCost). Every call sent fails with ctx.Err() once ctx is done,
// with ErrQueueTimeout when no worker took it within b.Queue, and with an
// error wrapping ErrTimeout when Redis did not answer within b.RoundTrip.
// out[i].Results' array, when it has room for call i's buckets, receives
// its results (a caller's buffer: one allocation less per call); pass nil
// Results to have new ones.
//
// On a Redis Cluster the calls of each master go to that master's own
// lane (lane.go): a Do whose calls live on several masters waits for
// each, concurrently, and a master that fails or stalls fails only its
// own calls.
func (s *Store) Do(ctx context.Context, b Budget, calls []Call, out []Answer) {
	start := time.Now()
	if b.RoundTrip > 0 {
		if d, _ := s.roundTripBudget.Load().(time.Duration); d != b.RoundTrip {
			s.roundTripBudget.Store(b.RoundTrip)
		}
	}
	now, nowErr := s.nowArg()
	l := &s.main
	if s.cluster != nil {
		var split bool
		if l, split = s.lanesOf(calls); split {
			s.doLanes(ctx, b, calls, out, start, now, nowErr)
			return
		}
	}
	c := getCall(ctx, b, len(calls))
	c.lane = l
	if s.prepare(c, calls, out, nil, now, nowErr) {
		s.send(ctx, b, c, calls, out, start)
	}
}

// prepare builds c's items from calls (those of idx; nil: all) and writes
// the outcome of each call that needs no script call (invalid, no bucket)
// to out. False when no item is left to send: c is back in callPool.
func (s *Store) prepare(c *call, calls []Call, out []Answer, idx []int, now any, nowErr error) bool {
	n := len(calls)
	if idx != nil {
		n = len(idx)
	}
	for k := 0; k < n; k++ {
		i := k
		if idx != nil {
			i = idx[k]
		}
		cl := calls[i]
		res := out[i].Results[:0] // its array is reused (see Do)
		out[i] = Answer{}
		if nowErr != nil {
			out[i].Err = nowErr
			continue
		}
		if err := validate(cl.Cost, cl.Buckets); err != nil {
			out[i].Err = err
			continue
		}
		if len(cl.Buckets) == 0 {
			out[i].Allowed = true
			continue
		}
		c.items = append(c.items, item{out: i, n: len(cl.Buckets), res: res}) // in place: args point into it
		it := &c.items[len(c.items)-1]
		it.args = s.scriptArgs(it, cl.Cost, now, cl.Buckets)
	}
	if len(c.items) == 0 {
		putCall(c) // never queued
		return false
	}
	return true
}

// send queues c on its lane and waits for its answers (see Do).
func (s *Store) send(ctx context.Context, b Budget, c *call, calls []Call, out []Answer, start time.Time) {
	l := c.lane
	fail := func(err error) {
		for i := range c.items {
			out[c.items[i].out].Err = err
		}
	}
	var timer *time.Timer
	var expired <-chan time.Time
	l.queued.Add(1)
	select {
	case l.queue <- c: // room in the queue: no timer for the send
	default:
		if b.Queue > 0 {
			timer = getTimer(b.Queue)
			defer putTimer(timer)
			expired = timer.C
		}
		select {
		case l.queue <- c:
		case <-ctx.Done():
			l.queued.Add(-1)
			fail(ctx.Err())
			return
		case <-s.done:
			l.queued.Add(-1)
			fail(ErrClosed)
			return
		case <-expired:
			l.queued.Add(-1)
			fail(ErrQueueTimeout)
			return
		}
	}
	// From here the timer polls, every RoundTrip at most, what the call is
	// waiting for (see decide).
	if b.Queue > 0 {
		if timer == nil {
			timer = getTimer(s.decideNext(c, b, start))
			defer putTimer(timer)
			expired = timer.C
		} else {
			timer.Reset(s.decideNext(c, b, start))
		}
	}
wait:
	for {
		select {
		case <-c.done:
			break wait
		case <-ctx.Done():
			if c.state.CompareAndSwap(callQueued, callAbandoned) {
				l.queued.Add(-1)
			}
			fail(ctx.Err())
			return
		case <-s.stopped:
			select {
			case <-c.done:
				break wait
			default:
				fail(ErrClosed)
				return
			}
		case <-expired:
			select {
			case <-c.done: // answered meanwhile: the answer wins
				break wait
			default:
			}
			next, err := s.decide(c, b, start)
			if err != nil {
				fail(err)
				return
			}
			if next <= 0 {
				expired = nil // bounded by ctx and the worker alone
				continue
			}
			timer.Reset(next)
		}
	}
	for i := range c.items {
		it := &c.items[i]
		a := &out[it.out]
		if it.err != nil {
			a.Err = it.err
			s.clusterTrouble(it.err)
			continue
		}
		a.Allowed, a.Results, a.Err = parseCheck(it.val, len(calls[it.out].Buckets), it.res)
	}
	putCall(c) // its done value received: the worker is done with it
}

// timers reuses the timers of Do (one per call otherwise): since Go 1.23 a
// stopped timer delivers no stale value, so the next caller can reset it.
var timers sync.Pool

func getTimer(d time.Duration) *time.Timer {
	if t, ok := timers.Get().(*time.Timer); ok {
		t.Reset(d)
		return t
	}
	return time.NewTimer(d)
}

func putTimer(t *time.Timer) {
	t.Stop()
	timers.Put(t)
}

// scriptArgs is the check script's EVALSHA command for buckets: its keys
// (the buckets', then each distinct marker key of a global one) and
// arguments. The limits of the first inlineBuckets buckets are written to
// it.nums and passed by pointer (go-redis writes *int64 as the number).
func (s *Store) scriptArgs(it *item, cost int64, now any, buckets []Bucket) []any {
	var kbuf [4]string // the marker keys, distinct
	var ibuf [8]int    // per bucket: its marker's index in markers
	markers, midx := kbuf[:0], ibuf[:0]
	if len(buckets) > len(ibuf) {
		midx = make([]int, 0, len(buckets))
	}
	for _, b := range buckets {
		j := -1
		if b.Global != nil {
			mk := s.markerKeyFor(b.Global.Rule, buckets[0].Key)
			if j = slices.Index(markers, mk); j < 0 {
				j, markers = len(markers), append(markers, mk)
			}
		}
		midx = append(midx, j)
	}
	nk := len(buckets) + len(markers)
	args := make([]any, 0, 3+nk+3+7*len(buckets))
	args = append(args, "evalsha", s.checkHash, nk)
	for _, b := range buckets {
		args = append(args, b.Key)
	}
	for _, mk := range markers {
		args = append(args, mk)
	}
	args = append(args, cost, now, s.slackArg)
	for i, b := range buckets {
		alg := algCode(b.Algorithm)
		var x, y int64
		switch alg {
		case algTokenBucket, algLeakyBucket:
			x, y = b.Capacity, b.Rate
		default:
			x, y = b.Limit, b.Window.Milliseconds()
		}
		var xa, ya any
		if i < inlineBuckets {
			it.nums[2*i], it.nums[2*i+1] = x, y
			xa, ya = &it.nums[2*i], &it.nums[2*i+1]
		} else {
			xa, ya = x, y
		}
		shadow := 0
		if b.Shadow {
			shadow = 1
		}
		if b.Global == nil {
			args = append(args, alg, xa, ya, shadow)
			continue
		}
		args = append(args, globalCode(alg), xa, ya, shadow, b.Global.Units, b.Global.Floor, len(buckets)+midx[i]+1)
	}
	return args
}

// parseCheck reads the check script's reply for n buckets: 1+5n integers
// (go-redis read them as such; a reply of another shape failed the read).
// The results go to res's array when it has room for n.
func parseCheck(v []int64, n int, res []Result) (bool, []Result, error) {
	if len(v) != 1+5*n {
		return false, nil, fmt.Errorf("%w: %d integers for %d buckets", ErrBadReply, len(v), n)
	}
	if cap(res) < n {
		res = make([]Result, n)
	}
	res = res[:n]
	for i := range res {
		r := v[1+5*i:]
		res[i] = Result{Allowed: r[0] == 1, Limit: r[1], Remaining: r[2], RetryAfterMs: r[3], ResetAfterMs: r[4]}
	}
	return v[0] == 1, res, nil
}
