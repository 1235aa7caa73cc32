package agent

import (
	"context"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// scrape serves r's registry as agentd's /metrics does and returns the
// status and the body.
func scrape(r *testRegion) (int, string) {
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(r.reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	return rec.Code, rec.Body.String()
}

// publishUntil publishes b on region's usage subject every 50 ms until
// the test ends.
func publishUntil(t *testing.T, s *stack, region string, b usage.Batch) {
	t.Helper()
	data, err := usage.Encode(b)
	if err != nil {
		t.Fatal(err)
	}
	nc := s.cluster[region].Connect(t)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(50 * time.Millisecond)
		defer tk.Stop()
		for {
			nc.Publish(usage.Subject(region), data)
			select {
			case <-stop:
				return
			case <-tk.C:
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
}

// TestInvalidUTF8Keys: a usage delta whose key is not valid UTF-8 (no
// enforcer sends one: anyone who can publish on the usage subject can) is
// dropped and counted, and the other deltas of its batch apply; /metrics
// answers 200 all along, in the region and in its peers. And a key that
// is not valid UTF-8 held by a ledger anyway (here put into a's ledger
// directly, as a peer's report could carry it) reaches b's ledger by
// a's reports, and b's /metrics still answers 200, with the key's series
// under a label made valid. Before, the key became a label value of
// apportion_sync_share_units and every scrape of the agents holding it
// failed with 500 ("label value ... is not valid UTF-8").
func TestInvalidUTF8Keys(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts NATS and etcd")
	}
	s := memStack(t, []string{"a", "b", "c"})
	s.putRule(t, globalRule())
	s.waitIncarnations(t)
	a, b := s.regions["a"], s.regions["b"]
	const good1, good2, bad = "rl:{good1}:orders", "rl:{good2}:orders", "rl:{bad\xff\xfe}:orders"
	dropped0 := metricValue(a.agent.m.usageDropped)
	publishUntil(t, s, "a", usage.Batch{Region: "a", Enforcer: "rogue", Seq: 1, Deltas: []usage.Delta{
		{Rule: testRule, Key: good1, Admitted: 200_000},
		{Rule: testRule, Key: bad, Admitted: 200_000},
		{Rule: testRule, Key: good2, Admitted: 100_000, Rejected: 100_000},
		{Rule: "orders\xc3", Key: good1, Admitted: 1},
	}})
	testutil.WaitFor(t, 20*time.Second, "a's ledger holding the batch's valid keys, and b's", func() bool {
		sa, sb := a.agent.Shares(testRule), b.agent.Shares(testRule)
		_, a1 := sa[good1]
		_, a2 := sa[good2]
		_, b1 := sb[good1]
		return a1 && a2 && b1
	})
	if d := metricValue(a.agent.m.usageDropped) - dropped0; d < 2 {
		t.Errorf("the invalid deltas were not counted as dropped: %v", d)
	}
	for _, r := range []*testRegion{a, b} {
		if _, ok := r.agent.Shares(testRule)[bad]; ok {
			t.Errorf("%s's ledger holds the key that is not valid UTF-8", r.name)
		}
		if code, body := scrape(r); code != http.StatusOK || !strings.Contains(body, good1) {
			t.Fatalf("%s's /metrics answered %d:\n%.2000s", r.name, code, body)
		}
	}

	// A ledger holding such a key anyway: its peers' /metrics answer.
	testutil.WaitFor(t, 20*time.Second, "b's ledger holding the key a's ledger holds", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		a.agent.onLoop(ctx, func() {
			if st := a.agent.rules[testRule]; st != nil && st.Led != nil {
				st.Led.Usage(a.agent.now(), bad, usageRate(st.rule), 300_000, 0)
			}
		})
		cancel()
		_, ok := b.agent.Shares(testRule)[bad]
		return ok
	})
	for _, r := range []*testRegion{a, b} {
		code, body := scrape(r)
		if code != http.StatusOK {
			t.Fatalf("%s's /metrics answered %d:\n%.2000s", r.name, code, body)
		}
		if !strings.Contains(body, strings.ToValidUTF8(bad, "\uFFFD")) {
			t.Errorf("%s's /metrics has no series for the key, its label made valid:\n%.3000s", r.name, body)
		}
	}
}

// TestUsageDeltasTakenAlone: onUsage drops a delta whose rule or key is
// not valid UTF-8 (counted), applies the others of its batch, and adds
// counts of any size with saturation: 2^62 + 2^62 and math.MaxInt64
// twice stay math.MaxInt64 instead of wrapping negative.
func TestUsageDeltasTakenAlone(t *testing.T) {
	a := &Agent{cfg: Config{MaxUsageKeys: 100}, m: newMetrics("a", nil, nil), logs: logsample.New(testLogger(t), time.Minute)}
	a.onUsage(usage.Batch{Deltas: []usage.Delta{
		{Rule: testRule, Key: "k1", Admitted: 1 << 62, Rejected: 1},
		{Rule: testRule, Key: "bad\xff", Admitted: 5},
		{Rule: testRule, Key: "k1", Admitted: 1 << 62, Rejected: math.MaxInt64},
		{Rule: "r\xc3", Key: "k2", Admitted: 5},
		{Rule: testRule, Key: "k2", Admitted: math.MaxInt64, Rejected: 3},
	}})
	a.onUsage(usage.Batch{Deltas: []usage.Delta{{Rule: testRule, Key: "k2", Admitted: math.MaxInt64, Rejected: 4}}})
	ks := a.usage.rules[testRule]
	if len(ks) != 2 || len(a.usage.rules) != 1 || a.usage.n != 2 {
		t.Fatalf("usage held: %v (%d keys)", a.usage.rules, a.usage.n)
	}
	if c := ks["k1"]; c.admitted != math.MaxInt64 || c.rejected != math.MaxInt64 {
		t.Errorf("k1: %+v, want both saturated", c)
	}
	if c := ks["k2"]; c.admitted != math.MaxInt64 || c.rejected != 7 {
		t.Errorf("k2: %+v", c)
	}
	if d := metricValue(a.m.usageDropped); d != 2 {
		t.Errorf("dropped %v deltas, want 2", d)
	}
}

// TestShareCollectorNeverPanics: the hottest keys' series are collected
// whatever the keys: labels that are not valid UTF-8 are made valid, and
// two keys that then have the same labels make one series, so that the
// registry's Gather (/metrics) never fails.
func TestShareCollectorNeverPanics(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts NATS and etcd")
	}
	s := memStack(t, []string{"a", "b"}, func(c *Config) { c.PeerKeys = testPeerKeys(t, "a", "b") })
	r := globalRule()
	r.Regions = map[string]float64{"a": 1, "b": 1}
	s.putRule(t, r)
	s.waitIncarnations(t)
	a := s.regions["a"]
	keys := []string{"k\xff", "k\xfe", "k\uFFFD", "\xc3", "ok"}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.agent.onLoop(ctx, func() {
		st := a.agent.rules[testRule]
		for i, k := range keys {
			st.Led.Usage(a.agent.now(), k, usageRate(st.rule), int64(1000*(i+1)), 0)
		}
	}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the keys held with their demand", func() bool {
		hot := a.agent.hottest(20)
		return len(hot) >= len(keys) && hot[0].Demand > 0
	})
	mfs, err := a.reg.Gather()
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	n := 0
	for _, mf := range mfs {
		if mf.GetName() == "apportion_sync_share_units" {
			n = len(mf.GetMetric())
		}
	}
	if n != 3 { // "k\uFFFD" (three keys), "\uFFFD", "ok"
		t.Errorf("%d series of apportion_sync_share_units, want 3", n)
	}
}
