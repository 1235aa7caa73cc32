// Command rlload drives CheckLimit load at an enforcer over gRPC and reports
// throughput and latency percentiles.
//
//	rlload --addr 127.0.0.1:8081 --concurrency 64 --duration 10s --keys 1000
//	rlload --version
//
// Each worker sends one CheckLimit at a time on a shared connection pool;
// keys are spread uniformly over --keys client keys. The run is bounded by
// --duration and --max-requests, and it stops by itself.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/internal/version"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/redisstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "rlload:", err)
		os.Exit(1)
	}
}

// Result summarises one load run.
type Result struct {
	Requests   int64
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
	if err := flagenv.Parse(fs, args, nil); err != nil {
		return err
	}
	if *printScript {
		_, err := io.WriteString(stdout, redisstore.CheckScriptSource())
		return err
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
	res := Load(ctx, clients, *conc, *dur, *maxReq, *keys, *resource)
	fmt.Fprintf(stdout, "requests=%d errors=%d allowed=%d rejected=%d fail_open=%d\n", res.Requests, res.Errors, res.Allowed, res.Rejected, res.FailOpen)
	if res.FirstError != "" {
		fmt.Fprintf(stdout, "first error: %s\n", res.FirstError)
	}
	fmt.Fprintf(stdout, "throughput=%.0f/s p50=%v p99=%v p99.9=%v max=%v (concurrency=%d connections=%d keys=%d elapsed=%v)\n",
		res.Throughput(), res.P50, res.P99, res.P999, res.Max, *conc, *conns, *keys, res.Elapsed.Round(time.Millisecond))
	return nil
}

// Load runs concurrency callers until dur passes or maxReq requests were sent.
func Load(ctx context.Context, clients []ratelimitv1.RateLimiterClient, concurrency int, dur time.Duration, maxReq int64, keys int, resource string) Result {
	// Calls run on ctx (no deadline, so the server never answers
	// DeadlineExceeded at the end of the run); the loop stops at the deadline.
	deadline := time.Now().Add(dur)
	keyNames := make([]string, keys)
	for i := range keyNames {
		keyNames[i] = fmt.Sprintf("load:%d", i)
	}
	var sent, errs, allowed, rejected, failOpen atomic.Int64
	var firstErr atomic.Value
	lat := make([][]time.Duration, concurrency)
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			c := clients[w%len(clients)]
			req := &ratelimitv1.CheckLimitRequest{Resource: resource, Cost: 1}
			local := make([]time.Duration, 0, 4096)
			for i := w; ctx.Err() == nil && time.Now().Before(deadline); i += concurrency {
				if sent.Add(1) > maxReq {
					break
				}
				req.ClientKey = keyNames[i%keys]
				t0 := time.Now()
				resp, err := c.CheckLimit(ctx, req)
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
				switch {
				case resp.FailOpen:
					failOpen.Add(1)
				case resp.Allowed:
					allowed.Add(1)
				default:
					rejected.Add(1)
				}
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
	return Result{FirstError: fe, Requests: int64(len(all)), Errors: errs.Load(), Allowed: allowed.Load(), Rejected: rejected.Load(), FailOpen: failOpen.Load(),
		Elapsed: elapsed, P50: pct(0.50), P99: pct(0.99), P999: pct(0.999), Max: pct(1)}
}
