package redisstore

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// A silence is starvation when Redis is runnable and spent at least half
// of it waiting on a run queue or ran for less than half of it, measured
// from the first sample inside it (else the last before it); asleep,
// stopped or running, it is not.
func TestStarvedNeedsHalfTheSilenceWaiting(t *testing.T) {
	var now atomic.Pointer[sched]
	now.Store(&sched{})
	w := &procWatch{read: func(bool) (sched, error) { return *now.Load(), nil }}
	start := time.Now()
	if w.starved(start.UnixNano()) {
		t.Fatal("starved with no sample")
	}
	w.sample(start)
	at := start.Add(-10 * time.Millisecond) // the sample, moved back in time
	w.samples[0].at.Store(at.UnixNano())
	ms := int64(time.Millisecond)
	for _, c := range []struct {
		name string
		now  sched
		want bool
	}{
		{"runnable, waited 8 ms of 10", sched{wait: 8 * ms, run: 2 * ms, runnable: true}, true},
		// Not runnable now: not waiting for a CPU, whatever it waited
		// (a loaded host's Redis stopped or put to sleep in the silence).
		{"asleep or stopped, waited 8 ms of 10", sched{wait: 8 * ms, run: 2 * ms}, false},
		{"runnable, ran 1 ms of 10", sched{run: 1 * ms, runnable: true}, true},
		{"asleep, ran 1 ms of 10", sched{run: 1 * ms}, false},
		{"runnable, ran 9 ms of 10 (busy)", sched{run: 9 * ms, runnable: true}, false},
		{"waited 2 ms of 10, ran 8", sched{wait: 2 * ms, run: 8 * ms, runnable: true}, false},
	} {
		now.Store(&c.now)
		if got := w.starved(at.UnixNano()); got != c.want {
			t.Errorf("%s: starved %v, want %v", c.name, got, c.want)
		}
	}
	// A silence that began after the last sample is measured from it.
	now.Store(&sched{wait: 9 * ms, runnable: true})
	if !w.starved(at.Add(time.Millisecond).UnixNano()) {
		t.Fatal("waited 9 ms since the sample before the silence: want starved")
	}
	now.Store(&sched{wait: 1 * ms, run: 9 * ms})
	if w.starved(at.Add(time.Millisecond).UnixNano()) {
		t.Fatal("ran 9 ms since the sample before the silence: want not starved")
	}
	now.Store(&sched{wait: 9 * ms})
	if w.starved(at.Add(time.Millisecond).UnixNano()) {
		t.Fatal("waited 9 ms since the sample before the silence, stopped now: want not starved")
	}
	// The source failing (the process gone): not starved.
	w.read = func(bool) (sched, error) { return sched{}, errors.New("gone") }
	if w.starved(at.UnixNano()) {
		t.Fatal("unreadable: want not starved")
	}
}

