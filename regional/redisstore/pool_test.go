package redisstore

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
)

// Calls come from a pool and go back once answered (see call): many
// concurrent Dos of one and of several calls, some of whose callers give
// up at once (their calls are left to the collector, the worker may still
// hold them), each get the answers of their own buckets, in order. Run it
// with -race too: a call reused while a worker still held it would race.
func TestPooledCallsKeepTheirAnswers(t *testing.T) {
	e := newEnv(t, true)
	ctx := ctxT(t)
	const callers, dos = 16, 150
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for g := 0; g < callers; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for d := 0; d < dos; d++ {
				n := 1 + d%3 // one call, then several: a pooled call's array reused
				calls := make([]Call, n)
				want := make([]int64, n)
				for j := range calls {
					want[j] = int64(1000 + 10*g + j)
					calls[j] = Call{Cost: 1, Buckets: []Bucket{{Key: Key(fmt.Sprintf("pool:%d:%d", g, j), "tb"),
						Algorithm: rules.TokenBucket, Capacity: want[j] * 1000, Rate: want[j] * 1000}}}
				}
				cctx, cancel := ctx, context.CancelFunc(func() {})
				giveUp := d%7 == 3
				if giveUp {
					cctx, cancel = context.WithTimeout(ctx, time.Microsecond)
				}
				out := make([]Answer, n)
				e.store.Do(cctx, Budget{Queue: time.Second, RoundTrip: time.Second}, calls, out)
				cancel()
				for j, a := range out {
					switch {
					case a.Err != nil && giveUp:
					case a.Err != nil:
						errs <- fmt.Errorf("caller %d, Do %d, call %d: %v", g, d, j, a.Err)
						return
					case len(a.Results) != 1 || a.Results[0].Limit != want[j] || !a.Allowed:
						errs <- fmt.Errorf("caller %d, Do %d, call %d: %+v, want its own bucket's limit %d, allowed", g, d, j, a, want[j])
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestSharedScriptCallIsolatesErrors: the single checks of many callers
// share script calls (one per pipeline), and a check whose key holds
// another type fails alone, with Redis's error, while the checks around it
// in the same script call are answered from their own buckets.
func TestSharedScriptCallIsolatesErrors(t *testing.T) {
	e := newEnv(t, true, WithWorkers(1))
	ctx := ctxT(t)
	bad := Key("shared:bad", "tb")
	if err := e.client.RPush(ctx, bad, "x").Err(); err != nil {
		t.Fatal(err)
	}
	p0, c0 := e.store.Pipelines()
	const callers, checks = 24, 60
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for g := 0; g < callers; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for d := 0; d < checks; d++ {
				key, want := Key(fmt.Sprintf("shared:%d", g), "tb"), int64(1000+g)
				isBad := (g+d)%5 == 0
				if isBad {
					key = bad
				}
				out := make([]Answer, 1)
				e.store.Do(ctx, Budget{Queue: 5 * time.Second, RoundTrip: 5 * time.Second}, []Call{{Cost: 1, Buckets: []Bucket{{Key: key,
					Algorithm: rules.TokenBucket, Capacity: want * 1000, Rate: want * 1000}}}}, out)
				a := out[0]
				switch {
				case isBad && (a.Err == nil || !strings.Contains(a.Err.Error(), "WRONGTYPE")):
					errs <- fmt.Errorf("caller %d, check %d of the list key: %+v, want a WRONGTYPE error", g, d, a)
					return
				case !isBad && a.Err != nil:
					errs <- fmt.Errorf("caller %d, check %d: %v", g, d, a.Err)
					return
				case !isBad && (len(a.Results) != 1 || a.Results[0].Limit != want || !a.Allowed):
					errs <- fmt.Errorf("caller %d, check %d: %+v, want its own bucket's limit %d, allowed", g, d, a, want)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	p1, c1 := e.store.Pipelines()
	t.Logf("%d checks in %d pipelines", c1-c0, p1-p0)
	if p, c := p1-p0, c1-c0; c != callers*checks || p >= c {
		t.Errorf("%d checks in %d pipelines: want %d checks, some pipelines shared", c, p, callers*checks)
	}
}
