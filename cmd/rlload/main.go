// Command rlload drives CheckLimit load at an enforcer over gRPC and reports
// throughput and latency percentiles.
//
//	rlload --addr 127.0.0.1:8081 --concurrency 64 --duration 10s --keys 1000
//	rlload --addr 127.0.0.1:8081 --batch 32 ...   # CheckLimits of 32 requests
//	rlload --noop-server 127.0.0.1:0              # the no-op ceiling to compare with
//	rlload --version
//
// Each worker sends one call at a time on a shared connection pool; keys are
// spread uniformly over --keys client keys. The run is bounded by --duration
// and --max-requests (calls), and it stops by itself. --noop-server serves a
// ratelimit.v1 RateLimiter that allows every check with no work at all (with
// ratelimitd's gRPC stream workers and GC setting, so that both servers are
// tuned alike): driven by the same tool, it is the gRPC ceiling of the
// machine (cmd/rlload/bench.sh prints both and ratios).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/command"
	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/internal/version"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/redisstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func main() {
	command.Main("rlload", func(ctx context.Context, args []string, stdout, _ io.Writer) error { return run(ctx, args, stdout) }, nil)
}

// Result summarises one load run.
type Result struct {
	Requests   int64 // calls answered
	Decisions  int64 // checked requests in them
	Errors     int64
	FirstError string
	Allowed    int64
	Rejected   int64
	FailOpen   int64
	Elapsed    time.Duration
	P50, P99   time.Duration
	P999, Max  time.Duration
}

// Throughput is requests per second.
func (r Result) Throughput() float64 { return float64(r.Requests) / r.Elapsed.Seconds() }

func run(ctx context.Context, args []string, stdout io.Writer) error {
	if version.Requested(args) {
		return version.Print(stdout, "rlload")
	}
	fs := flag.NewFlagSet("rlload", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage of rlload:")
		fs.PrintDefaults()
		fmt.Fprint(fs.Output(), version.FlagHelp)
	}
	addr := fs.String("addr", "127.0.0.1:8081", "enforcer gRPC address")
	conc := fs.Int("concurrency", 64, "concurrent callers")
	conns := fs.Int("connections", 4, "gRPC connections shared by the callers")
	dur := fs.Duration("duration", 10*time.Second, "how long to run")
	maxReq := fs.Int64("max-requests", 10_000_000, "stop after this many requests")
	keys := fs.Int("keys", 1000, "distinct client keys")
	resource := fs.String("resource", "GET /bench", "resource of every request")
	printScript := fs.Bool("print-script", false, "print the enforcer's Lua check script (for redis-benchmark) and exit")
	batch := fs.Int("batch", 0, "send CheckLimits calls of this many requests (distinct keys) instead of CheckLimit (0: CheckLimit)")
	noop := fs.String("noop-server", "", "serve a no-op ratelimit.v1 server on this address (port 0: any) until interrupted, instead of sending load")
	if err := flagenv.Parse(fs, args, nil); err != nil {
		return err
	}
	if *printScript {
		_, err := io.WriteString(stdout, redisstore.CheckScriptSource())
		return err
	}
	if *noop != "" {
		return serveNoop(ctx, *noop, stdout)
	}
	if *batch < 0 || *batch > regional.MaxBatch {
		return fmt.Errorf("--batch must be in [0, %d]", regional.MaxBatch)
	}
	if *conc < 1 || *conns < 1 || *keys < 1 || *dur <= 0 {
		return errors.New("--concurrency, --connections, --keys and --duration must be positive")
	}
	clients := make([]ratelimitv1.RateLimiterClient, *conns)
	for i := range clients {
		cc, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer cc.Close()
		clients[i] = ratelimitv1.NewRateLimiterClient(cc)
	}
	// Warm up: one call per connection, so dial time is not measured.
	for _, c := range clients {
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := c.CheckLimit(wctx, &ratelimitv1.CheckLimitRequest{ClientKey: "warmup", Resource: *resource})
		cancel()
		if err != nil {
			return fmt.Errorf("warm-up call to %s: %w", *addr, err)
		}
	}
	res := Load(ctx, clients, Spec{Concurrency: *conc, Duration: *dur, MaxRequests: *maxReq, Keys: *keys, Resource: *resource, Batch: *batch})
	fmt.Fprintf(stdout, "requests=%d errors=%d allowed=%d rejected=%d fail_open=%d\n", res.Requests, res.Errors, res.Allowed, res.Rejected, res.FailOpen)
	if res.FirstError != "" {
		fmt.Fprintf(stdout, "first error: %s\n", res.FirstError)
	}
	fmt.Fprintf(stdout, "throughput=%.0f/s decisions=%.0f/s p50=%v p99=%v p99.9=%v max=%v (concurrency=%d connections=%d keys=%d batch=%d elapsed=%v)\n",
		res.Throughput(), res.DecisionRate(), res.P50, res.P99, res.P999, res.Max, *conc, *conns, *keys, *batch, res.Elapsed.Round(time.Millisecond))
	return nil
}

