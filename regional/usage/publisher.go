package usage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/internal/natsdiag"
)

// SubjectPrefix is the subject tree of usage messages.
const SubjectPrefix = "ratelimit.usage."

// Subject is the region-local subject on which region's enforcers publish
// usage to region's agent: "ratelimit.usage.<region>".
func Subject(region string) string { return SubjectPrefix + region }

// ValidRegion reports an error unless region can be one subject token:
// non-empty, at most MaxStringLen bytes, without '.', '*', '>' or white space.
func ValidRegion(region string) error {
	if region == "" || len(region) > MaxStringLen || strings.ContainsAny(region, ".*> \t\r\n") {
		return fmt.Errorf("usage: invalid region %q: must be one NATS subject token", region)
	}
	return nil
}

const (
	// DefaultInterval is the flush interval of a Publisher.
	DefaultInterval = 100 * time.Millisecond
	// maxBackoff bounds the wait after consecutive failed flushes.
	maxBackoff = 5 * time.Second
	// logEvery rate-limits repeated error lines.
	logEvery = 10 * time.Second
	// diagDialTimeout bounds the diagnostic dial of whyNotConnected.
	diagDialTimeout = 2 * time.Second
)

// PublisherOption configures a Publisher.
type PublisherOption func(*Publisher) error

// WithInterval sets how often the Publisher flushes. Default 100ms; must be
// positive.
func WithInterval(d time.Duration) PublisherOption {
	return func(p *Publisher) error {
		if d <= 0 {
			return fmt.Errorf("usage: interval %v must be positive", d)
		}
		p.interval = d
		return nil
	}
}

// WithLogger sets the logger for publish errors and for a NATS connection
// that is down (written at most once per 10s per kind of error). Default
// slog.Default(). The lines name the subject, not the region: give a logger
// that carries the region if it should (ratelimitd's does), so the key is
// not written twice.
func WithLogger(l *slog.Logger) PublisherOption {
	return func(p *Publisher) error {
		if l != nil {
			p.logger = l
		}
		return nil
	}
}

// WithMetrics registers the Publisher's counters, and the gauge
// apportion_usage_nats_connected, on reg, labelled with the region.
// Default: counters are kept but not registered.
func WithMetrics(reg prometheus.Registerer) PublisherOption {
	return func(p *Publisher) error {
		p.reg = reg
		return nil
	}
}

// Publisher flushes a Recorder to Subject(region) every interval.
//
// Start launches its goroutine; Close flushes once more, stops it and waits.
// The flush sequence number and the encoding buffers belong to that one
// goroutine. While the NATS connection is not connected, the Publisher does
// not drain: deltas keep aggregating in the Recorder and go out once the
// connection is back. That is bounded by the Recorder: one count per (rule,
// key), at most its maxKeys keys, further keys' additions dropped and
// counted in apportion_usage_dropped_keys_total. Each flush held back so
// that would have sent deltas (some were added since the previous flush) is
// counted in apportion_usage_flushes_held_total (an interval without
// additions is not, however many older deltas wait),
// apportion_usage_nats_connected reads 0, and a warning names the servers
// and why they do not connect, at once and then every 10s. A publish that
// fails loses its deltas (they are counted in
// apportion_usage_publish_errors_total) and the next flush backs off
// exponentially, up to 5s.
type Publisher struct {
	nc       *nats.Conn
	rec      *Recorder
	region   string
	enforcer string
	subject  string
	interval time.Duration
	logger   *slog.Logger
	reg      prometheus.Registerer
	log      *logsample.Logger
	m        metrics

	seq      uint64 // owned by the run goroutine
	finalErr error  // written by the run goroutine before it closes done

	mu      sync.Mutex
	started bool               // guarded by mu
	cancel  context.CancelFunc // guarded by mu
	done    chan struct{}      // closed when run returns

	syncOnce sync.Once
	closeErr error // written once under syncOnce
}

type metrics struct {
	flushes, bytes, errors, deltas, held prometheus.Counter
}

