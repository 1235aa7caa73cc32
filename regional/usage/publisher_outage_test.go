package usage

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apportion/apportion/internal/testutil"
)

// gauge returns the value of the gauge name gathered from reg (-1 if it is
// not there), checking that it carries the region label.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "region" && l.GetValue() != "" {
					return m.GetGauge().GetValue()
				}
			}
			t.Fatalf("%s has no region label", name)
		}
	}
	return -1
}

// jsonLines returns the JSON log lines in buf whose msg contains msg,
// failing the test on a line that repeats a key (slog does not merge a
// logger's attributes with a line's).
func jsonLines(t *testing.T, buf *testutil.SyncBuffer, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if !strings.Contains(fmt.Sprint(m["msg"]), msg) {
			continue
		}
		for k := range m {
			if n := strings.Count(line, fmt.Sprintf("%q:", k)); n != 1 {
				t.Errorf("key %q written %d times in %s", k, n, line)
			}
		}
		out = append(out, m)
	}
	return out
}

// regionLogger is a JSON logger that carries the region, as ratelimitd's does.
func regionLogger(buf *testutil.SyncBuffer, region string) *slog.Logger {
	return slog.New(slog.NewJSONHandler(buf, nil)).With("component", "ratelimitd", "region", region)
}

// TestPublisherNATSOutageIsVisible: the region's NATS server goes down
// while the Publisher runs. The deltas are held and arrive after it is back;
// meanwhile apportion_usage_nats_connected reads 0,
// apportion_usage_flushes_held_total counts the held flushes, and the
// warning names the server's URL and why it does not connect, with the
// logger's region key once.
func TestPublisherNATSOutageIsVisible(t *testing.T) {
	testutil.CheckGoroutines(t)
	if testing.Short() {
		t.Skip("needs embedded NATS")
	}
	ns := testutil.StartNATS(t)
	nc := ns.Connect(t)
	s := newSink()
	s.subscribe(t, nc, "us-west")
	rec := NewRecorder(0)
	reg := prometheus.NewRegistry()
	var logs testutil.SyncBuffer
	p, err := NewPublisher(nc, rec, "us-west", "enf", WithInterval(5*time.Millisecond),
		WithLogger(regionLogger(&logs, "us-west")), WithMetrics(reg))
	if err != nil {
		t.Fatal(err)
	}
	p.Start()
	defer closePublisher(t, p)

	rec.Add("r", "before", 1, 0)
	testutil.WaitFor(t, 10*time.Second, "first delta", func() bool { adm, _ := s.total(); return adm == 1 })
	if got := gauge(t, reg, "apportion_usage_nats_connected"); got != 1 {
		t.Fatalf("apportion_usage_nats_connected = %v while connected, want 1", got)
	}
	if got := counter(t, reg, "apportion_usage_flushes_held_total"); got != 0 {
		t.Fatalf("apportion_usage_flushes_held_total = %v while connected, want 0", got)
	}

	ns.Shutdown()
	testutil.WaitFor(t, 10*time.Second, "client to notice", func() bool { return !nc.IsConnected() })
	rec.Add("r", "during", 10, 0)
	testutil.WaitFor(t, 10*time.Second, "held flushes to be counted", func() bool {
		rec.Add("r", "during", 0, 1) // a held flush is one with new deltas
		return counter(t, reg, "apportion_usage_flushes_held_total") >= 3
	})
	if got := gauge(t, reg, "apportion_usage_nats_connected"); got != 0 {
		t.Fatalf("apportion_usage_nats_connected = %v while NATS is down, want 0", got)
	}
	var warn map[string]any
	testutil.WaitFor(t, 10*time.Second, "the not-connected warning", func() bool {
		lines := jsonLines(t, &logs, "NATS not connected")
		if len(lines) > 0 {
			warn = lines[0]
		}
		return warn != nil
	})
	if warn["url"] != ns.ClientURL() {
		t.Errorf("warning names url %v, want %s: %v", warn["url"], ns.ClientURL(), warn)
	}
	if e := fmt.Sprint(warn["err"]); !strings.Contains(e, "connection refused") {
		t.Errorf("warning's err %q does not say why (connection refused): %v", e, warn)
	}
	if _, ok := warn["held_keys"].(float64); warn["region"] != "us-west" || !ok {
		t.Errorf("warning %v: want region us-west and held_keys", warn)
	}
	// Rate-limited: one line while the outage lasts less than 10s.
	time.Sleep(50 * time.Millisecond)
	if n := len(jsonLines(t, &logs, "NATS not connected")); n != 1 {
		t.Errorf("%d not-connected warnings within 10s, want 1", n)
	}

	ns.Restart(t)
	testutil.WaitFor(t, 10*time.Second, "held delta after reconnect", func() bool { adm, _ := s.total(); return adm == 11 })
	if got := gauge(t, reg, "apportion_usage_nats_connected"); got != 1 {
		t.Errorf("apportion_usage_nats_connected = %v after reconnect, want 1", got)
	}
	if got := counter(t, reg, "apportion_usage_publish_errors_total"); got != 0 {
		t.Errorf("publish errors: %v (nothing was lost)", got)
	}
	if lines := jsonLines(t, &logs, "NATS connected again"); len(lines) != 1 || lines[0]["url"] != ns.ClientURL() {
		t.Errorf("reconnect lines %v, want one naming %s", lines, ns.ClientURL())
	}
}

