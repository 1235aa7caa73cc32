package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/nats-io/nats.go"
)

// getShares GETs base+SharesPath with the query and decodes the answer.
func getShares(t *testing.T, base string, q url.Values) (int, RuleShares, sharesError) {
	t.Helper()
	resp, err := http.Get(base + SharesPath + "?" + q.Encode())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("Content-Type %q, body %s", ct, body)
	}
	var ok RuleShares
	var bad sharesError
	if resp.StatusCode == http.StatusOK {
		err = json.Unmarshal(body, &ok)
	} else {
		err = json.Unmarshal(body, &bad)
		if err == nil && bad.Error == "" {
			t.Fatalf("status %d without an error message: %s", resp.StatusCode, body)
		}
	}
	if err != nil {
		t.Fatalf("status %d, body %s: %v", resp.StatusCode, body, err)
	}
	return resp.StatusCode, ok, bad
}

func TestSharesHandlerRequests(t *testing.T) {
	srv := httptest.NewServer(SharesHandler(func() *Agent { return nil }))
	t.Cleanup(srv.Close)
	for _, tc := range []struct {
		name  string
		query url.Values
		code  int
		want  string
	}{
		{"no rule", url.Values{}, http.StatusBadRequest, "rule is required"},
		{"limit zero", url.Values{"rule": {"r"}, "limit": {"0"}}, http.StatusBadRequest, "limit"},
		{"limit negative", url.Values{"rule": {"r"}, "limit": {"-5"}}, http.StatusBadRequest, "limit"},
		{"limit not a number", url.Values{"rule": {"r"}, "limit": {"ten"}}, http.StatusBadRequest, "limit"},
		{"limit above the max", url.Values{"rule": {"r"}, "limit": {"10001"}}, http.StatusBadRequest, "10000"},
		{"no agent", url.Values{"rule": {"r"}}, http.StatusServiceUnavailable, "standby"},
		{"max limit, no agent", url.Values{"rule": {"r"}, "limit": {"10000"}}, http.StatusServiceUnavailable, "standby"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, e := getShares(t, srv.URL, tc.query)
			if code != tc.code || !strings.Contains(e.Error, tc.want) {
				t.Fatalf("got %d %q, want %d with %q", code, e.Error, tc.code, tc.want)
			}
		})
	}
	resp, err := http.Post(srv.URL+SharesPath+"?rule=r", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != "GET, HEAD" {
		t.Fatalf("POST: %d, Allow %q", resp.StatusCode, resp.Header.Get("Allow"))
	}
}

func TestShareOf(t *testing.T) {
	for _, tc := range []struct{ x, u, total, want int64 }{
		{10_000, 250_000, 1_000_000, 2_500},              // 10/s, a quarter: 2.5/s in thousandths
		{1_000_000_000, 333_333, 1_000_000, 333_333_000}, // 10^6/s
		{7, 1, 3, 2},
		{7, 3, 3, 7},
		{7, 4, 3, 7},                         // clamped to the whole
		{7, -1, 3, 0},                        // clamped to nothing
		{7, 1, 0, 0},                         // no total
		{1 << 62, 1 << 25, 1 << 26, 1 << 61}, // no overflow
	} {
		if got := shareOf(tc.x, tc.u, tc.total); got != tc.want {
			t.Errorf("shareOf(%d, %d, %d) = %d, want %d", tc.x, tc.u, tc.total, got, tc.want)
		}
	}
}

// publishUsage sends one usage batch of rule to region's agent.
func publishUsage(t *testing.T, nc *nats.Conn, region string, seq uint64, ds ...usage.Delta) {
	t.Helper()
	b, err := usage.Encode(usage.Batch{Region: region, Enforcer: "test", Seq: seq, Deltas: ds})
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish(usage.Subject(region), b); err != nil {
		t.Fatal(err)
	}
}

// checkShares checks v's invariants for rule r: keys sorted by units
// descending then key, every key's rate and burst what the store enforces.
func checkShares(t *testing.T, v RuleShares, r rules.Rule) {
	t.Helper()
	if v.Units <= 0 || v.Floor <= 0 || v.Floor > v.Units || v.TotalKeys < len(v.Keys) {
		t.Fatalf("bad header: %+v", v)
	}
	if !slices.IsSortedFunc(v.Keys, func(x, y RuleShareKey) int {
		if x.Units != y.Units {
			if x.Units > y.Units {
				return -1
			}
			return 1
		}
		return strings.Compare(x.Key, y.Key)
	}) {
		t.Fatalf("keys not sorted by units descending: %+v", v.Keys)
	}
	for _, k := range v.Keys {
		if k.Units < v.Floor || k.Units > v.Units {
			t.Fatalf("key %s: units %d outside [floor %d, %d]", k.Key, k.Units, v.Floor, v.Units)
		}
		// The store's arithmetic, in thousandths of a token.
		wantRate := float64(int64(r.RefillPerSecond*1000)*k.Units/v.Units) / 1000
		wantBurst := float64(r.Capacity*1000*k.Units/v.Units) / 1000
		if k.Rate != wantRate || k.Burst != wantBurst {
			t.Fatalf("key %s (%d of %d units): rate %v burst %v, want %v %v", k.Key, k.Units, v.Units, k.Rate, k.Burst, wantRate, wantBurst)
		}
	}
}