// NewPublisher returns a Publisher of rec's deltas for enforcer in region.
// Call Start to begin flushing.
func NewPublisher(nc *nats.Conn, rec *Recorder, region, enforcer string, opts ...PublisherOption) (*Publisher, error) {
	if nc == nil || rec == nil {
		return nil, errors.New("usage: NewPublisher needs a NATS connection and a Recorder")
	}
	if err := ValidRegion(region); err != nil {
		return nil, err
	}
	if enforcer == "" || len(enforcer) > MaxStringLen {
		return nil, fmt.Errorf("usage: invalid enforcer id %q", enforcer)
	}
	p := &Publisher{
		nc: nc, rec: rec, region: region, enforcer: enforcer, subject: Subject(region),
		interval: DefaultInterval, logger: slog.Default(), seq: 1, done: make(chan struct{}),
	}
	for _, o := range opts {
		if err := o(p); err != nil {
			return nil, err
		}
	}
	p.log = logsample.New(p.logger, logEvery)
	labels := prometheus.Labels{"region": region}
	p.m = metrics{
		flushes: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_usage_flushes_total",
			Help: "Usage batches published to the region's agent (an empty one at a flush without usage: the agent hears every enforcer at every flush).", ConstLabels: labels}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_usage_bytes_total",
			Help: "Bytes of usage batches published.", ConstLabels: labels}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_usage_publish_errors_total",
			Help: "Usage flushes that failed; their deltas are lost.", ConstLabels: labels}),
		deltas: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_usage_deltas_total",
			Help: "Usage deltas (one per rule and key per flush) published.", ConstLabels: labels}),
		held: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_usage_flushes_held_total",
			Help: "Usage flushes not sent because NATS was not connected, counted when deltas were added since the previous flush (not at every tick of an outage); their deltas stay in the recorder (up to its maximum number of keys) and go out once it is.", ConstLabels: labels}),
	}
	if p.reg != nil {
		dropped := prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "apportion_usage_dropped_keys_total",
			Help: "Usage additions dropped because the recorder held its maximum number of keys.", ConstLabels: labels},
			func() float64 { return float64(rec.Dropped()) })
		connected := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "apportion_usage_nats_connected",
			Help: "1 while the usage publisher's NATS connection is connected, 0 while it is not (usage is held, not sent).", ConstLabels: labels},
			func() float64 {
				if nc.IsConnected() {
					return 1
				}
				return 0
			})
		for _, c := range []prometheus.Collector{p.m.flushes, p.m.bytes, p.m.errors, p.m.deltas, p.m.held, dropped, connected} {
			if err := p.reg.Register(c); err != nil {
				return nil, fmt.Errorf("usage: register metrics: %w", err)
			}
		}
	}
	return p, nil
}

// Start launches the flush goroutine. Calling it again, or after Close, does
// nothing.
func (p *Publisher) Start() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.startLocked()
}

func (p *Publisher) startLocked() {
	if p.started {
		return
	}
	p.started = true
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	go p.run(ctx)
}

