package regional

import (
	"context"
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
