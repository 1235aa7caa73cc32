package faultsuite

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/rs/zerolog"
)

// etcdRecoverBound is how long after an etcd fault ends a rule written
// during it must be enforced: the client reconnects at least every second
// (internal/backend), then the watch resumes from its revision.
const etcdRecoverBound = 10 * time.Second

// TestEtcdFaults runs load through ratelimitd, which watches its rules in
// etcd through a toxiproxy proxy, while the proxy resets or refuses
// connections: checks keep their rules and are answered from Redis (etcd is
// not on the check path), and a rule written to etcd during the fault is
// enforced within etcdRecoverBound after it ends.
func TestEtcdFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("fault suite: starts redis-server, etcd and ratelimitd")
	}
	zerolog.SetGlobalLevel(zerolog.Disabled)
	t.Cleanup(func() { zerolog.SetGlobalLevel(zerolog.TraceLevel) })
	r := testutil.StartRedis(t)
	etcd := testutil.StartEtcd(t)
	cli := etcd.Client(t)
	put := func(id, resource, mode string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := cli.Put(ctx, "/ratelimit/rules/"+id, fmt.Sprintf(`{"id":%q,"match":{"resource":%q},"algorithm":"token_bucket",`+
			`"capacity":%d,"refill_per_second":%d,"failure_mode":%q}`, id, resource, capacity, refill, mode)); err != nil {
			t.Fatal(err)
		}
	}
	put("open", "GET /open", "open")
	put("closed", "GET /closed", "closed")
	proxy := newProxy(t, "etcd", strings.TrimPrefix(etcd.Endpoint, "http://"))
	g := runEnforcer(t, "--redis-addr", r.Addr, "--etcd-endpoints", "http://"+proxy.Listen)

	for _, c := range []faultCase{
		{name: "reset_peer", toxics: []string{toxic("reset", "reset_peer", "upstream", `"timeout":0`), toxic("reset-down", "reset_peer", "downstream", `"timeout":0`)}},
		{name: "refused"},
	} {
		t.Run(c.name, func(t *testing.T) {
			g.healthy(t, "etcd-"+c.name+"-before")
			if len(c.toxics) == 0 {
				proxy.Stop()
			}
			for _, tx := range c.toxics {
				if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(tx)); err != nil {
					t.Fatalf("add toxic %s: %v", tx, err)
				}
			}
			// A rule written while the enforcer cannot reach etcd.
			newRule := "during-" + c.name
			put(newRule, "GET /"+newRule, "open")
			during := g.load("etcd-"+c.name+"-during", faultFor, nil)
			var lat []time.Duration
			bad := 0
			for _, s := range during {
				lat = append(lat, s.latency())
				if s.err != nil || s.failOpen {
					bad++
					if bad <= 3 {
						t.Errorf("%s check during the etcd fault: err %v, fail_open %v; want an answer from Redis", s.rule, s.err, s.failOpen)
					}
				}
			}
			// The fault is real: the enforcer has not seen the new rule.
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			resp, err := g.client.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "probe", Resource: "GET /" + newRule})
			cancel()
			if err != nil || resp.GetRuleId() != "" {
				t.Errorf("check of the rule written during the fault: %v %v; want no rule matched (etcd unreachable)", resp, err)
			}
			slices.Sort(lat)
			p99, worst := lat[len(lat)*99/100], lat[len(lat)-1]
			if bound := storeTimeout + latencySlack; p99 > bound {
				t.Errorf("latency during the etcd fault: p99 %v, above %v", p99, bound)
			}

			end := time.Now()
			for _, tx := range c.toxics {
				name := tx[len(`{"name":"`):strings.Index(tx, `","type"`)]
				if err := proxy.Toxics.RemoveToxic(context.Background(), name); err != nil {
					t.Fatalf("remove toxic %s: %v", name, err)
				}
			}
			if len(c.toxics) == 0 {
				if err := proxy.Start(); err != nil {
					t.Fatalf("restart proxy: %v", err)
				}
			}
			testutil.WaitFor(t, etcdRecoverBound, "the rule written during the etcd fault to be enforced", func() bool {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				resp, err := g.client.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "probe", Resource: "GET /" + newRule})
				return err == nil && resp.GetRuleId() == newRule
			})
			took := time.Since(end)
			t.Logf("etcd fault %s: %d checks in %v (%.0f/s), %d not from Redis; latency p99 %v max %v; rule written during the fault enforced %v after it ended",
				c.name, len(during), faultFor, float64(len(during))/faultFor.Seconds(), bad, p99.Round(time.Millisecond), worst.Round(time.Millisecond), took.Round(time.Millisecond))
			g.healthy(t, "etcd-"+c.name+"-after")
		})
	}
}
