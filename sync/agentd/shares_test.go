package agentd

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/apportion/apportion/sync/agent"
	"github.com/nats-io/nats.go"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// sharesError is the error body of the shares endpoint.
type sharesError struct {
	Error  string `json:"error"`
	Region string `json:"region,omitempty"`
}

// TestSharesEndpointRunCommand queries the endpoint of the real command
// (Redis, NATS, etcd) for a rule it coordinates alone.
func TestSharesEndpointRunCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	r := testutil.StartRedis(t)
	ns := testutil.StartNATS(t)
	e := testutil.StartEtcd(t)
	rc := startCommand(t, "--region", "solo", "--redis-addr", r.Addr, "--nats-url", ns.ClientURL(), "--etcd-endpoints", e.Endpoint,
		"--http-addr", "127.0.0.1:0", "--interval", "50ms", "--report-seed-file", testSeedFile(t, "solo"))
	base := "http://" + rc.http
	code, _, bad := getShares(t, base, url.Values{"rule": {"orders"}})
	if code != http.StatusNotFound && code != http.StatusServiceUnavailable {
		t.Fatalf("before any rule: %d %+v", code, bad)
	}

	rule := rules.Rule{ID: "orders", Key: []string{"client_key"}, Algorithm: rules.TokenBucket, Capacity: 30, RefillPerSecond: 12.5,
		Scope: rules.Global, Regions: map[string]float64{"solo": 1}, MinShare: 0.2}
	putRuleEtcd(t, e.Client(t), rule)
	nc := ns.Connect(t)
	var v agent.RuleShares
	seq := uint64(0)
	testutil.WaitFor(t, 20*time.Second, "the key to be coordinated", func() bool {
		seq++
		publishUsage(t, nc, "solo", seq, usage.Delta{Rule: "orders", Key: "rl:{user:1}:orders", Admitted: 5})
		var code int
		code, v, _ = getShares(t, base, url.Values{"rule": {"orders"}, "limit": {"10"}})
		return code == http.StatusOK && len(v.Keys) == 1
	})
	checkShares(t, v, rule)
	// One region holds the whole limit.
	if k := v.Keys[0]; v.Region != "solo" || v.Fenced || v.Incarnation == 0 || k.Key != "rl:{user:1}:orders" ||
		k.Units != v.Units || k.Rate != 12.5 || k.Burst != 30 {
		t.Fatalf("%+v", v)
	}
	if code, _, bad := getShares(t, base, url.Values{"rule": {"nope"}}); code != http.StatusNotFound || bad.Region != "solo" {
		t.Fatalf("unknown rule: %d %+v", code, bad)
	}
	if code, _, _ := getShares(t, base, url.Values{"rule": {"orders"}, "limit": {"x"}}); code != http.StatusBadRequest {
		t.Fatalf("bad limit: %d", code)
	}
}

// getShares GETs base+agent.SharesPath with the query and decodes the answer.
func getShares(t *testing.T, base string, q url.Values) (int, agent.RuleShares, sharesError) {
	t.Helper()
	resp, err := http.Get(base + agent.SharesPath + "?" + q.Encode())
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
	var ok agent.RuleShares
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
func checkShares(t *testing.T, v agent.RuleShares, r rules.Rule) {
	t.Helper()
	if v.Units <= 0 || v.Floor <= 0 || v.Floor > v.Units || v.TotalKeys < len(v.Keys) {
		t.Fatalf("bad header: %+v", v)
	}
	if !slices.IsSortedFunc(v.Keys, func(x, y agent.RuleShareKey) int {
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

func putRuleEtcd(t *testing.T, ec *clientv3.Client, r rules.Rule) {
	t.Helper()
	st, err := etcdstore.New(ec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Put(context.Background(), r, 0); err != nil {
		t.Fatal(err)
	}
}
