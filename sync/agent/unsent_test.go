package agent

import (
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
)

// TestNoReportsSentWhileNATSDown: region a's NATS server stops. While a's
// connection reconnects, a sends no report: apportion_sync_reports_total
// and apportion_sync_report_bytes_total{direction="sent"} stay put, the
// reports are counted in apportion_sync_reports_unsent_total{reason=
// "disconnected"}, and the acknowledgement check does not take them as
// published. Before, nats.go buffered every report for the reconnect and
// answered nil, and the agent counted them as sent at the connected rate.
// Once the server is back, reports are sent again.
func TestNoReportsSentWhileNATSDown(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts NATS and etcd")
	}
	s := memStack(t, []string{"a", "b", "c"})
	s.putRule(t, globalRule())
	s.waitIncarnations(t)
	a := s.regions["a"]
	sent := func() (float64, float64) {
		return metricValue(a.agent.m.reports.WithLabelValues("sent")), metricValue(a.agent.m.bytes.WithLabelValues("sent"))
	}
	unsent := func() float64 { return metricValue(a.agent.m.unsent.WithLabelValues(UnsentDisconnected)) }
	lastSent := func() time.Time {
		var at time.Time
		if err := a.agent.onLoop(t.Context(), func() { at = a.agent.acks.lastSent }); err != nil {
			t.Fatal(err)
		}
		return at
	}
	if n, _ := sent(); n == 0 {
		t.Fatal("a sent no report before the outage")
	}

	a.nats.Shutdown()
	testutil.WaitFor(t, 10*time.Second, "a's NATS connection to notice the outage", func() bool { return !a.nc.IsConnected() })
	time.Sleep(3 * a.agent.cfg.Interval) // a tick that began before the notice ends
	n0, b0 := sent()
	u0, l0 := unsent(), lastSent()
	time.Sleep(2 * time.Second) // 20 intervals
	if a.nc.IsConnected() {
		t.Fatal("a's connection reconnected to a server that is down")
	}
	n1, b1 := sent()
	if n1 != n0 || b1 != b0 {
		t.Errorf("while NATS was down a counted %v reports (%v bytes) as sent", n1-n0, b1-b0)
	}
	if u := unsent() - u0; u < 5 {
		t.Errorf("reports_unsent_total{reason=disconnected} rose by %v in 20 intervals, want one a tick", u)
	}
	if l1 := lastSent(); !l1.Equal(l0) {
		t.Errorf("the acknowledgement check took reports as published while NATS was down (%v after)", l1.Sub(l0))
	}
	t.Logf("NATS down 2 s: sent +%v, unsent{disconnected} +%v", n1-n0, unsent()-u0)

	a.nats.Restart(t)
	testutil.WaitFor(t, 20*time.Second, "a sending again after NATS is back", func() bool {
		n, _ := sent()
		return a.nc.IsConnected() && n > n1+5
	})
}
