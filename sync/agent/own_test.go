package agent

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
)

// TestTwoAgentsOneRegion: a second agent of region a, started without
// --standby next to the first (the same NATS server, Redis and key): the
// two replace each other's incarnations, and each says so: within
// otherAgentBound both count reports of the other on their region's
// subject (apportion_sync_other_agent_reports_total) and log that another
// agent appears to serve the region, where they logged only "ledger
// fenced; starting a new incarnation". The agents of b and c, and a single
// agent of a before the second starts, count none: their own echoes and
// their earlier incarnations are not another agent's.
func TestTwoAgentsOneRegion(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts a NATS super-cluster, etcd and the agents")
	}
	const otherAgentBound = 20 * time.Second
	s := memStack(t, []string{"a", "b", "c"})
	s.putRule(t, globalRule())
	s.waitIncarnations(t)
	time.Sleep(2 * time.Second) // reports and their echoes
	for _, n := range s.names {
		if v := metricValue(s.regions[n].agent.m.otherAgent); v != 0 {
			t.Fatalf("%s counted %v reports of another agent while it was its region's only one", n, v)
		}
	}
	a1 := s.regions["a"]
	log := &testutil.SyncBuffer{}
	a2 := &testRegion{name: "a", nats: a1.nats, nc: a1.nats.Connect(t), store: a1.store, mem: a1.mem}
	start := time.Now()
	a2.start(t, s.etcd, func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(log, nil)) })
	testutil.WaitFor(t, otherAgentBound, "both agents of a to count the other's reports", func() bool {
		return metricValue(a1.agent.m.otherAgent) > 0 && metricValue(a2.agent.m.otherAgent) > 0
	})
	t.Logf("both agents of a counted the other's reports %v after the second was started (the first %v, the second %v)",
		time.Since(start).Round(time.Millisecond), metricValue(a1.agent.m.otherAgent), metricValue(a2.agent.m.otherAgent))
	testutil.WaitFor(t, 5*time.Second, "the second agent's log", func() bool {
		return strings.Contains(log.String(), "another agent appears to serve this region")
	})
	out := log.String()
	if !strings.Contains(out, "--standby") {
		t.Errorf("the log does not suggest --standby:\n%s", out)
	}
	if n := strings.Count(out, "another agent appears"); n > 2+int(time.Since(start)/logEvery) {
		t.Errorf("%d log lines about another agent in %v: not rate-limited", n, time.Since(start))
	}
	for _, n := range []string{"b", "c"} {
		if v := metricValue(s.regions[n].agent.m.otherAgent); v != 0 {
			t.Errorf("%s counted %v reports of another agent of its region", n, v)
		}
	}
}
