package usage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apportion/apportion/internal/testutil"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// sink collects what a Subscribe callback receives.
type sink struct {
	mu      sync.Mutex
	sums    map[[2]string][2]int64
	batches []Batch
	bad     []error
}

func newSink() *sink { return &sink{sums: map[[2]string][2]int64{}} }

func (s *sink) add(b Batch) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.batches = append(s.batches, b)
	for _, d := range b.Deltas {
		k := [2]string{d.Rule, d.Key}
		c := s.sums[k]
		s.sums[k] = [2]int64{c[0] + d.Admitted, c[1] + d.Rejected}
	}
}

func (s *sink) onBad(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.bad = append(s.bad, err)
}

func (s *sink) total() (adm, rej int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.sums {
		adm += c[0]
		rej += c[1]
	}
	return adm, rej
}

func (s *sink) subscribe(t *testing.T, nc *nats.Conn, region string) {
	t.Helper()
	if _, err := Subscribe(nc, region, s.add, s.onBad); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// counter returns the value of the counter name gathered from reg
// (-1 if it is not there).
func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
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
					return m.GetCounter().GetValue()
				}
			}
			t.Fatalf("%s has no region label", name)
		}
	}
	return -1
}

func closePublisher(t *testing.T, p *Publisher) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	select {
	case <-p.done: // the goroutine has exited: no leak
	default:
		t.Fatal("Close returned with the goroutine still running")
	}
}

// TestPublisherDeliversAll adds from several goroutines while the Publisher
// flushes every few milliseconds; what the subscriber receives sums exactly
// to what was added, sequence numbers are contiguous, and metrics agree.
func TestPublisherDeliversAll(t *testing.T) {
	testutil.CheckGoroutines(t)
	if testing.Short() {
		t.Skip("needs embedded NATS")
	}
	ns := testutil.StartNATS(t)
	nc := ns.Connect(t)
	s := newSink()
	s.subscribe(t, nc, "us-east")

	reg := prometheus.NewRegistry()
	rec := NewRecorder(0)
	p, err := NewPublisher(nc, rec, "us-east", "enf-1", WithInterval(5*time.Millisecond), WithLogger(quiet), WithMetrics(reg))
	if err != nil {
		t.Fatal(err)
	}
	p.Start()
	p.Start() // no-op

	const workers, perWorker = 4, 3000
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWorker {
				rec.Add(fmt.Sprintf("rule-%d", i%2), fmt.Sprintf("user:%d", (i+w)%50), 2, 1)
			}
		}()
	}
	wg.Wait()
	const wantAdm, wantRej = workers * perWorker * 2, workers * perWorker
	// Flushes happen while adding; wait for the ticker to ship the rest.
	testutil.WaitFor(t, 10*time.Second, "all deltas to arrive", func() bool {
		adm, rej := s.total()
		return adm == wantAdm && rej == wantRej
	})
	closePublisher(t, p)
	if adm, rej := s.total(); adm != wantAdm || rej != wantRej {
		t.Fatalf("after Close: got %d/%d, want %d/%d", adm, rej, wantAdm, wantRej)
	}
	// The empty batches published at flushes without deltas (the agent's
	// sign that none is late) may still be on their way.
	testutil.WaitFor(t, 10*time.Second, "every batch published to arrive", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return float64(len(s.batches)) == counter(t, reg, "apportion_usage_flushes_total")
	})

	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.bad) != 0 {
		t.Fatalf("bad messages: %v", s.bad)
	}
	var bytes float64
	for i, b := range s.batches {
		if b.Seq != uint64(i+1) || b.Region != "us-east" || b.Enforcer != "enf-1" {
			t.Fatalf("batch %d: region %q enforcer %q seq %d", i, b.Region, b.Enforcer, b.Seq)
		}
		data, _ := Encode(b)
		bytes += float64(len(data))
	}
	if got := counter(t, reg, "apportion_usage_flushes_total"); got != float64(len(s.batches)) {
		t.Errorf("flushes_total = %v, want %d", got, len(s.batches))
	}
	if got := counter(t, reg, "apportion_usage_bytes_total"); got != bytes {
		t.Errorf("bytes_total = %v, want %v", got, bytes)
	}
	if got := counter(t, reg, "apportion_usage_deltas_total"); got < 100 {
		t.Errorf("deltas_total = %v", got)
	}
	for _, name := range []string{"apportion_usage_publish_errors_total", "apportion_usage_dropped_keys_total"} {
		if got := counter(t, reg, name); got != 0 {
			t.Errorf("%s = %v, want 0", name, got)
		}
	}
}

