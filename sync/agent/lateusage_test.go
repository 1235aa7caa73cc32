package agent

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage"
	"github.com/prometheus/client_golang/prometheus"
)

// fakeEnforcer publishes usage for testKey on a region's usage subject at
// every flush instant (usage.NextFlush), as an enforcer does: per flush,
// perFlush admitted in mode "busy", an empty batch in mode "idle", and
// nothing in mode "stalled" (a NATS server that delivers nothing), whose
// usage comes in one batch with the first flush after it.
type fakeEnforcer struct {
	mode atomic.Value // "busy", "idle" or "stalled"
}

func startFakeEnforcer(t *testing.T, s *stack, region string, perFlush int64) *fakeEnforcer {
	t.Helper()
	e := &fakeEnforcer{}
	e.mode.Store("busy")
	nc := s.cluster[region].Connect(t)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		var seq uint64
		var owed int64 // usage of flushes not delivered (stalled)
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Until(usage.NextFlush(time.Now(), usage.DefaultInterval))):
			}
			mode := e.mode.Load().(string)
			if mode != "idle" {
				owed += perFlush
			}
			if mode == "stalled" {
				continue
			}
			seq++
			b := usage.Batch{Region: region, Enforcer: "fake-1", Seq: seq}
			if owed > 0 {
				b.Deltas = []usage.Delta{{Rule: testRule, Key: testKey, Admitted: owed}}
			}
			data, err := usage.Encode(b)
			if err != nil {
				t.Error(err)
				return
			}
			nc.Publish(usage.Subject(region), data)
			owed = 0
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
	return e
}

// TestStalledUsageKeepsTheShare: a NATS server that stalls for a second
// (SIGSTOP, CPU starvation: it holds its connections and delivers
// nothing, then everything) kept a region's enforcers' usage from its
// agent; the agent read the second as traffic that stopped, its demand
// estimate decayed (half in 250 ms) and it gave its share of the busy key
// away, running at about its floor until NATS delivered again (an
// explorer: every region's admissions fell to about its floor 0.4-0.6 s
// into each 1 s stall). Every enforcer now sends a batch at every flush,
// an empty one when it has no usage, and the agent waits for the usage of
// an enforcer that missed a flush (Config.UsageGrace): the share stays.
// With UsageGrace 0 (the agent before) the same stall gives the share
// away, which shows the test can fail; and traffic that really stops (the
// enforcer's empty batches) gives it away with the wait as well.
func TestStalledUsageKeepsTheShare(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts NATS and etcd")
	}
	for _, grace := range []time.Duration{DefaultUsageGrace, 0} {
		t.Run("grace="+grace.String(), func(t *testing.T) {
			s := memStack(t, []string{"a", "b", "c"}, func(c *Config) { c.UsageGrace = grace })
			s.putRule(t, globalRule())
			s.waitIncarnations(t)
			a := s.regions["a"]
			e := startFakeEnforcer(t, s, "a", 80_000) // 800,000/s of the 1,000,000/s limit, all in a
			share := func() int64 { return a.agent.Shares(testRule)[testKey] }
			const most = 800_000 // of the 1,000,000 units (844,686 in a run)
			testutil.WaitFor(t, 20*time.Second, "a holding most of the limit", func() bool { return share() >= most })
			steady := share() * 9 / 10
			late0 := metricValue(a.agent.m.lateTicks)

			e.mode.Store("stalled")
			lowest := share()
			for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
				lowest = min(lowest, share())
			}
			e.mode.Store("busy")
			late := metricValue(a.agent.m.lateTicks) - late0
			t.Logf("a's share during a 1 s stall of its usage: lowest %d of %d before; %v ticks waited", lowest, steady*10/9, late)
			if grace > 0 {
				if lowest < steady {
					t.Errorf("a's share fell to %d during the stall (want at least %d, 90%% of before: the usage was late, not zero)", lowest, steady)
				}
				if late < 5 {
					t.Errorf("apportion_sync_usage_late_ticks_total rose by %v over the stall, want about 10", late)
				}
			} else {
				if lowest >= steady/2 {
					t.Errorf("without the wait, a's share stayed at %d or more during the stall: the test shows nothing", lowest)
				}
				return
			}
			if got := metricValue(a.agent.m.enforcers); got != 1 {
				t.Errorf("apportion_sync_usage_enforcers = %v, want 1", got)
			}

			// Traffic that stops: the enforcer's empty batches say so, and
			// the share goes within about a second, as without the wait.
			testutil.WaitFor(t, 20*time.Second, "a holding most of the limit again", func() bool { return share() >= most })
			e.mode.Store("idle")
			start := time.Now()
			testutil.WaitFor(t, 5*time.Second, "a giving its share up once its traffic stopped", func() bool { return share() < steady/2 })
			t.Logf("traffic stopped: a's share below half of it %v later", time.Since(start).Round(10*time.Millisecond))
		})
	}
}

// TestUsageLateBounded: the demand estimates wait for late usage at most
// UsageGrace at a time, whatever the enforcer ids (anyone who can publish
// on the usage subject can send batches of any id, and stop): an id heard
// once is late for a grace and then forgotten, ids that keep coming make
// ticks observe at least once a grace, and at most maxEnforcers ids are
// kept, further ones making nothing late.
func TestUsageLateBounded(t *testing.T) {
	const grace = 2 * time.Second
	a := &Agent{cfg: Config{UsageGrace: grace}, m: &metrics{
		enforcers: prometheus.NewGauge(prometheus.GaugeOpts{Name: "e"}),
		lateTicks: prometheus.NewCounter(prometheus.CounterOpts{Name: "l"}),
	}}
	t0 := time.Unix(1_000_000, 0)
	heard := func(id string, at time.Time) {
		a.usageMu.Lock()
		a.heardEnforcer(id, at)
		a.usageMu.Unlock()
	}

	// One enforcer heard at every flush: never late; silent: late from
	// lateAfter until grace, then forgotten.
	for i := range 10 {
		at := t0.Add(time.Duration(i) * usage.DefaultInterval)
		heard("e1", at)
		if a.usageLate(at.Add(usage.DefaultInterval / 2)) {
			t.Fatalf("an enforcer heard half a flush ago is late")
		}
	}
	last := t0.Add(9 * usage.DefaultInterval)
	if !a.usageLate(last.Add(lateAfter + time.Millisecond)) {
		t.Errorf("an enforcer silent for more than a flush and a quarter is not late")
	}
	if a.usageLate(last.Add(grace + time.Millisecond)) {
		t.Errorf("an enforcer silent for more than the grace still makes the usage late")
	}
	if n := len(a.enforcers); n != 0 {
		t.Errorf("%d enforcers kept after the grace, want 0", n)
	}

	// A new id every tick, each heard once: the estimates wait at most a
	// grace at a time.
	now, waited, longest := t0.Add(time.Hour), time.Duration(0), time.Duration(0)
	for i := range 200 {
		heard(fmt.Sprintf("rogue-%d", i), now)
		now = now.Add(usage.DefaultInterval)
		if a.usageLate(now) {
			waited += usage.DefaultInterval
			longest = max(longest, waited)
		} else {
			waited = 0
		}
	}
	if longest > grace {
		t.Errorf("ids heard once each kept the estimates waiting %v at a stretch, want at most %v", longest, grace)
	}

	// At most maxEnforcers ids.
	a.enforcers = nil
	for i := range maxEnforcers + 100 {
		heard(fmt.Sprintf("id-%d", i), now)
	}
	if n := len(a.enforcers); n != maxEnforcers {
		t.Errorf("%d ids kept, want %d", n, maxEnforcers)
	}
}
