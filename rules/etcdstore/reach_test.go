package etcdstore

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// jsonLog is a logger writing JSON records to a buffer the test reads.
type jsonLog struct{ buf testutil.SyncBuffer }

func (l *jsonLog) logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(&l.buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// records returns the records whose message starts with prefix.
func (l *jsonLog) records(t *testing.T, prefix string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(l.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("not a JSON record: %q", line)
		}
		if msg, _ := m["msg"].(string); strings.HasPrefix(msg, prefix) {
			out = append(out, m)
		}
	}
	return out
}

func gaugeValue(t *testing.T, g prometheus.Gauge) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

const (
	lostPrefix = "etcdstore: etcd unreachable; serving the last rule set"
	backMsg    = "etcdstore: etcd reachable again; following rule changes live"
)

// TestWatcherLogsEtcdLostAndBack: etcd's client resumes a broken watch
// without a word, so an enforcer whose etcd went away logged nothing. Now
// a watch silent for the probe interval probes etcd: losing it is logged
// once (WARN, naming the revision served and the endpoints), getting it
// back once (INFO), and the gauge follows.
func TestWatcherLogsEtcdLostAndBack(t *testing.T) {
	testutil.CheckGoroutines(t)
	s, c, e := newStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, testRule("a", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	log := &jsonLog{}
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "reachable"})
	w := fastWatcher(t, c, WithLogger(log.logger()), WithReachableGauge(g), WithProbeInterval(100*time.Millisecond))
	col := runWatcher(t, w)
	waitLikeStore(t, s, col, "first snapshot")
	if v := gaugeValue(t, g); v != 1 {
		t.Fatalf("gauge %v after the first snapshot, want 1", v)
	}
	rev := w.Revision()

	e.Stop()
	testutil.WaitFor(t, 10*time.Second, "the lost line", func() bool { return len(log.records(t, lostPrefix)) > 0 })
	time.Sleep(time.Second) // ten probe intervals more
	lost := log.records(t, lostPrefix)
	want := fmt.Sprintf("etcdstore: etcd unreachable; serving the last rule set (revision %d) until it returns", rev)
	if len(lost) != 1 || lost[0]["msg"] != want || lost[0]["level"] != "WARN" || lost[0]["endpoints"] != e.Endpoint ||
		lost[0]["revision"] != float64(rev) || lost[0]["err"] == nil {
		t.Fatalf("lost lines %v, want one WARN %q naming %s", lost, want, e.Endpoint)
	}
	if v := gaugeValue(t, g); v != 0 {
		t.Fatalf("gauge %v while etcd is down, want 0", v)
	}
	if back := log.records(t, backMsg); len(back) != 0 {
		t.Fatalf("back while down: %v", back)
	}

	e.Restart(t)
	testutil.WaitFor(t, 20*time.Second, "the back line", func() bool { return len(log.records(t, backMsg)) > 0 })
	time.Sleep(500 * time.Millisecond)
	back := log.records(t, backMsg)
	if len(back) != 1 || back[0]["level"] != "INFO" || back[0]["endpoints"] != e.Endpoint {
		t.Fatalf("back lines %v, want one INFO naming %s", back, e.Endpoint)
	}
	if d, err := time.ParseDuration(fmt.Sprint(back[0]["down_for"])); err != nil || d < time.Second {
		t.Fatalf("down_for %v (%v), want a duration string of at least 1s", back[0]["down_for"], err)
	}
	if v := gaugeValue(t, g); v != 1 {
		t.Fatalf("gauge %v once etcd is back, want 1", v)
	}
	if n := len(log.records(t, lostPrefix)); n != 1 {
		t.Fatalf("%d lost lines, want 1", n)
	}
	// The watch follows changes again.
	if _, err := s.Put(ctx, testRule("b", 2), Unconditional); err != nil {
		t.Fatal(err)
	}
	waitLikeStore(t, s, col, "a change after etcd returned")
}

// TestWatcherStartWhileEtcdDownLog: with etcd unreachable at start and no
// cache, the line says there is no rule set yet (there is no "last" one),
// names the endpoints and gives the retry as a duration string (it was
// nanoseconds in JSON); etcd's return is logged.
func TestWatcherStartWhileEtcdDownLog(t *testing.T) {
	_, c, e := newStore(t)
	e.Stop()
	log := &jsonLog{}
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "reachable"})
	w := fastWatcher(t, c, WithLogger(log.logger()), WithReachableGauge(g), WithRequestTimeout(200*time.Millisecond),
		WithProbeInterval(100*time.Millisecond))
	col := runWatcher(t, w)
	const want = "etcdstore: cannot load rules from etcd; no rule set yet"
	testutil.WaitFor(t, 10*time.Second, "the snapshot line", func() bool {
		return len(log.records(t, "etcdstore: cannot load rules")) > 0
	})
	got := log.records(t, "etcdstore: cannot load rules")[0]
	if got["msg"] != want || got["level"] != "WARN" || got["endpoints"] != e.Endpoint || got["retry_in"] != "20ms" || got["err"] == nil {
		t.Fatalf("snapshot line %v, want %q naming %s with retry_in \"20ms\"", got, want, e.Endpoint)
	}
	if len(log.records(t, lostPrefix)) != 0 || gaugeValue(t, g) != 0 {
		t.Fatal("a lost line or gauge 1 before etcd was ever reached")
	}
	e.Restart(t)
	testutil.WaitFor(t, 20*time.Second, "the first snapshot", func() bool { return col.count() > 0 })
	if back := log.records(t, backMsg); len(back) != 1 || gaugeValue(t, g) != 1 {
		t.Fatalf("back lines %v, gauge %v; want one and 1", back, gaugeValue(t, g))
	}
}
