package agent

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/ledger"
)

// chanSource is a rule source that hands on each rule set sent on it.
type chanSource chan []rules.Rule

func (c chanSource) Run(ctx context.Context, update func([]rules.Rule)) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case rs := <-c:
			update(rs)
		}
	}
}

// refusingRegistry refuses every change: an agent that uses it never starts
// an incarnation.
type refusingRegistry struct{}

var errRefused = errors.New("registry refuses (test)")

func (refusingRegistry) Start(context.Context, string, Spec, string) (ledger.Start, Spec, error) {
	return ledger.Start{}, Spec{}, errRefused
}
func (refusingRegistry) Contribute(context.Context, string, ledger.Contribution) (ledger.Record, error) {
	return ledger.Record{}, errRefused
}
func (refusingRegistry) Close(context.Context, string, ledger.Incarnation) error { return errRefused }
func (refusingRegistry) Records(context.Context) (map[string]RuleRecords, error) {
	return map[string]RuleRecords{}, nil
}

// TestNothingToCoordinate: an agent whose rule prefix holds no rules, or
// whose region no global rule lists (syncagent --region mars), is ready
// with nothing to coordinate, and its log said only "report dropped
// reason=unknown_rule" at every peer report. It warns, for every rule set
// that leaves it so, naming the prefix or the region, and says nothing of
// the kind once a rule lists its region.
func TestNothingToCoordinate(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts NATS")
	}
	log := &testutil.SyncBuffer{}
	cfg := testConfig("a", t)
	cfg.Logger = slog.New(slog.NewTextHandler(log, nil))
	cfg.RulePrefix = "/elsewhere/rules/"
	src := make(chanSource)
	a, err := New(cfg, newMemStore(&world{}, "a"), testutil.StartNATS(t).Connect(t), refusingRegistry{}, src)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		a.Close(ctx)
	})
	elsewhere := globalRule()
	elsewhere.Regions = map[string]float64{"b": 1, "c": 1}
	regional := rules.Rule{ID: "local", Key: []string{"client_key"}, Algorithm: rules.TokenBucket, Capacity: 10, RefillPerSecond: 10}
	lines := func(s string) int { return strings.Count(log.String(), s) }
	for i, tc := range []struct {
		rules []rules.Rule
		warn  string // "": none
	}{
		{nil, `msg="no rules under the rule prefix: this agent has nothing to coordinate (check --etcd-prefix)" prefix=/elsewhere/rules/`},
		{[]rules.Rule{elsewhere}, `msg="no global rule lists region a: this agent has nothing to coordinate (check --region)" prefix=/elsewhere/rules/ global_rules=1 regions_listed=b,c`},
		{[]rules.Rule{elsewhere, regional}, `msg="no global rule lists region a`}, // changed, still so: again
		{[]rules.Rule{regional}, `msg="no global rule under the rule prefix`},
		{[]rules.Rule{globalRule()}, ""},
	} {
		before := lines("nothing to coordinate")
		seen := lines(tc.warn)
		src <- tc.rules
		if tc.warn != "" {
			testutil.WaitFor(t, 5*time.Second, "the warning "+tc.warn, func() bool { return lines(tc.warn) > seen })
			testutil.WaitFor(t, 5*time.Second, "the agent to be ready", a.Ready)
			continue
		}
		time.Sleep(500 * time.Millisecond) // the set applied
		if n := lines("nothing to coordinate"); n != before {
			t.Errorf("rule set %d lists region a, and the log says it has nothing to coordinate:\n%s", i, log.String())
		}
	}
}
