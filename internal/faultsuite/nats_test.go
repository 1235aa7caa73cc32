package faultsuite

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
)

// natsRecoverBound is how long after a NATS fault ends the enforcer's usage
// reports must arrive again: the client reconnects every 250 ms
// (internal/backend) and the publisher flushes every 100 ms.
const natsRecoverBound = 10 * time.Second

// TestNATSFaults runs load through ratelimitd, whose usage reports to the
// region's sync agent go to NATS through a toxiproxy proxy, while the proxy
// delays, swallows, resets or refuses: NATS is not on the check path, so
// every check is answered from Redis with its usual latency, and once the
// fault ends usage reports arrive again within natsRecoverBound.
func TestNATSFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("fault suite: starts redis-server, NATS and ratelimitd")
	}
	zerolog.SetGlobalLevel(zerolog.Disabled)
	t.Cleanup(func() { zerolog.SetGlobalLevel(zerolog.TraceLevel) })
	r := testutil.StartRedis(t)
	ns := testutil.StartNATS(t)
	proxy := newProxy(t, "nats", strings.TrimPrefix(ns.ClientURL(), "nats://"))

	// Global rules (one region, static share) so that checks emit usage.
	rulesFile := filepath.Join(t.TempDir(), "rules.json")
	bucket := fmt.Sprintf(`"algorithm":"token_bucket","capacity":%d,"refill_per_second":%d,"scope":"global","regions":{"us-east":1}`, capacity, refill)
	if err := os.WriteFile(rulesFile, []byte(`[`+
		`{"id":"open","match":{"resource":"GET /open"},`+bucket+`,"failure_mode":"open"},`+
		`{"id":"closed","match":{"resource":"GET /closed"},`+bucket+`,"failure_mode":"closed"}]`), 0o600); err != nil {
		t.Fatal(err)
	}
	var reports atomic.Int64
	var last atomic.Int64 // unix ns of the last report
	nc := ns.Connect(t)
	if _, err := nc.Subscribe(usage.Subject("us-east"), func(*nats.Msg) {
		reports.Add(1)
		last.Store(time.Now().UnixNano())
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	g := runEnforcer(t, "--redis-addr", r.Addr, "--rules", rulesFile, "--static-global", "--nats-url", "nats://"+proxy.Listen)

	for _, c := range []faultCase{
		{name: "latency", toxics: []string{toxic("lat", "latency", "upstream", `"latency":500`)}},
		{name: "blackhole", toxics: []string{toxic("hole", "timeout", "upstream", `"timeout":0`)}},
		{name: "reset_peer", toxics: []string{toxic("reset", "reset_peer", "upstream", `"timeout":0`)}},
		{name: "refused"},
	} {
		t.Run(c.name, func(t *testing.T) {
			g.healthy(t, "nats-"+c.name+"-before")
			testutil.WaitFor(t, natsRecoverBound, "usage reports before the fault", func() bool {
				return time.Since(time.Unix(0, last.Load())) < time.Second
			})
			if len(c.toxics) == 0 {
				proxy.Stop()
			}
			for _, tx := range c.toxics {
				if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(tx)); err != nil {
					t.Fatalf("add toxic %s: %v", tx, err)
				}
			}
			before := reports.Load()
			during := g.load("nats-"+c.name+"-during", faultFor, nil)
			got := reports.Load() - before
			var lat []time.Duration
			bad := 0
			for _, s := range during {
				lat = append(lat, s.latency())
				if s.err != nil || s.failOpen {
					bad++
					if bad <= 3 {
						t.Errorf("%s check during the NATS fault: err %v, fail_open %v; want an answer from Redis", s.rule, s.err, s.failOpen)
					}
				}
			}
			slices.Sort(lat)
			p99, worst := lat[len(lat)*99/100], lat[len(lat)-1]
			if bound := storeTimeout + latencySlack; p99 > bound {
				t.Errorf("latency during the NATS fault: p99 %v, above %v", p99, bound)
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
			// Recovered: a report published after the fault ended has
			// arrived, with load running so that there is usage to send.
			var took time.Duration
			g.load("nats-"+c.name+"-recover", natsRecoverBound, func(sample) bool {
				if l := last.Load(); l > end.UnixNano() && took == 0 {
					took = time.Unix(0, l).Sub(end)
				}
				return took > 0
			})
			if took == 0 {
				t.Fatalf("no usage report within %v after the NATS fault ended", natsRecoverBound)
			}
			t.Logf("NATS fault %s: %d checks in %v (%.0f/s), %d not from Redis; latency p99 %v max %v; %d usage reports arrived during the fault; reports again %v after it ended",
				c.name, len(during), faultFor, float64(len(during))/faultFor.Seconds(), bad, p99.Round(time.Millisecond), worst.Round(time.Millisecond), got, took.Round(time.Millisecond))
		})
	}
}