// Spec describes one load run.
type Spec struct {
	Concurrency int
	Duration    time.Duration
	MaxRequests int64 // calls
	Keys        int
	Resource    string
	Batch       int // 0: CheckLimit; n: CheckLimits of n requests
}

// DecisionRate is decisions (checked requests) per second.
func (r Result) DecisionRate() float64 { return float64(r.Decisions) / r.Elapsed.Seconds() }

// Load runs sp.Concurrency callers until sp.Duration passes or sp.MaxRequests calls were sent.
// Requests counts calls; Decisions, Allowed, Rejected and FailOpen count
// checked requests (a CheckLimits call of n holds n).
func Load(ctx context.Context, clients []ratelimitv1.RateLimiterClient, sp Spec) Result {
	// Calls run on ctx (no deadline, so the server never answers
	// DeadlineExceeded at the end of the run); the loop stops at the deadline.
	concurrency, keys := sp.Concurrency, sp.Keys
	deadline := time.Now().Add(sp.Duration)
	keyNames := make([]string, keys)
	for i := range keyNames {
		keyNames[i] = fmt.Sprintf("load:%d", i)
	}
	var sent, errs, allowed, rejected, failOpen, decisions atomic.Int64
	var firstErr atomic.Value
	lat := make([][]time.Duration, concurrency)
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			c := clients[w%len(clients)]
			req := &ratelimitv1.CheckLimitRequest{Resource: sp.Resource, Cost: 1}
			var breq *ratelimitv1.CheckLimitsRequest
			if sp.Batch > 0 {
				breq = &ratelimitv1.CheckLimitsRequest{Requests: make([]*ratelimitv1.CheckLimitRequest, sp.Batch)}
				for j := range breq.Requests {
					breq.Requests[j] = &ratelimitv1.CheckLimitRequest{Resource: sp.Resource, Cost: 1}
				}
			}
			local := make([]time.Duration, 0, 4096)
			count := func(resp *ratelimitv1.CheckLimitResponse) {
				decisions.Add(1)
				switch {
				case resp.FailOpen:
					failOpen.Add(1)
				case resp.Allowed:
					allowed.Add(1)
				default:
					rejected.Add(1)
				}
			}
			for i := w; ctx.Err() == nil && time.Now().Before(deadline); i += concurrency {
				if sent.Add(1) > sp.MaxRequests {
					break
				}
				t0 := time.Now()
				var err error
				if breq == nil {
					req.ClientKey = keyNames[i%keys]
					var resp *ratelimitv1.CheckLimitResponse
					if resp, err = c.CheckLimit(ctx, req); err == nil {
						count(resp)
					}
				} else {
					for j, r := range breq.Requests {
						r.ClientKey = keyNames[(i*sp.Batch+j)%keys]
					}
					var resp *ratelimitv1.CheckLimitsResponse
					if resp, err = c.CheckLimits(ctx, breq); err == nil {
						for _, r := range resp.Responses {
							count(r)
						}
					}
				}
				d := time.Since(t0)
				if err != nil {
					if ctx.Err() == nil {
						if errs.Add(1) == 1 {
							firstErr.Store(err.Error())
						}
					}
					continue
				}
				local = append(local, d)
			}
			lat[w] = local
		}(w)
	}
	wg.Wait()
	elapsed := time.Since(start)
	var all []time.Duration
	for _, l := range lat {
		all = append(all, l...)
	}
	sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
	pct := func(p float64) time.Duration {
		if len(all) == 0 {
			return 0
		}
		return all[int(p*float64(len(all)-1))]
	}
	fe, _ := firstErr.Load().(string)
	return Result{FirstError: fe, Requests: int64(len(all)), Decisions: decisions.Load(), Errors: errs.Load(), Allowed: allowed.Load(), Rejected: rejected.Load(), FailOpen: failOpen.Load(),
		Elapsed: elapsed, P50: pct(0.50), P99: pct(0.99), P999: pct(0.999), Max: pct(1)}
}