// procSched parses schedstat's run and wait times and stat's state, which
// follows the command name's last ')' (a name may hold ") ").
func TestProcSchedParses(t *testing.T) {
	dir := t.TempDir()
	open := func(name, text string) *os.File {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	sf := open("schedstat", "123456 789 42\n")
	for _, c := range []struct {
		stat string
		want bool
	}{
		{"4194304 (redis-server) R 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20\n", true},
		{"77 (a) S (b) S 1 2 3\n", false},
		{"77 (a) R (b) R 1 2 3\n", true},
	} {
		r, err := procSched(7, sf, open("stat", c.stat))(true)
		if err != nil || r.run != 123456 || r.wait != 789 || r.runnable != c.want {
			t.Errorf("%q: %+v, %v; want run 123456, wait 789, runnable %v", c.stat, r, err, c.want)
		}
	}
	if _, err := procSched(7, sf, open("bad", "77 (no end"))(true); err == nil {
		t.Error("a stat without ')' parsed")
	}
}

// The sampler stops, without Close, once the process cannot be read (it
// exited): it does not read a gone process every starveInterval.
func TestWatchStopsWhenProcessGone(t *testing.T) {
	var reads atomic.Int64
	w := &procWatch{read: func(bool) (sched, error) {
		if reads.Add(1) > 3 {
			return sched{}, errors.New("gone")
		}
		return sched{}, nil
	}}
	done, stopped := make(chan struct{}), make(chan struct{})
	defer close(done)
	go func() { w.run(done); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("sampler still running after the process became unreadable")
	}
	if n := w.n.Load(); n != 3 {
		t.Fatalf("%d samples, want the 3 readable ones", n)
	}
}

// The watch finds a redis-server started on this host, and a Redis that
// sleeps (DEBUG SLEEP: silent, not waiting for a CPU) still fails a check
// with ErrTimeout after the round-trip budget, not the queue budget.
func TestWatchedHungRedisStillTimesOut(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	r := testutil.StartRedis(t, "--enable-debug-command", "yes")
	act := NewActivity()
	client := redis.NewClient(&redis.Options{Addr: r.Addr, ContextTimeoutEnabled: true, Dialer: act.Dialer(redis.NewDialer(&redis.Options{}))})
	t.Cleanup(func() { client.Close() })
	s, err := New(client, WithActivity(act))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	ctx := ctxT(t)
	if err := s.Warm(ctx); err != nil {
		t.Fatal(err)
	}
	pid, err := s.WatchLocalRedis(ctx)
	if err != nil || pid != r.PID() {
		t.Fatalf("WatchLocalRedis: %d, %v; want the server's pid %d", pid, err, r.PID())
	}
	if _, err := s.WatchLocalRedis(ctx); err == nil {
		t.Fatal("a second WatchLocalRedis was accepted: two samplers")
	}
	admin := redis.NewClient(&redis.Options{Addr: r.Addr})
	t.Cleanup(func() { admin.Close() })
	sleeping := make(chan error, 1)
	go func() { sleeping <- admin.Do(context.Background(), "DEBUG", "SLEEP", "1").Err() }()
	probe := redis.NewClient(&redis.Options{Addr: r.Addr, ReadTimeout: 50 * time.Millisecond, MaxRetries: -1})
	t.Cleanup(func() { probe.Close() })
	testutil.WaitFor(t, 5*time.Second, "Redis to sleep", func() bool { return probe.Ping(context.Background()).Err() != nil })
	b := Budget{Queue: 2 * time.Second, RoundTrip: 20 * time.Millisecond}
	t0 := time.Now()
	var out [1]Answer
	s.Do(ctx, b, []Call{{Cost: 1, Buckets: []Bucket{{Key: "k", Algorithm: "token_bucket", Capacity: 10000, Rate: 10000}}}}, out[:])
	took := time.Since(t0)
	if !errors.Is(out[0].Err, ErrTimeout) {
		t.Fatalf("check while Redis sleeps: %v, want ErrTimeout", out[0].Err)
	}
	if took > 700*time.Millisecond {
		t.Fatalf("ErrTimeout after %v: want near the 20ms round trip, far below the 2s queue budget", took)
	}
	if err := <-sleeping; err != nil {
		t.Fatal(err)
	}
}

// A remote-looking or Cluster store has no watch.
func TestWatchLocalRedisNeedsActivity(t *testing.T) {
	e := newEnv(t, true)
	if _, err := e.store.WatchLocalRedis(ctxT(t)); err == nil {
		t.Fatal("a store without an Activity found a local Redis")
	}
}

// A call stamped sent whose worker has not completed a write to Redis since
// (it waits for a CPU) is not in Redis: its silence is this process's, so
// it waits up to Queue + RoundTrip and then fails with ErrQueueTimeout; once
// a write has completed, the same silence is Redis's: ErrTimeout.
func TestUnwrittenCallIsNotInRedis(t *testing.T) {
	act := NewActivity()
	s := &Store{opts: options{activity: act}}
	b := Budget{Queue: 100 * time.Millisecond, RoundTrip: 10 * time.Millisecond}
	c := &call{}
	c.state.Store(callTaken)
	start := time.Now().Add(-50 * time.Millisecond)
	c.sent.Store(start.UnixNano())
	act.wrote.Store(start.Add(-time.Millisecond).UnixNano())
	if next, err := s.decide(c, b, start); err != nil || next <= 0 {
		t.Fatalf("not written, 50ms: %v, %v; want to wait", next, err)
	}
	if _, err := s.decide(c, b, start.Add(-time.Second)); !errors.Is(err, ErrQueueTimeout) {
		t.Fatalf("not written, past Queue + RoundTrip: %v, want ErrQueueTimeout", err)
	}
	act.wrote.Store(start.UnixNano())
	if _, err := s.decide(c, b, start); !errors.Is(err, ErrTimeout) {
		t.Fatalf("written, Redis silent for 50ms: %v, want ErrTimeout", err)
	}
}

// KeepWatchingLocalRedis watches a Redis that was down when it began, once
// it answers, and after a restart the new process: the watch of the old
// one ends with its process, and the next try finds the new one.
func TestKeepWatchingFindsRestartedRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	r := testutil.StartRedis(t)
	act := NewActivity()
	client := redis.NewClient(&redis.Options{Addr: r.Addr, ContextTimeoutEnabled: true, MaxRetries: -1, Dialer: act.Dialer(redis.NewDialer(&redis.Options{}))})
	t.Cleanup(func() { client.Close() })
	s, err := New(client, WithActivity(act))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	r.Stop() // down when the watch begins
	pids, errs := make(chan int, 8), make(chan error, 8)
	s.KeepWatchingLocalRedis(ctxT(t), 20*time.Millisecond, func(pid int, err error) {
		if err != nil {
			select {
			case errs <- err:
			default:
			}
			return
		}
		pids <- pid
	})
	wait := func(what string) int {
		t.Helper()
		select {
		case pid := <-pids:
			return pid
		case <-time.After(10 * time.Second):
			t.Fatalf("no watch of %s within 10s", what)
			return 0
		}
	}
	select {
	case err := <-errs:
		if errors.Is(err, ErrNoLocalWatch) {
			t.Fatalf("a Redis down at start reported as never watchable: %v", err)
		}
	case pid := <-pids:
		t.Fatalf("watched process %d while Redis was down", pid)
	case <-time.After(10 * time.Second):
		t.Fatal("no failure reported while Redis was down")
	}
	r.Restart(t)
	first := r.PID()
	if pid := wait("the Redis started after the watch"); pid != first {
		t.Fatalf("watching process %d, want the server's %d", pid, first)
	}
	r.Restart(t)
	if pid := wait("the restarted Redis"); pid != r.PID() || pid == first {
		t.Fatalf("after a restart watching process %d, want the new server's %d (the old one was %d)", pid, r.PID(), first)
	}
	select {
	case pid := <-pids:
		t.Fatalf("a second watch (%d) while one runs", pid)
	default:
	}
	// and the store serves again: checks are answered by the new process
	b := []Bucket{{Key: Key("u", "watch"), Algorithm: rules.TokenBucket, Capacity: 2000, Rate: 1000}}
	testutil.WaitFor(t, 10*time.Second, "a check answered after the restart", func() bool {
		ok, _, err := s.Check(ctxT(t), 1, b)
		return err == nil && ok
	})
}