// TestPublisherNeverConnectedNamesURL: a connection to a URL where no
// server listens (ratelimitd connects with RetryOnFailedConnect) never
// connects. The warning names the URL without its credentials and the dial
// error; the gauge reads 0 and held flushes are counted.
func TestPublisherNeverConnectedNamesURL(t *testing.T) {
	testutil.CheckGoroutines(t)
	port := testutil.FreePort(t)
	nc, err := nats.Connect(fmt.Sprintf("nats://apportion:s3cret@127.0.0.1:%d", port),
		nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	rec := NewRecorder(0)
	reg := prometheus.NewRegistry()
	var logs testutil.SyncBuffer
	p, err := NewPublisher(nc, rec, "eu-west", "enf", WithInterval(5*time.Millisecond),
		WithLogger(regionLogger(&logs, "eu-west")), WithMetrics(reg))
	if err != nil {
		t.Fatal(err)
	}
	rec.Add("r", "k", 1, 0)
	p.Start()
	var warn map[string]any
	testutil.WaitFor(t, 10*time.Second, "the not-connected warning", func() bool {
		lines := jsonLines(t, &logs, "NATS not connected")
		if len(lines) > 0 {
			warn = lines[0]
		}
		return warn != nil
	})
	testutil.WaitFor(t, 10*time.Second, "held flushes to be counted", func() bool {
		return counter(t, reg, "apportion_usage_flushes_held_total") >= 1
	})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	p.Close(ctx) // fails: the final flush cannot reach a server
	if want := fmt.Sprintf("nats://127.0.0.1:%d", port); warn["url"] != want {
		t.Errorf("warning names url %v, want %s: %v", warn["url"], want, warn)
	}
	if strings.Contains(logs.String(), "s3cret") {
		t.Errorf("the log shows the URL's password: %s", logs.String())
	}
	if e := fmt.Sprint(warn["err"]); !strings.Contains(e, "connection refused") {
		t.Errorf("warning's err %q does not say why (connection refused): %v", e, warn)
	}
	if got := gauge(t, reg, "apportion_usage_nats_connected"); got != 0 {
		t.Errorf("apportion_usage_nats_connected = %v, want 0", got)
	}
}

// TestPublisherErrorLineRegionOnce: a flush that cannot be published (one
// delta larger than the server's max payload) is counted and logged, with
// the logger's region key once.
func TestPublisherErrorLineRegionOnce(t *testing.T) {
	testutil.CheckGoroutines(t)
	if testing.Short() {
		t.Skip("needs embedded NATS")
	}
	ns := testutil.StartNATS(t, func(o *server.Options) { o.MaxPayload = 64 })
	nc := ns.Connect(t)
	rec := NewRecorder(0)
	reg := prometheus.NewRegistry()
	var logs testutil.SyncBuffer
	p, err := NewPublisher(nc, rec, "ap-south", "enf", WithInterval(5*time.Millisecond),
		WithLogger(regionLogger(&logs, "ap-south")), WithMetrics(reg))
	if err != nil {
		t.Fatal(err)
	}
	p.Start()
	defer closePublisher(t, p)
	rec.Add("r", strings.Repeat("k", 200), 1, 0)
	testutil.WaitFor(t, 10*time.Second, "the publish error", func() bool {
		return len(jsonLines(t, &logs, "publish failed")) > 0
	})
	if got := counter(t, reg, "apportion_usage_publish_errors_total"); got != 1 {
		t.Errorf("apportion_usage_publish_errors_total = %v, want 1", got)
	}
	if l := jsonLines(t, &logs, "publish failed")[0]; l["region"] != "ap-south" || l["subject"] != Subject("ap-south") {
		t.Errorf("publish error line %v", l)
	}
}

// TestPublisherHeldFlushCountsNewDeltas: while NATS is not connected,
// apportion_usage_flushes_held_total counts the flushes that would have
// sent deltas (some were added since the previous one), not every tick of
// the outage: nothing while the recorder is empty, one for deltas added
// once however long they wait, one more for deltas added later.
func TestPublisherHeldFlushCountsNewDeltas(t *testing.T) {
	testutil.CheckGoroutines(t)
	nc, err := nats.Connect(fmt.Sprintf("nats://127.0.0.1:%d", testutil.FreePort(t)),
		nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	rec := NewRecorder(0)
	reg := prometheus.NewRegistry()
	p, err := NewPublisher(nc, rec, "eu-west", "enf", WithInterval(5*time.Millisecond),
		WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))), WithMetrics(reg))
	if err != nil {
		t.Fatal(err)
	}
	p.Start()
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		p.Close(ctx) // fails: the final flush cannot reach a server
	}()
	held := func() float64 { return counter(t, reg, "apportion_usage_flushes_held_total") }

	time.Sleep(100 * time.Millisecond) // 20 intervals with nothing to send
	if got := held(); got != 0 {
		t.Fatalf("%v held flushes with nothing recorded, want 0", got)
	}
	rec.Add("r", "k", 1, 0)
	testutil.WaitFor(t, 10*time.Second, "the held flush", func() bool { return held() >= 1 })
	time.Sleep(100 * time.Millisecond) // 20 more intervals; the delta waits, nothing new
	if got := held(); got != 1 {
		t.Fatalf("%v held flushes for one addition, want 1", got)
	}
	rec.Add("r", "k", 1, 0)
	testutil.WaitFor(t, 10*time.Second, "the second held flush", func() bool { return held() >= 2 })
	time.Sleep(50 * time.Millisecond)
	if got := held(); got != 2 {
		t.Fatalf("%v held flushes for two additions apart, want 2", got)
	}
}