// TestSharesHandlerContractStore serves a region's agent of the
// three-region stack (contract store) and checks the answer against the
// agent's own state while demand in a moves share to a.
func TestSharesHandlerContractStore(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	w := &world{}
	s := newStack(t, func(n string) (Store, *memStore) {
		m := newMemStore(w, n)
		return m, m
	})
	s.world = w
	big := globalRule()
	small := globalRule()
	small.ID, small.Capacity, small.RefillPerSecond = "small", 25, 10
	regional := globalRule()
	regional.ID, regional.Scope, regional.Regions, regional.MinShare = "regional", rules.Regional, nil, 0
	for _, r := range []rules.Rule{big, small, regional} {
		s.putRule(t, r)
	}
	a := s.regions["a"].agent
	srv := httptest.NewServer(SharesHandler(func() *Agent { return a }))
	t.Cleanup(srv.Close)
	for _, id := range []string{big.ID, small.ID} {
		testutil.WaitFor(t, 20*time.Second, "incarnation of "+id, func() bool { return a.Incarnation(id) > 0 })
	}

	// Demand in a on three keys of each rule, heavier on k1.
	nc := s.cluster["a"].Connect(t)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(50 * time.Millisecond)
		defer tk.Stop()
		for seq := uint64(1); ; seq++ {
			select {
			case <-stop:
				return
			case <-tk.C:
			}
			var ds []usage.Delta
			for _, id := range []string{big.ID, small.ID} {
				ds = append(ds, usage.Delta{Rule: id, Key: "k1", Admitted: 100_000, Rejected: 50_000},
					usage.Delta{Rule: id, Key: "k2", Admitted: 10_000},
					usage.Delta{Rule: id, Key: "k3", Admitted: 1_000})
			}
			b, _ := usage.Encode(usage.Batch{Region: "a", Enforcer: "test", Seq: seq, Deltas: ds})
			nc.Publish(usage.Subject("a"), b)
		}
	}()
	t.Cleanup(func() { close(stop); <-done })

	q := func(rule string, limit int) url.Values {
		v := url.Values{"rule": {rule}}
		if limit > 0 {
			v.Set("limit", fmt.Sprint(limit))
		}
		return v
	}
	var last RuleShares
	testutil.WaitFor(t, 30*time.Second, "k1 of both rules to hold more than half of the limit in a", func() bool {
		for _, id := range []string{big.ID, small.ID} {
			code, v, e := getShares(t, srv.URL, q(id, 0))
			if code != http.StatusOK {
				t.Fatalf("%s: %d %s", id, code, e.Error)
			}
			if len(v.Keys) < 3 || v.Keys[0].Key != "k1" || v.Keys[0].Units <= v.Units/2 {
				return false
			}
			last = v
		}
		return true
	})
	checkShares(t, last, small)
	if last.Region != "a" || last.Rule != small.ID || last.Fenced || last.Incarnation != a.Incarnation(small.ID) || last.Units != 1_000_000 {
		t.Fatalf("header: %+v (agent incarnation %d)", last, a.Incarnation(small.ID))
	}
	t.Logf("small in a: %+v", last)

	// Against the agent's own state (both read from one tick's snapshot
	// when no tick falls between them: retry until that happens).
	testutil.WaitFor(t, 10*time.Second, "an answer equal to Shares", func() bool {
		before := a.Shares(big.ID)
		_, v, _ := getShares(t, srv.URL, q(big.ID, MaxSharesLimit))
		after := a.Shares(big.ID)
		checkShares(t, v, big)
		if len(v.Keys) != len(before) || v.TotalKeys != len(before) {
			return false
		}
		for _, k := range v.Keys {
			if before[k.Key] != k.Units || after[k.Key] != k.Units {
				return false
			}
			// rate 10^6/s, capacity 10^6 over 10^6 units: one token per unit.
			if k.Rate != float64(k.Units) || k.Burst != float64(k.Units) {
				t.Fatalf("%+v", k)
			}
		}
		return true
	})

	// limit: the first keys of the full answer.
	_, v, _ := getShares(t, srv.URL, q(big.ID, 2))
	if len(v.Keys) != 2 || v.TotalKeys < 3 || v.Keys[0].Key != "k1" {
		t.Fatalf("limit=2: %+v", v)
	}

	for _, id := range []string{"nope", regional.ID} {
		code, _, e := getShares(t, srv.URL, q(id, 0))
		if code != http.StatusNotFound || e.Region != "a" || !strings.Contains(e.Error, id) {
			t.Fatalf("%s: %d %+v", id, code, e)
		}
	}

	// A closed agent answers 503.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if code, _, e := getShares(t, srv.URL, q(big.ID, 0)); code != http.StatusServiceUnavailable {
		t.Fatalf("closed agent: %d %+v", code, e)
	}
}
