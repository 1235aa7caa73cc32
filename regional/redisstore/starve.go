package redisstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// A Redis on this host can be silent because it is waiting for a CPU: on a
// host whose cores are shared (the load generator, other services), the
// kernel may leave Redis's event loop runnable and not running for tens of
// milliseconds. That Redis has not failed: it answers as soon as it runs.
// Its silence is overload of the host, and a check waiting on it is bounded
// by the queue budget (then shed, ErrQueueTimeout), not answered by the
// failure policy. A Redis that sleeps (DEBUG SLEEP), is stopped (SIGSTOP),
// is busy running (a long script) or is gone is not waiting for a CPU, and
// its silence still fails the checks after the round-trip budget.
//
// The kernel tells which. /proc/PID/schedstat holds the time the
// process's main thread (Redis's event loop) has run and the time it has
// waited on a run queue (added when it gets a CPU), and /proc/PID/stat its
// state (R: running or runnable). A watch samples schedstat every
// starveInterval (one read system call); a silence is starvation when Redis
// is runnable now (state R) and spent at least half of it waiting on a run
// queue or ran for less than half of it (waiting for a CPU still). A Redis
// that is not runnable now is not waiting for a CPU, whatever it waited
// before: asleep (S, D: DEBUG SLEEP, a blocking disk write) or stopped (T:
// SIGSTOP, a debugger) with a call of ours written to its socket, it has
// not read it and will not until something other than a CPU lets it, since
// a readable socket wakes a Redis waiting in its event loop (R at once),
// and a Redis that ran since read and answered the call (heard, or a reply
// waiting unread: replyWaiting).

const (
	starveInterval = 5 * time.Millisecond
	starveSamples  = 64 // 320 ms of history
)

// sched is one reading of a process's scheduling.
type sched struct {
	run, wait int64 // ns: time on a CPU, time waiting on a run queue
	runnable  bool  // state R now (read only when deciding)
}

// schedSource reads the process's scheduling; state says whether to read
// its state too.
type schedSource func(state bool) (sched, error)

// procWatch keeps recent samples of a local Redis's scheduling.
type procWatch struct {
	read    schedSource
	samples [starveSamples]struct{ at, run, wait atomic.Int64 }
	n       atomic.Uint64 // samples taken
}

// sample records one reading; false when the process cannot be read.
func (w *procWatch) sample(now time.Time) bool {
	r, err := w.read(false)
	if err != nil {
		return false
	}
	i := w.n.Load() % starveSamples
	w.samples[i].at.Store(now.UnixNano())
	w.samples[i].run.Store(r.run)
	w.samples[i].wait.Store(r.wait)
	w.n.Add(1)
	return true
}

// run samples until done, or until the process cannot be read: a Redis
// that exited (restarted: a new process id) is gone for good from its
// /proc files, and sampling it every starveInterval would be wasted.
func (w *procWatch) run(done <-chan struct{}) {
	t := time.NewTicker(starveInterval)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case now := <-t.C:
			if !w.sample(now) {
				return
			}
		}
	}
}

// starved reports whether Redis is runnable and has been waiting for a
// CPU for most of the time since since (unix ns), measured from the oldest
// sample taken at or after since, else from the newest before it (none:
// false). Not runnable now is never starved: the wait a sample from before
// the silence adds (a host loaded until Redis was stopped, and a sampler
// starved too) is not this silence's.
func (w *procWatch) starved(since int64) bool {
	r, err := w.read(true)
	if err != nil {
		return false
	}
	now := time.Now().UnixNano()
	n := w.n.Load()
	var at, run, wait int64
	for k := uint64(1); k <= min(n, starveSamples); k++ {
		s := &w.samples[(n-k)%starveSamples]
		t := s.at.Load()
		if t < since && at != 0 {
			break
		}
		// the oldest sample inside the silence, else (the sampler,
		// starved too, took none) the newest one before it
		at, run, wait = t, s.run.Load(), s.wait.Load()
		if t < since {
			break
		}
	}
	el := now - at
	if at == 0 || el < int64(starveInterval) {
		return false
	}
	return r.runnable && (2*(r.wait-wait) >= el || 2*(r.run-run) < el)
}

