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

// Defaults.
const (
	DefaultBatchSize = 128
	DefaultWorkers   = 4
	DefaultTTLSlack  = time.Second
)

type options struct {
	batch   int
	workers int
	clock   func() time.Time
	slack   time.Duration
}

// Option configures a Store.
type Option func(*options) error

// WithBatchSize sets how many pending checks one worker sends in one
// pipeline, at most. Default 128 (DefaultBatchSize); unit: checks.
func WithBatchSize(n int) Option {
	return func(o *options) error {
		if n < 1 {
			return fmt.Errorf("redisstore: batch size %d must be at least 1", n)
		}
		o.batch = n
		return nil
	}
}

// WithWorkers sets the number of pipelining goroutines, each with at most one
// pipeline in flight. Default 4 (DefaultWorkers); unit: goroutines.
func WithWorkers(n int) Option {
	return func(o *options) error {
		if n < 1 {
			return fmt.Errorf("redisstore: workers %d must be at least 1", n)
		}
		o.workers = n
		return nil
	}
}

// WithClock is for tests: the scripts use clock() (truncated to ms, passed
// as an argument; it must lie in [1970, MaxTime]) instead of Redis TIME. Default nil: Redis TIME, one clock
// for every enforcer of a region.
func WithClock(clock func() time.Time) Option {
	return func(o *options) error {
		o.clock = clock
		return nil
	}
}

// WithTTLSlack sets how much longer than the time a bucket needs to become
// full (or a window to end) its key lives. Default 1s (DefaultTTLSlack);
// unit: time, truncated to ms; every TTL is at least 1s in any case.
func WithTTLSlack(d time.Duration) Option {
	return func(o *options) error {
		if d < 0 || d > 24*time.Hour {
			return fmt.Errorf("redisstore: TTL slack %v must be in [0, 24h]", d)
		}
		o.slack = d
		return nil
	}
}

// Store evaluates buckets in Redis. It is safe for concurrent use. Check
// calls are pipelined by a fixed set of worker goroutines owned by the Store
// and stopped by Close.
type Store struct {
	client      redis.UniversalClient
	check       *redis.Script
	marker      *redis.Script
	shares      *redis.Script
	opts        options
	slackMs     int64
	queue       chan *call
	ctx         context.Context // canceled by Close; parent of every pipeline's context
	cancel      context.CancelFunc
	done        chan struct{} // closed when Close starts
	stopped     chan struct{} // closed when the workers have exited
	wg          sync.WaitGroup
	closeOnce   sync.Once
	scriptLoads atomic.Uint64
	pipelines   atomic.Uint64 // pipelines sent (for the benchmarks' batch figure)
	batched     atomic.Uint64 // checks sent in them
}

// call is one pending Check. The worker that takes it sends exactly one
// value on res (buffered) unless the caller's ctx was done before sending.
type call struct {
	ctx  context.Context
	keys []string
	args []any
	res  chan callResult
}

type callResult struct {
	val any
	err error
}

// New returns a Store on client and starts its workers. It does not touch
// the network: the scripts are loaded on first use (NOSCRIPT). Close stops
// the workers; the client stays open and belongs to the caller.
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
		marker:  redis.NewScript(markerSrc),
		shares:  redis.NewScript(sharesSrc),
		opts:    o,
		slackMs: o.slack.Milliseconds(),
		queue:   make(chan *call, o.batch*o.workers),
		ctx:     ctx,
		cancel:  cancel,
		done:    make(chan struct{}),
		stopped: make(chan struct{}),
	}
	s.wg.Add(o.workers)
	for i := 0; i < o.workers; i++ {
		go s.worker()
	}
	return s, nil
}

// Close stops the workers and waits for them; checks still queued fail with
// ErrClosed. Safe to call twice. It does not close the client. A pipeline
// already sent to a server that never answers holds Close for at most the
// client's dial and read timeouts (go-redis does not abort a blocked read
// on cancellation); callers of Check never wait for it.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		close(s.done)
		s.cancel()
		s.wg.Wait()
		close(s.stopped)
	})
	return nil
}

