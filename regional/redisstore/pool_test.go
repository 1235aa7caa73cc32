package redisstore

import (
	"context"
	"fmt"
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
