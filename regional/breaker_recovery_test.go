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

// breakerEnforcer is an enforcer on st with a breaker that stays open a
// minute and a store timeout of 50 ms, and a function that checks one key.
func breakerEnforcer(t *testing.T, st *fakeStore) (*Enforcer, func() Response) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Region, cfg.Logger, cfg.BreakerOpen, cfg.Timeout = "us-east", quietLogger(), time.Minute, 50*time.Millisecond
	enf, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	if err := enf.SetRules([]rules.Rule{tokenBucket("r", 1000000, 1000000)}); err != nil {
		t.Fatal(err)
	}
	return enf, func() Response {
		t.Helper()
		resp, err := enf.Check(context.Background(), Request{ClientKey: "k"})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
}

// A breaker opened by a stall (timeouts: Redis silent) stops sending checks
// to the failure policy as soon as Redis is heard answering again, though it
// stays open for its full time: a Redis that paused has not failed. While
// Redis stays silent (one check at a time, at most one per lookEvery, goes to
// look), or after a check past the breaker failed until Redis is heard
// again, the failure policy answers.
func TestStallBreakerLetsChecksThroughOnceRedisAnswers(t *testing.T) {
	st := &fakeStore{}
	enf, check := breakerEnforcer(t, st)
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
	if n, most := st.calls.Load()-before, int64(time.Since(t0)/time.Duration(enf.lookEvery()))+1; n > most {
		t.Fatalf("%d store calls in %v past an open breaker while Redis was silent, want at most one per %v (%d)", n, time.Since(t0), time.Duration(enf.lookEvery()), most)
	}
	// A look that takes long (Redis silent: each call waits out its
	// timeout): one check at a time goes to look, the others get the
	// failure policy at once.
	st.delay.Store(int64(30 * time.Millisecond))
	st.maxInFlight.Store(0)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for end := time.Now().Add(100 * time.Millisecond); time.Now().Before(end); {
				if resp := check(); !resp.FailOpen {
					t.Errorf("breaker open, Redis silent: %+v, want the failure policy", resp)
					return
				}
			}
		}()
	}
	wg.Wait()
	if n := st.maxInFlight.Load(); n != 1 {
		t.Fatalf("%d looks in flight at once past an open breaker, want 1", n)
	}
	st.delay.Store(0)
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

// A breaker opened by errors (Redis answering LOADING here; refusing or
// resetting connections alike) keeps the checks on the failure policy while
// Redis fails, however recently it replied (an error reply is not Redis
// back), with one check per lookEvery going to look; once a look succeeds
// the checks get the store's answers though the breaker stays open for its
// full time (a Redis that restarted and answers is not failing: before, the
// failure policy answered for the rest of the open second, about a second
// of checks after every Redis restart); a check past it that fails puts the
// next ones back on the failure policy until a newer success.
func TestErrorBreakerLetsChecksThroughOnceRedisSucceeds(t *testing.T) {
	st := &fakeStore{}
	enf, check := breakerEnforcer(t, st)
	loading := redisReply("LOADING Redis is loading the dataset in memory")
	st.set(loading, redisstore.Load{})
	st.heard.Store(true) // Redis replies (with errors)
	testutil.WaitFor(t, 5*time.Second, "the breaker to open", func() bool {
		check()
		return enf.BreakerState() == "open"
	})
	before, t0 := st.calls.Load(), time.Now()
	for i := range 200 {
		if resp := check(); !resp.FailOpen {
			t.Fatalf("check %d, breaker open on errors, Redis still failing: %+v, want the failure policy", i, resp)
		}
	}
	if n, most := st.calls.Load()-before, int64(time.Since(t0)/time.Duration(enf.lookEvery()))+1; n > most {
		t.Fatalf("%d store calls in %v past a breaker open on errors, want at most one per %v (%d)", n, time.Since(t0), time.Duration(enf.lookEvery()), most)
	}
	// Redis is back: within a --timeout a look succeeds, then every check
	// gets the store's answer; the breaker stays open.
	st.set(nil, redisstore.Load{})
	back := time.Now()
	testutil.WaitFor(t, 5*time.Second, "a check answered by the store", func() bool { return !check().FailOpen })
	if took, look := time.Since(back), time.Duration(enf.lookEvery()); took > 2*look {
		t.Errorf("the store answered again %v after it was back, want within a look (%v)", took, look)
	}
	for i := range 20 {
		if resp := check(); resp.FailOpen || !resp.Allowed || resp.Remaining != 9 {
			t.Fatalf("check %d after Redis succeeded again: %+v, want the store's answer", i, resp)
		}
	}
	if got := enf.BreakerState(); got != "open" {
		t.Fatalf("breaker %s, want still open (it waits its time and probes)", got)
	}
	// Redis fails again: the check past the breaker fails, and so do the
	// next ones, on the failure policy, without a newer success.
	st.set(loading, redisstore.Load{})
	for i := range 3 {
		if resp := check(); !resp.FailOpen {
			t.Fatalf("check %d, Redis failing again: %+v, want the failure policy", i, resp)
		}
	}
	st.set(nil, redisstore.Load{})
	testutil.WaitFor(t, 5*time.Second, "the store's answers again", func() bool { return !check().FailOpen })
}
