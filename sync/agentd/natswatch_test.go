package agentd

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/nats-io/nats-server/v2/server"
)

// TestRunCommandNATSDown: an agent whose --nats-url reaches no server (a
// wrong URL, or NATS not up yet) answers /readyz 503 for as long as NATS
// is not connected, where it answered 200 once its NATS flush had timed
// out (10 s) though NATS never connected; it logs the URL and the dial
// error at once and then every 10 s, where it logged neither (only "NATS
// flush after subscribing failed ... nats: timeout"); and it computes no
// payload budget from the unknown max payload (it logged "cannot encode
// reports ... header does not fit in -65 bytes" at every tick). When a
// NATS server comes up at that URL, the agent connects, says so, and is
// ready.
func TestRunCommandNATSDown(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	r := testutil.StartRedis(t)
	e := testutil.StartEtcd(t)
	port := testutil.FreePort(t)
	natsURL := fmt.Sprintf("nats://127.0.0.1:%d", port)
	// A rule this region coordinates with two others: its ledger reports
	// at every tick.
	putRuleEtcd(t, e.Client(t), rules.Rule{ID: "orders", Key: []string{"client_key"}, Algorithm: rules.TokenBucket, Capacity: 100,
		RefillPerSecond: 100, Scope: rules.Global, Regions: map[string]float64{"a": 1, "b": 1, "c": 1}, MinShare: 0.1})
	log := &testutil.SyncBuffer{}
	rc := startCommandLog(t, log, "--region", "a", "--redis-addr", r.Addr, "--nats-url", natsURL, "--etcd-endpoints", e.Endpoint,
		"--http-addr", "127.0.0.1:0", "--interval", "50ms", "--report-seed-file", testSeedFile(t, "a"))
	// Longer than the NATS client's flush timeout (10 s), after which the
	// agent used to be ready.
	start := time.Now()
	for time.Since(start) < 11*time.Second {
		if c, body := rc.get("/readyz"); c != http.StatusServiceUnavailable {
			t.Fatalf("/readyz %d %q %v after the start with NATS never connected, want 503", c, body, time.Since(start).Round(time.Millisecond))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, body := rc.get("/readyz"); !strings.Contains(body, "NATS not connected ("+natsURL+")") {
		t.Errorf("/readyz says %q, want why: NATS not connected (%s)", body, natsURL)
	}
	out := log.String()
	for _, want := range []string{"cannot connect to NATS", "url=" + natsURL, "connection refused"} {
		if !strings.Contains(out, want) {
			t.Errorf("the log does not say %q:\n%s", want, out)
		}
	}
	if n := strings.Count(out, "cannot connect to NATS"); n < 2 || n > 3 {
		t.Errorf("%d lines say NATS does not connect in 11 s, want 2 or 3 (one every 10 s):\n%s", n, out)
	}
	for _, bad := range []string{"cannot encode reports", "does not fit", "NATS flush after subscribing failed"} {
		if strings.Contains(out, bad) {
			t.Errorf("the log says %q:\n%s", bad, out)
		}
	}
	testutil.StartNATS(t, func(o *server.Options) { o.Port = port })
	testutil.WaitFor(t, 20*time.Second, "/readyz 200 once NATS is up", func() bool { c, _ := rc.get("/readyz"); return c == http.StatusOK })
	testutil.WaitFor(t, 5*time.Second, "the log to say NATS connected", func() bool { return strings.Contains(log.String(), "NATS connected") })
}