// ScriptLoads reports how many times a script was (re)loaded after a NOSCRIPT
// reply (the first use on a server counts once).
func (s *Store) ScriptLoads() uint64 { return s.scriptLoads.Load() }

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
// the package doc); its rule's marker key is read by the same script, so
// global buckets need standalone Redis.
//
// Check returns ctx.Err() as soon as ctx is done, whatever Redis does; the
// script may still run after that.
func (s *Store) Check(ctx context.Context, cost int64, buckets []Bucket) (allowed bool, results []Result, err error) {
	if err := validate(cost, buckets); err != nil {
		return false, nil, err
	}
	if len(buckets) == 0 {
		return true, nil, nil
	}
	now, err := s.nowArg()
	if err != nil {
		return false, nil, err
	}
	keys := make([]string, len(buckets), len(buckets)+1)
	args := make([]any, 3, 3+4*len(buckets))
	args[0], args[1], args[2] = cost, now, s.slackMs
	for i, b := range buckets {
		keys[i] = b.Key
	}
	for _, b := range buckets {
		alg := algCode(b.Algorithm)
		var x, y int64
		switch alg {
		case algTokenBucket, algLeakyBucket:
			x, y = b.Capacity, b.Rate
		default:
			x, y = b.Limit, b.Window.Milliseconds()
		}
		shadow := 0
		if b.Shadow {
			shadow = 1
		}
		if b.Global == nil {
			args = append(args, alg, x, y, shadow)
			continue
		}
		mk := MarkerKey(b.Global.Rule)
		idx := slices.Index(keys[len(buckets):], mk)
		if idx < 0 {
			idx = len(keys) - len(buckets)
			keys = append(keys, mk)
		}
		args = append(args, int64(algGlobalTokenBucket), x, y, shadow, b.Global.Units, b.Global.Floor, len(buckets)+idx+1)
	}
	c := &call{ctx: ctx, keys: keys, args: args, res: make(chan callResult, 1)}
	select {
	case s.queue <- c:
	case <-ctx.Done():
		return false, nil, ctx.Err()
	case <-s.done:
		return false, nil, ErrClosed
	}
	var r callResult
	select {
	case r = <-c.res:
	case <-ctx.Done():
		return false, nil, ctx.Err()
	case <-s.stopped:
		select {
		case r = <-c.res:
		default:
			return false, nil, ErrClosed
		}
	}
	if r.err != nil {
		return false, nil, r.err
	}
	return parseCheck(r.val, len(buckets))
}

func parseCheck(v any, n int) (bool, []Result, error) {
	a, ok := v.([]any)
	if !ok || len(a) != 1+5*n {
		return false, nil, fmt.Errorf("%w: %T of length %d", ErrBadReply, v, len(a))
	}
	ints := make([]int64, len(a))
	for i, x := range a {
		if ints[i], ok = x.(int64); !ok {
			return false, nil, fmt.Errorf("%w: element %d is %T", ErrBadReply, i, x)
		}
	}
	res := make([]Result, n)
	for i := range res {
		r := ints[1+5*i:]
		res[i] = Result{Allowed: r[0] == 1, Limit: r[1], Remaining: r[2], RetryAfterMs: r[3], ResetAfterMs: r[4]}
	}
	return ints[0] == 1, res, nil
}

// worker takes a call, drains up to the batch size of pending calls and
// sends them in one pipeline. The batch belongs to this goroutine.
func (s *Store) worker() {
	defer s.wg.Done()
	batch := make([]*call, 0, s.opts.batch)
	for {
		select {
		case <-s.done:
			return
		case c := <-s.queue:
			batch = append(batch[:0], c)
		drain:
			for len(batch) < s.opts.batch {
				select {
				case c := <-s.queue:
					batch = append(batch, c)
				default:
					break drain
				}
			}
			s.run(batch)
			clear(batch)
		}
	}
}

// run executes one batch. Calls whose caller has given up are dropped. The
// pipeline's context ends at the latest caller deadline (or at Close if a
// caller has none), so a dead Redis holds a worker no longer than its callers.
func (s *Store) run(batch []*call) {
	live := batch[:0]
	var deadline time.Time
	bounded := true
	for _, c := range batch {
		if c.ctx.Err() != nil {
			continue
		}
		live = append(live, c)
		if d, ok := c.ctx.Deadline(); !ok {
			bounded = false
		} else if d.After(deadline) {
			deadline = d
		}
	}
	if len(live) == 0 {
		return
	}
	ctx, cancel := s.ctx, context.CancelFunc(func() {})
	if bounded {
		ctx, cancel = context.WithDeadline(s.ctx, deadline)
	}
	defer cancel()

	s.pipelines.Add(1)
	s.batched.Add(uint64(len(live)))
	cmds := make([]*redis.Cmd, len(live))
	pipe := s.client.Pipeline()
	for i, c := range live {
		cmds[i] = pipe.EvalSha(ctx, s.check.Hash(), c.keys, c.args...)
	}
	_, _ = pipe.Exec(ctx) // errors are per command
	var retry []int
	for i, cmd := range cmds {
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			retry = append(retry, i)
		}
	}
	if len(retry) > 0 {
		if err := s.load(ctx, s.check); err != nil {
			for _, i := range retry {
				cmds[i].SetErr(err)
			}
		} else {
			pipe = s.client.Pipeline()
			for _, i := range retry {
				cmds[i] = pipe.EvalSha(ctx, s.check.Hash(), live[i].keys, live[i].args...)
			}
			_, _ = pipe.Exec(ctx)
		}
	}
	for i, c := range live {
		c.res <- callResult{val: cmds[i].Val(), err: cmds[i].Err()}
	}
}

func (s *Store) load(ctx context.Context, sc *redis.Script) error {
	if err := sc.Load(ctx, s.client).Err(); err != nil {
		return fmt.Errorf("redisstore: load script: %w", err)
	}
	s.scriptLoads.Add(1)
	return nil
}

// CheckScriptSource is the Lua source of the check script, for comparing
// the store with redis-benchmark running the same script (see the README).
func CheckScriptSource() string { return checkSrc }