// TestPublisherCloseFlushesTail: with an interval that never fires, only
// Close publishes, and it publishes everything.
func TestPublisherCloseFlushesTail(t *testing.T) {
	testutil.CheckGoroutines(t)
	if testing.Short() {
		t.Skip("needs embedded NATS")
	}
	ns := testutil.StartNATS(t)
	nc := ns.Connect(t)
	s := newSink()
	got := make(chan Batch, 1)
	if _, err := Subscribe(nc, "eu-west", func(b Batch) { s.add(b); got <- b }, s.onBad); err != nil {
		t.Fatal(err)
	}
	nc.Flush()

	rec := NewRecorder(0)
	p, err := NewPublisher(nc, rec, "eu-west", "enf-2", WithInterval(time.Hour), WithLogger(quiet))
	if err != nil {
		t.Fatal(err)
	}
	p.Start()
	rec.Add("r", "k1", 5, 0)
	rec.Add("r", "k2", 0, 3)
	closePublisher(t, p)
	closePublisher(t, p) // safe twice
	select {
	case b := <-got:
		want := []Delta{{"r", "k1", 5, 0}, {"r", "k2", 0, 3}}
		if fmt.Sprint(b.Deltas) != fmt.Sprint(want) || b.Seq != 1 {
			t.Fatalf("tail batch %+v", b)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not flush the tail")
	}

	// Close without Start also flushes.
	rec2 := NewRecorder(0)
	rec2.Add("r", "k3", 1, 0)
	p2, err := NewPublisher(nc, rec2, "eu-west", "enf-3", WithLogger(quiet))
	if err != nil {
		t.Fatal(err)
	}
	closePublisher(t, p2)
	p2.Start() // after Close: no-op
	select {
	case b := <-got:
		if b.Enforcer != "enf-3" || len(b.Deltas) != 1 {
			t.Fatalf("tail batch %+v", b)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close without Start did not flush")
	}
}

// TestPublisherSplitsLargeFlush runs against a server with a 1 KiB max
// payload; one flush of many keys becomes several messages, none too big.
func TestPublisherSplitsLargeFlush(t *testing.T) {
	if testing.Short() {
		t.Skip("needs embedded NATS")
	}
	const maxPayload = 1024
	ns := testutil.StartNATS(t, func(o *server.Options) { o.MaxPayload = maxPayload })
	nc := ns.Connect(t)
	sizes := make(chan int, 1000)
	if _, err := nc.Subscribe(Subject("ap-south"), func(m *nats.Msg) { sizes <- len(m.Data) }); err != nil {
		t.Fatal(err)
	}
	s := newSink()
	s.subscribe(t, nc, "ap-south")

	rec := NewRecorder(0)
	const keys = 500
	for i := range keys {
		rec.Add("rule", fmt.Sprintf("user:%04d", i), 1, 0)
	}
	reg := prometheus.NewRegistry()
	p, err := NewPublisher(nc, rec, "ap-south", "enf", WithInterval(time.Hour), WithLogger(quiet), WithMetrics(reg))
	if err != nil {
		t.Fatal(err)
	}
	closePublisher(t, p)
	testutil.WaitFor(t, 10*time.Second, "all split batches", func() bool {
		adm, _ := s.total()
		return adm == keys
	})
	s.mu.Lock()
	n := len(s.batches)
	s.mu.Unlock()
	if n < 2 {
		t.Fatalf("got %d messages, want a split", n)
	}
	for range n {
		if sz := <-sizes; sz > maxPayload {
			t.Fatalf("message of %d bytes, max payload %d", sz, maxPayload)
		}
	}
	if got := counter(t, reg, "apportion_usage_publish_errors_total"); got != 0 {
		t.Fatalf("publish errors: %v", got)
	}
	if got := counter(t, reg, "apportion_usage_flushes_total"); got != float64(n) {
		t.Fatalf("flushes_total = %v, want %d", got, n)
	}
}

// TestPublisherHoldsWhileDisconnected: deltas added while the server is
// down stay in the Recorder and arrive after the client reconnects.
func TestPublisherHoldsWhileDisconnected(t *testing.T) {
	if testing.Short() {
		t.Skip("needs embedded NATS")
	}
	ns := testutil.StartNATS(t)
	// One connection for both sides: on reconnect nats.go re-sends the
	// subscription before it reports CONNECTED, so the subscriber is back
	// before the Publisher flushes.
	nc := ns.Connect(t)
	s := newSink()
	s.subscribe(t, nc, "us-west")
	rec := NewRecorder(0)
	reg := prometheus.NewRegistry()
	p, err := NewPublisher(nc, rec, "us-west", "enf", WithInterval(5*time.Millisecond), WithLogger(quiet), WithMetrics(reg))
	if err != nil {
		t.Fatal(err)
	}
	p.Start()
	defer closePublisher(t, p)

	rec.Add("r", "before", 1, 0)
	testutil.WaitFor(t, 10*time.Second, "first delta", func() bool { adm, _ := s.total(); return adm == 1 })

	ns.Shutdown()
	testutil.WaitFor(t, 10*time.Second, "client to notice", func() bool { return !nc.IsConnected() })
	rec.Add("r", "during", 10, 0)
	ns.Restart(t)
	testutil.WaitFor(t, 10*time.Second, "held delta after reconnect", func() bool { adm, _ := s.total(); return adm == 11 })
	if got := counter(t, reg, "apportion_usage_publish_errors_total"); got != 0 {
		t.Fatalf("publish errors: %v", got)
	}
}

func TestSubscribeRejectsBadMessages(t *testing.T) {
	if testing.Short() {
		t.Skip("needs embedded NATS")
	}
	ns := testutil.StartNATS(t)
	nc := ns.Connect(t)
	s := newSink()
	s.subscribe(t, nc, "us-east")

	wrongRegion, _ := Encode(Batch{Region: "eu-west", Enforcer: "e", Deltas: []Delta{{"r", "k", 1, 0}}})
	good, _ := Encode(Batch{Region: "us-east", Enforcer: "e", Deltas: []Delta{{"r", "k", 2, 0}}})
	for _, m := range [][]byte{{0x00}, good[:len(good)-1], wrongRegion, good} {
		if err := nc.Publish(Subject("us-east"), m); err != nil {
			t.Fatal(err)
		}
	}
	testutil.WaitFor(t, 10*time.Second, "the good batch", func() bool { adm, _ := s.total(); return adm > 0 })
	adm, _ := s.total()
	s.mu.Lock()
	defer s.mu.Unlock()
	if adm != 2 || len(s.batches) != 1 {
		t.Fatalf("accepted %d batches summing %d, want only the good one", len(s.batches), adm)
	}
	if len(s.bad) != 3 {
		t.Fatalf("onBad called %d times, want 3", len(s.bad))
	}
	for _, err := range s.bad {
		if !errors.Is(err, ErrMalformed) {
			t.Fatalf("onBad error %v does not wrap ErrMalformed", err)
		}
	}
}

func TestNewPublisherValidates(t *testing.T) {
	if testing.Short() {
		t.Skip("needs embedded NATS")
	}
	nc := testutil.StartNATS(t).Connect(t)
	rec := NewRecorder(0)
	tests := []struct {
		name             string
		region, enforcer string
		opts             []PublisherOption
	}{
		{"empty region", "", "e", nil},
		{"dotted region", "us.east", "e", nil},
		{"wildcard region", "*", "e", nil},
		{"empty enforcer", "us-east", "", nil},
		{"zero interval", "us-east", "e", []PublisherOption{WithInterval(0)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := NewPublisher(nc, rec, tt.region, tt.enforcer, tt.opts...); err == nil {
				t.Fatal("no error")
			}
		})
	}
	reg := prometheus.NewRegistry()
	if _, err := NewPublisher(nc, rec, "us-east", "e", WithMetrics(reg)); err != nil {
		t.Fatal(err)
	}
	if _, err := NewPublisher(nc, rec, "us-east", "e", WithMetrics(reg)); err == nil {
		t.Fatal("registering the same region twice should fail")
	}
	if _, err := Subscribe(nc, "a.b", func(Batch) {}, nil); err == nil {
		t.Fatal("Subscribe accepted a dotted region")
	}
}

func TestSubject(t *testing.T) {
	if got := Subject("us-east"); got != "ratelimit.usage.us-east" {
		t.Fatalf("Subject = %q", got)
	}
}

// TestNextFlush: the next multiple of the interval on the wall clock,
// always after now.
func TestNextFlush(t *testing.T) {
	base := time.Date(2026, 12, 3, 15, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		now, want time.Duration // past base
	}{{0, 100 * time.Millisecond}, {1, 100 * time.Millisecond}, {99 * time.Millisecond, 100 * time.Millisecond}, {100 * time.Millisecond, 200 * time.Millisecond}} {
		if got := NextFlush(base.Add(tc.now), 100*time.Millisecond); !got.Equal(base.Add(tc.want)) {
			t.Errorf("NextFlush(base+%v) = base+%v, want base+%v", tc.now, got.Sub(base), tc.want)
		}
	}
}