// procSched reads /proc/PID/schedstat (run time, wait time, timeslices)
// from sf and, asked, the state in /proc/PID/stat from stf, both opened
// once (a read at offset 0 reads the file afresh: one system call each, no
// allocation; a check deciding under a starved host pays no more).
func procSched(pid int, sf, stf *os.File) schedSource {
	return func(state bool) (sched, error) {
		var buf [96]byte
		n, err := sf.ReadAt(buf[:], 0)
		if n == 0 {
			return sched{}, fmt.Errorf("redisstore: /proc/%d/schedstat: %w", pid, err)
		}
		var r sched
		var ok1, ok2 bool
		b := buf[:n]
		r.run, b, ok1 = leadingInt(b)
		r.wait, _, ok2 = leadingInt(b)
		if !ok1 || !ok2 {
			return sched{}, fmt.Errorf("redisstore: /proc/%d/schedstat: %q", pid, buf[:n])
		}
		if state {
			// "PID (comm) S ...": comm is at most 15 bytes, so the
			// state is within the first 64.
			n, err := stf.ReadAt(buf[:64], 0)
			i := bytes.LastIndexByte(buf[:n], ')')
			if i < 0 || i+2 >= n {
				return sched{}, fmt.Errorf("redisstore: /proc/%d/stat: no state (%v)", pid, err)
			}
			r.runnable = buf[i+2] == 'R'
		}
		return r, nil
	}
}

// leadingInt parses the decimal number at the start of b (after spaces)
// and returns the rest.
func leadingInt(b []byte) (int64, []byte, bool) {
	for len(b) > 0 && b[0] == ' ' {
		b = b[1:]
	}
	var v int64
	i := 0
	for ; i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
		v = v*10 + int64(b[i]-'0')
	}
	return v, b[i:], i > 0
}

