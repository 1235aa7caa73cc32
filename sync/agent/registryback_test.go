package agent

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/prometheus/client_golang/prometheus"
)

// cutRegistry is a Registry that refuses every call while cut, as etcd
// out of reach does, and counts the Starts it refused. With hang set, a
// Start while cut waits for its context's deadline instead (a request
// lost in the outage), and says on entered that it began.
type cutRegistry struct {
	Registry
	cut, hang atomic.Bool
	refused   atomic.Int32
	entered   chan struct{}
}

var errCut = errors.New("registry cut off (test)")

func (r *cutRegistry) Start(ctx context.Context, rule string, spec Spec, region string) (ledger.Start, Spec, error) {
	if r.cut.Load() {
		r.refused.Add(1)
		if r.hang.Load() {
			select {
			case r.entered <- struct{}{}:
			default:
			}
			<-ctx.Done()
			return ledger.Start{}, Spec{}, fmt.Errorf("%w: %w", errCut, ctx.Err())
		}
		return ledger.Start{}, Spec{}, errCut
	}
	return r.Registry.Start(ctx, rule, spec, region)
}

func (r *cutRegistry) Contribute(ctx context.Context, rule string, c ledger.Contribution) (ledger.Record, error) {
	if r.cut.Load() {
		return ledger.Record{}, errCut
	}
	return r.Registry.Contribute(ctx, rule, c)
}

func (r *cutRegistry) Close(ctx context.Context, rule string, by ledger.Incarnation) error {
	if r.cut.Load() {
		return errCut
	}
	return r.Registry.Close(ctx, rule, by)
}

func (r *cutRegistry) Records(ctx context.Context) (map[string]RuleRecords, error) {
	if r.cut.Load() {
		return nil, errCut
	}
	return r.Registry.Records(ctx)
}

// TestStartWhenRegistryBack: a rule whose start failed while the registry
// was out of reach starts as soon as a registry poll succeeds again, not
// when its backoff (up to 10 s) ends. Five refused starts (at 0, 0.2, 0.6,
// 1.4 and 3.0 s) leave a backoff of 3.2 s, then:
//   - waiting: the registry comes back right after the fifth, and the
//     incarnation must start within the poll's longest wait after failures
//     (4 x RegistryPoll, 800 ms here) plus a round trip, well before the
//     backoff ends (before registryBack: 3.2 s later);
//   - in flight: the sixth start is lost in the outage (it waits for its
//     EtcdTimeout of 2 s) and the registry comes back as it is sent; a poll
//     succeeds meanwhile, and when the lost start fails the next goes at
//     once: within EtcdTimeout and a second, where its backoff would have
//     been 6.4 s.
func TestStartWhenRegistryBack(t *testing.T) {
	for _, inFlight := range []bool{false, true} {
		name := "waiting"
		if inFlight {
			name = "in flight"
		}
		t.Run(name, func(t *testing.T) { registryBackCase(t, inFlight) })
	}
}

func registryBackCase(t *testing.T, inFlight bool) {
	cluster := testutil.StartSuperCluster(t, "a")
	ec := testutil.StartEtcd(t).Client(t)
	w := &world{}
	mem := newMemStore(w, "a")
	cfg := testConfig("a", t)
	cfg.Metrics = prometheus.NewRegistry()
	cfg.EtcdTimeout = 2 * time.Second
	reg := &cutRegistry{Registry: NewEtcdRegistry(ec, "", cfg.LedgerConfig()), entered: make(chan struct{}, 1)}
	reg.cut.Store(true)
	watcher, err := etcdstore.NewWatcher(ec, etcdstore.WithLogger(cfg.Logger))
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(cfg, mem, cluster["a"].Connect(t), reg, watcher)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := a.Close(ctx); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	st, err := etcdstore.New(ec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Put(context.Background(), globalRule(), 0); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, "five refused starts", func() bool { return reg.refused.Load() >= 5 })
	bound := 4*cfg.RegistryPoll + time.Second
	if inFlight {
		reg.hang.Store(true)
		select {
		case <-reg.entered:
		case <-time.After(20 * time.Second):
			t.Fatal("no sixth start")
		}
		bound = cfg.EtcdTimeout + time.Second
	}
	reg.cut.Store(false)
	back := time.Now()
	testutil.WaitFor(t, 20*time.Second, "an incarnation", func() bool { return a.Incarnation(testRule) > 0 })
	took := time.Since(back)
	t.Logf("started %v after the registry came back (refused starts: %d)", took.Round(time.Millisecond), reg.refused.Load())
	if took > bound {
		t.Fatalf("started %v after the registry came back, want within %v", took, bound)
	}
}