// Close stops the Publisher: it flushes the Recorder once more, waits for the
// goroutine to exit, and waits (bounded by ctx) until the NATS server has
// received what was published. It returns the final flush's error, or
// ctx.Err() if ctx ends first. Safe to call twice and without Start.
func (p *Publisher) Close(ctx context.Context) error {
	p.mu.Lock()
	p.startLocked() // never started: run just does the final flush
	p.cancel()
	p.mu.Unlock()
	select {
	case <-p.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	p.syncOnce.Do(func() {
		p.closeErr = p.finalErr
		if p.closeErr == nil && !p.nc.IsClosed() {
			if err := p.nc.FlushWithContext(ctx); err != nil {
				p.closeErr = fmt.Errorf("usage: flush to NATS: %w", err)
			}
		}
	})
	return p.closeErr
}

// NextFlush is when a Publisher flushing every interval flushes next after
// now: at the next multiple of interval since the zero time, on the wall
// clock. Every Publisher of a deployment (with clocks kept in step by NTP)
// flushes at the same instants, so a sync agent that ticks between them
// (sync/agent aligns its ticks half a DefaultInterval after them) gets the
// same number of flushes in every interval. A Publisher that waited an
// interval after each flush drifted by the flush's own time, and about
// every 140 intervals (4 of 550 in a 60 s `rlsim live` run of shift, on a
// machine with other work) the agent found an interval without a flush:
// a key's usage read as 0, its demand
// estimate 24% low for an interval (with the default 250 ms half-life),
// which the agent's demand refresh then reported (live, shift's key: 8 to
// 14 demand reports a minute per region against 5 in the simulator).
func NextFlush(now time.Time, interval time.Duration) time.Time {
	return now.Truncate(interval).Add(interval)
}

func (p *Publisher) run(ctx context.Context) {
	defer close(p.done)
	wait := p.interval // the backoff after failed flushes
	untilNext := func() time.Duration { return time.Until(NextFlush(time.Now(), p.interval)) }
	t := time.NewTimer(untilNext())
	defer t.Stop()
	var downSince, warned time.Time // when NATS was first found down, and last said so
	for {
		select {
		case <-ctx.Done():
			p.finalErr = p.flush(true)
			return
		case <-t.C:
		}
		if st := p.nc.Status(); st != nats.CONNECTED {
			// Hold the deltas in the Recorder until the connection is back.
			now := time.Now()
			if downSince.IsZero() {
				downSince = now
			}
			// A held flush is one that would have sent deltas: counted
			// when some were added since the previous flush (held or
			// sent), not at every tick while older ones wait.
			held := p.rec.held()
			if p.rec.takeAdded() {
				p.m.held.Inc()
			}
			// At most once per logEvery (the dial is not repeated more often).
			if warned.IsZero() || now.Sub(warned) >= logEvery {
				dctx, cancel := context.WithTimeout(ctx, diagDialTimeout)
				why := whyNotConnected(dctx, p.nc, st)
				cancel()
				p.logger.Warn("usage: NATS not connected, holding deltas until it is",
					"url", strings.Join(p.nc.Servers(), ","), "status", st.String(), "err", why,
					"subject", p.subject, "held_keys", held, "down_for", now.Sub(downSince).Round(time.Millisecond).String())
				warned = time.Now()
			}
			t.Reset(untilNext())
			continue
		}
		if !downSince.IsZero() {
			p.log.Log(slog.LevelInfo, "usage-reconnected", "usage: NATS connected again, sending the held deltas",
				"url", p.nc.ConnectedUrlRedacted(), "subject", p.subject, "held_keys", p.rec.held(),
				"down_for", time.Since(downSince).Round(time.Millisecond).String())
			downSince = time.Time{}
		}
		if err := p.flush(false); err != nil {
			wait = min(wait*2, max(maxBackoff, p.interval))
			p.log.Log(slog.LevelWarn, "usage-publish", "usage: publish failed, deltas lost",
				"subject", p.subject, "err", err, "retry_in", wait.String())
			t.Reset(wait)
			continue
		}
		wait = p.interval
		t.Reset(untilNext())
	}
}

// flush drains the Recorder and publishes its deltas, split to fit the
// server's max payload; with none, an empty batch: the agent hears every
// enforcer at every flush, and one it does not hear is late, not idle
// (sync/agent, lateusage.go). The final flush (final: Close) sends
// nothing when it has nothing. Called only from run.
func (p *Publisher) flush(final bool) error {
	deltas := p.rec.Drain()
	if final && len(deltas) == 0 {
		return nil
	}
	maxSize := int(p.nc.MaxPayload())
	if maxSize <= 0 {
		maxSize = 1 << 20 // no INFO from a server yet: the NATS default
	}
	msgs, err := EncodeSplit(Batch{Region: p.region, Enforcer: p.enforcer, Seq: p.seq, Deltas: deltas}, maxSize)
	if err != nil {
		p.m.errors.Inc()
		return err
	}
	for i, msg := range msgs {
		if err := p.nc.Publish(p.subject, msg); err != nil {
			p.m.errors.Inc()
			// The rest of this flush is dropped too. Their sequence
			// numbers are skipped, so the agent sees the gap.
			p.seq += uint64(len(msgs))
			return fmt.Errorf("usage: publish %d of %d: %w", i+1, len(msgs), err)
		}
		p.m.flushes.Inc()
		p.m.bytes.Add(float64(len(msg)))
	}
	p.m.deltas.Add(float64(len(deltas)))
	p.seq += uint64(len(msgs))
	return nil
}

// whyNotConnected says why nc (in state st) is not connected: its last
// error if it kept one (e.g. TLS or authorization), else the error of a TCP
// dial to each of its servers (natsdiag: the client keeps its reconnect
// errors to itself).
func whyNotConnected(ctx context.Context, nc *nats.Conn, st nats.Status) error {
	last := nc.LastError()
	if st == nats.CLOSED {
		if last != nil {
			return fmt.Errorf("connection closed: %w", last)
		}
		return errors.New("connection closed")
	}
	if last != nil {
		return last
	}
	errs := natsdiag.Dial(ctx, nc, "accepts TCP connections: the NATS handshake fails (TLS, credentials?) or the client has not reconnected yet")
	if len(errs) == 0 {
		return errors.New("no server to connect to")
	}
	return errors.New(strings.Join(errs, "; "))
}

// Subscribe delivers the batches published for region to fn, on the NATS
// connection's delivery goroutine (one at a time). Messages that do not
// decode, or that name another region, are dropped and reported to onBad
// (which may be nil) with an error wrapping ErrMalformed.
func Subscribe(nc *nats.Conn, region string, fn func(Batch), onBad func(error)) (*nats.Subscription, error) {
	if err := ValidRegion(region); err != nil {
		return nil, err
	}
	if fn == nil {
		return nil, errors.New("usage: Subscribe needs a callback")
	}
	return nc.Subscribe(Subject(region), func(m *nats.Msg) {
		b, err := Decode(m.Data)
		if err == nil && b.Region != region {
			err = fmt.Errorf("%w: batch of region %q on %s", ErrMalformed, b.Region, m.Subject)
		}
		if err != nil {
			if onBad != nil {
				onBad(err)
			}
			return
		}
		fn(b)
	})
}