// procStat is /proc/PID/stat from field 3 (the state) on: the command name
// before it is in parentheses and may hold spaces.
func procStat(pid int) ([]string, error) {
	st, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, err
	}
	i := strings.LastIndexByte(string(st), ')')
	if i < 0 {
		return nil, fmt.Errorf("redisstore: /proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(st[i+1:]))
	if len(f) < 20 {
		return nil, fmt.Errorf("redisstore: /proc/%d/stat: short", pid)
	}
	return f, nil
}

// ErrNoLocalWatch: the store's Redis can never be watched (WatchLocalRedis):
// a Cluster client, or a Redis not on a loopback address.
var ErrNoLocalWatch = errors.New("redisstore: no local Redis process to watch")

// ErrWatching: WatchLocalRedis while a watch of the store runs.
var ErrWatching = errors.New("redisstore: WatchLocalRedis called twice")

// WatchLocalRedis looks for the Redis server behind the store's connections
// on this host and, when found, has the store tell a Redis waiting for a
// CPU from a failed one (see starve.go): checks it holds wait up to their
// queue budget and are shed past it, instead of failing open at the
// round-trip budget. Found means: a standalone client, its connections (an
// Activity's, see WithActivity) to a loopback address or a Unix socket,
// and INFO server's process_id naming a process of this host whose name
// contains "redis" and that started when the server says it did (within 3 s). It returns
// the process id, or an error saying why there is none (the store then
// blames every silence past the budget on Redis, as without a watch).
// Call it once, after Warm (a second call while it watches is refused); the
// watch stops at Close, or when the process exits (a restarted Redis is not
// watched: KeepWatchingLocalRedis finds it again). It fails with
// ErrNoLocalWatch when no Redis of this store can be watched, ErrWatching
// while a watch runs, ErrClosed after Close.
func (s *Store) WatchLocalRedis(ctx context.Context) (int, error) {
	if s.cluster != nil {
		return 0, fmt.Errorf("%w: a Cluster client", ErrNoLocalWatch)
	}
	a := s.opts.activity
	if a == nil {
		return 0, fmt.Errorf("%w: no Activity (WithActivity) to tell its connections' addresses", ErrNoLocalWatch)
	}
	select {
	case <-s.done:
		return 0, ErrClosed
	default:
	}
	if s.watch.Load() != nil {
		return 0, ErrWatching
	}
	// INFO first: it dials a connection if none is open (a Redis down at
	// start), whose address tells loopback or not.
	info, err := s.client.Info(ctx, "server").Result()
	if err != nil {
		return 0, err
	}
	if !a.loopback() {
		return 0, fmt.Errorf("%w: Redis is not on a loopback address", ErrNoLocalWatch)
	}
	pid, up := infoInt(info, "process_id"), infoInt(info, "uptime_in_seconds")
	if pid <= 0 {
		return 0, errors.New("redisstore: INFO server has no process_id")
	}
	comm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	if err != nil || !strings.Contains(string(comm), "redis") {
		return 0, fmt.Errorf("redisstore: process %d is not a local Redis (%q, %v)", pid, strings.TrimSpace(string(comm)), err)
	}
	if age, err := processAge(pid); err != nil || age-time.Duration(up)*time.Second > 3*time.Second || time.Duration(up)*time.Second-age > 3*time.Second {
		return 0, fmt.Errorf("redisstore: process %d did not start with the server (%v, uptime %ds, %v)", pid, age, up, err)
	}
	sf, err := os.Open("/proc/" + strconv.Itoa(pid) + "/schedstat")
	if err != nil {
		return 0, err
	}
	stf, err := os.Open("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		sf.Close()
		return 0, err
	}
	closeFiles := func() { sf.Close(); stf.Close() }
	w := &procWatch{read: procSched(pid, sf, stf)}
	if _, err := w.read(true); err != nil {
		closeFiles()
		return 0, err
	}
	if !s.watch.CompareAndSwap(nil, w) {
		closeFiles()
		return 0, ErrWatching
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer closeFiles()
		w.run(s.done)
		s.watch.CompareAndSwap(w, nil) // gone: no reads when deciding
	}()
	return pid, nil
}

// KeepWatchingLocalRedis keeps a watch of the local Redis (WatchLocalRedis)
// running: it tries now and then every `every` while none runs, so that a
// Redis unreachable when the process started, or restarted since (a new
// process), is watched once it answers. report gets the process id of
// every watch started, and each failure that differs from the one before
// (nil: none reported). It returns at once; the retries stop when ctx ends,
// at Close, or at ErrNoLocalWatch (reported).
func (s *Store) KeepWatchingLocalRedis(ctx context.Context, every time.Duration, report func(pid int, err error)) {
	if report == nil {
		report = func(int, error) {}
	}
	select {
	case <-s.done: // closed: no Add while Close waits
		return
	default:
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		t := time.NewTicker(every)
		defer t.Stop()
		last := ""
		for {
			actx, cancel := context.WithTimeout(ctx, every)
			pid, err := s.WatchLocalRedis(actx)
			cancel()
			switch {
			case err == nil:
				last = ""
				report(pid, nil)
			case errors.Is(err, ErrWatching):
			case errors.Is(err, ErrClosed):
				return
			case err.Error() != last:
				last = err.Error()
				report(0, err)
			}
			if errors.Is(err, ErrNoLocalWatch) {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-s.done:
				return
			case <-t.C:
			}
		}
	}()
}

// redisStarved reports a watched local Redis that spent most of the time
// since since waiting for a CPU.
func (s *Store) redisStarved(since int64) bool {
	w := s.watch.Load()
	return w != nil && w.starved(since)
}

func infoInt(info, field string) int {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	return 0
}

// processAge is how long ago process pid started (/proc/PID/stat field 22,
// in clock ticks since boot, against /proc/uptime). Linux's USER_HZ is 100.
func processAge(pid int) (time.Duration, error) {
	f, err := procStat(pid)
	if err != nil {
		return 0, err
	}
	ticks, err := strconv.ParseInt(f[19], 10, 64)
	if err != nil {
		return 0, err
	}
	upb, err := os.ReadFile("/proc/uptime")
	if err != nil {
		return 0, err
	}
	up, err := strconv.ParseFloat(strings.Fields(string(upb))[0], 64)
	if err != nil {
		return 0, err
	}
	return time.Duration(up*float64(time.Second)) - time.Duration(ticks)*10*time.Millisecond, nil
}

// loopback reports whether every open connection goes to a loopback
// address or a Unix socket, this host's (and there is one).
func (a *Activity) loopback() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.conns) == 0 {
		return false
	}
	for c := range a.conns {
		switch ra := c.RemoteAddr().(type) {
		case *net.TCPAddr:
			if !ra.IP.IsLoopback() {
				return false
			}
		case *net.UnixAddr:
		default:
			return false
		}
	}
	return true
}
