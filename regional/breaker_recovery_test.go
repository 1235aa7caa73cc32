package regional

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
)

// Once the store answers again, a half-open breaker closes after its probes
// succeed, also with more checks in flight than it lets probe: no check is
// answered by the failure policy once it has closed. (A success counted as
// "excluded" kept it half-open for good; internal/faultsuite found it.)
func TestBreakerClosesAfterTheStoreReturns(t *testing.T) {
	st := &fakeStore{}
	cfg := DefaultConfig()
	cfg.Region, cfg.Logger, cfg.BreakerOpen = "us-east", quietLogger(), 20*time.Millisecond
	enf, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	if err := enf.SetRules([]rules.Rule{tokenBucket("r", 1000000, 1000000)}); err != nil {
		t.Fatal(err)
	}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	st.set(refused, redisstore.Load{})
	testutil.WaitFor(t, 5*time.Second, "the breaker to open", func() bool {
		_, _ = enf.Check(context.Background(), Request{ClientKey: "k"})
		return enf.BreakerState() == "open"
	})
	st.set(nil, redisstore.Load{})
	// Eight checks at a time, more than the breaker's probes.
	testutil.WaitFor(t, 5*time.Second, "the breaker to close", func() bool {
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _ = enf.Check(context.Background(), Request{ClientKey: "k"})
			}()
		}
		wg.Wait()
		return enf.BreakerState() == "closed"
	})
	for i := range 50 {
		resp, err := enf.Check(context.Background(), Request{ClientKey: "k"})
		if err != nil || resp.FailOpen {
			t.Fatalf("check %d after the breaker closed: %+v %v, want an answer from the store", i, resp, err)
		}
	}
}

// A breaker opened by a stall (timeouts: Redis silent) stops sending checks
// to the failure policy as soon as Redis is heard answering again, though it
// stays open for its full time: a Redis that paused has not failed. While
// Redis stays silent, or after a check past the breaker failed until Redis
// is heard again, the failure policy answers.
func TestStallBreakerLetsChecksThroughOnceRedisAnswers(t *testing.T) {
	st := &fakeStore{}
	cfg := DefaultConfig()
	cfg.Region, cfg.Logger, cfg.BreakerOpen, cfg.Timeout = "us-east", quietLogger(), time.Minute, 50*time.Millisecond
	enf, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	if err := enf.SetRules([]rules.Rule{tokenBucket("r", 1000000, 1000000)}); err != nil {
		t.Fatal(err)
	}
	check := func() Response {
		t.Helper()
		resp, err := enf.Check(context.Background(), Request{ClientKey: "k"})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	st.set(fmt.Errorf("%w: no answer from Redis for 60ms", redisstore.ErrTimeout), redisstore.Load{Answered: time.Now()})
	testutil.WaitFor(t, 5*time.Second, "the breaker to open", func() bool {
		check()
		return enf.BreakerState() == "open"
	})
	// Open, Redis heard last before the trip: the failure policy answers,
	// and at most one check per timeout goes to look.
	st.set(fmt.Errorf("%w: no answer from Redis for 60ms", redisstore.ErrTimeout), redisstore.Load{Answered: time.Now().Add(-time.Second)})
	before, t0 := st.calls.Load(), time.Now()
	for i := range 200 {
		if resp := check(); !resp.FailOpen {
			t.Fatalf("check %d, breaker open, Redis silent: %+v, want the failure policy", i, resp)
		}
	}
	if n, most := st.calls.Load()-before, int64(time.Since(t0)/cfg.Timeout)+1; n > most {
		t.Fatalf("%d store calls in %v past an open breaker while Redis was silent, want at most one per %v (%d)", n, time.Since(t0), cfg.Timeout, most)
	}
	// Redis answers again: checks get the store's answers, the breaker
	// stays open.
	st.set(nil, redisstore.Load{})
	st.heard.Store(true)
	for i := range 20 {
		if resp := check(); resp.FailOpen || !resp.Allowed || resp.Remaining != 9 {
			t.Fatalf("check %d after Redis answered again: %+v, want the store's answer", i, resp)
		}
	}
	if got := enf.BreakerState(); got != "open" {
		t.Fatalf("breaker %s, want still open (it waits its time and probes)", got)
	}
	// A check past the breaker times out (Redis stalled again): the next
	// ones wait for a newer answer, on the failure policy meanwhile.
	st.heard.Store(false)
	st.set(fmt.Errorf("%w: no answer from Redis for 60ms", redisstore.ErrTimeout), redisstore.Load{Answered: time.Now()})
	if resp := check(); !resp.FailOpen {
		t.Fatalf("check past the breaker, Redis stalled again: %+v, want the failure policy", resp)
	}
	if resp := check(); !resp.FailOpen {
		t.Fatalf("after a failed check past the breaker: %+v, want the failure policy", resp)
	}
	st.set(nil, redisstore.Load{})
	st.heard.Store(true)
	if resp := check(); resp.FailOpen {
		t.Fatalf("Redis answering again: %+v, want the store's answer", resp)
	}
}

// A breaker opened by errors (Redis refusing) is not bypassed however
// recently Redis was heard: only a stall that ended is.
func TestErrorBreakerIsNotBypassed(t *testing.T) {
	st := &fakeStore{}
	cfg := DefaultConfig()
	cfg.Region, cfg.Logger, cfg.BreakerOpen = "us-east", quietLogger(), time.Minute
	enf, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	if err := enf.SetRules([]rules.Rule{tokenBucket("r", 1000000, 1000000)}); err != nil {
		t.Fatal(err)
	}
	st.set(redisReply("LOADING Redis is loading the dataset in memory"), redisstore.Load{})
	st.heard.Store(true)
	testutil.WaitFor(t, 5*time.Second, "the breaker to open", func() bool {
		_, _ = enf.Check(context.Background(), Request{ClientKey: "k"})
		return enf.BreakerState() == "open"
	})
	st.set(nil, redisstore.Load{})
	before := st.calls.Load()
	resp, err := enf.Check(context.Background(), Request{ClientKey: "k"})
	if err != nil || !resp.FailOpen || st.calls.Load() != before {
		t.Fatalf("error-opened breaker: %+v %v, store calls %d -> %d; want the failure policy without the store", resp, err, before, st.calls.Load())
	}
}
