package faultsuite

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
)

// failoverBound is how long after the primary is killed (or SENTINEL
// FAILOVER is sent) both rules must be answered from Redis again, on the
// promoted replica: Sentinel notices the primary down after 500 ms
// (down-after-milliseconds), elects itself and promotes the replica in
// about a second, go-redis follows the switch, and the breaker's open
// second passes.
const failoverBound = 15 * time.Second

// quota is a third rule, failure_mode open, whose bucket is large and
// refills at 1/s: under load it is still being drawn from when the primary
// dies, and is drained after the failover, so that every admission the old
// primary acknowledged but had not replicated shows as an admission above
// its bound (quotaCapacity + 1/s x elapsed).
const quotaCapacity = 5000

// info returns the INFO section of the Redis (or Sentinel) at addr, or ""
// if it does not answer.
func info(addr, section string) string {
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 200 * time.Millisecond, MaxRetries: -1, PoolSize: 1, DisableIdentity: true})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	s, _ := c.Info(ctx, section).Result()
	return s
}

// startSentinel starts one redis-sentinel on a free port monitoring the
// primary at port as master "m" with quorum 1, stopped when the test ends,
// and returns its address and the path of its log.
func startSentinel(t *testing.T, primaryPort int) (addr, log string) {
	t.Helper()
	bin := testutil.RedisServerPath(t)
	dir := t.TempDir()
	port := testutil.FreePort(t)
	conf := filepath.Join(dir, "sentinel.conf")
	log = filepath.Join(dir, "sentinel.log")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(`port %d
bind 127.0.0.1
dir %s
logfile %s
sentinel monitor m 127.0.0.1 %d 1
sentinel down-after-milliseconds m 500
sentinel failover-timeout m 5000
sentinel parallel-syncs m 1
`, port, dir, log, primaryPort)), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, conf, "--sentinel")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start redis-sentinel: %v", err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	addr = "127.0.0.1:" + strconv.Itoa(port)
	testutil.WaitFor(t, 10*time.Second, "sentinel sees the primary and its replica", func() bool {
		return strings.Contains(info(addr, "sentinel"), "status=ok,address=127.0.0.1:"+strconv.Itoa(primaryPort)+",slaves=1")
	})
	return addr, log
}

// scriptCalls returns how many script calls (EVALSHA, EVAL) the Redis at c
// has run without an error, from its INFO commandstats.
func scriptCalls(ctx context.Context, c *redis.Client) (int64, error) {
	s, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, err
	}
	var n int64
	for _, l := range strings.Split(s, "\n") {
		name, stats, ok := strings.Cut(strings.TrimSpace(l), ":")
		if !ok || (name != "cmdstat_evalsha" && name != "cmdstat_eval") {
			continue
		}
		for _, kv := range strings.Split(stats, ",") {
			k, v, _ := strings.Cut(kv, "=")
			x, _ := strconv.ParseInt(v, 10, 64)
			switch k {
			case "calls":
				n += x
			case "failed_calls":
				n -= x
			}
		}
	}
	return n, nil
}

// switchWatch follows a planned failover from outside the enforcer: every
// few milliseconds it asks the replica for its role, the Sentinel for the
// address of m's primary, and the old primary for the script calls it has
// run, and records when the replica was promoted, when Sentinel switched
// to it (+switch-master), and when the old primary last ran a script (a
// check answered from it).
type switchWatch struct {
	mu         sync.Mutex
	promotedAt time.Time // first poll that saw the replica report role:master
	switchedAt time.Time // first poll that saw the Sentinel name the replica
	// atPromotion and calls are the old primary's script calls at the
	// promotion's poll and at the last poll that saw them grow.
	atPromotion, calls int64
	// The last growth was seen by the poll that returned at wroteBy; the
	// poll before it was sent at wroteAfter: the script ran in between.
	wroteAfter, wroteBy time.Time
	stop                chan struct{}
	done                chan struct{}
	closeOnce           sync.Once
}

func watchSwitch(sentinel, oldPrimary, replica string) *switchWatch {
	w := &switchWatch{stop: make(chan struct{}), done: make(chan struct{})}
	opts := func(addr string) *redis.Options {
		return &redis.Options{Addr: addr, DialTimeout: 200 * time.Millisecond, ReadTimeout: 500 * time.Millisecond, MaxRetries: -1, PoolSize: 1, DisableIdentity: true}
	}
	sc, oc, rc := redis.NewClient(opts(sentinel)), redis.NewClient(opts(oldPrimary)), redis.NewClient(opts(replica))
	go func() {
		defer close(w.done)
		defer sc.Close()
		defer oc.Close()
		defer rc.Close()
		ctx := context.Background()
		var last int64 = -1
		var prevSent time.Time
		for {
			sent := time.Now()
			promoted := false
			if s, err := rc.Info(ctx, "replication").Result(); err == nil {
				promoted = strings.Contains(s, "role:master")
			}
			// INFO's address changes at +switch-master (GET-MASTER-ADDR-BY-NAME
			// names the promoted replica earlier, from the promotion on).
			switched := false
			if s, err := sc.Info(ctx, "sentinel").Result(); err == nil {
				switched = strings.Contains(s, "address="+replica+",")
			}
			n, err := scriptCalls(ctx, oc)
			now := time.Now()
			w.mu.Lock()
			if err == nil {
				if last >= 0 && n > last {
					w.calls, w.wroteAfter, w.wroteBy = n, prevSent, now
				}
				if last < 0 {
					w.calls = n
				}
				last = n
			}
			if promoted && w.promotedAt.IsZero() {
				w.promotedAt, w.atPromotion = now, last
			}
			if switched && w.switchedAt.IsZero() {
				w.switchedAt = now
			}
			w.mu.Unlock()
			prevSent = sent
			select {
			case <-w.stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	return w
}

// state returns what the watch has seen so far.
func (w *switchWatch) state() (promotedAt, switchedAt, wroteAfter, wroteBy time.Time, afterPromotion int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.promotedAt.IsZero() {
		afterPromotion = w.calls - w.atPromotion
	}
	return w.promotedAt, w.switchedAt, w.wroteAfter, w.wroteBy, afterPromotion
}

// close stops the polls and waits for the last one; it may be called again.
func (w *switchWatch) close() { w.closeOnce.Do(func() { close(w.stop); <-w.done }) }

// TestSentinelFailover fails a Redis primary over under load while
// ratelimitd follows it through Sentinel, and checks the failure policy
// during the failover, the time until the promoted replica answers, and
// how many tokens the failover re-granted: writes the old primary
// acknowledged but the new one never got are lost, so a bucket can hand
// out again what it already gave. The first two cases kill the primary
// (SIGKILL). On loopback the replica is never behind (nothing is lost);
// the second case puts 50 ms of latency on the replication link (a
// toxiproxy proxy between replica and primary, stopped with the primary),
// so that the writes of the last 50 ms before the kill are lost, and
// asserts they are seen. The third is a planned failover (SENTINEL
// FAILOVER m) with the replica in sync: the old primary stays up and
// keeps taking the enforcer's writes from the replica's promotion until
// Sentinel switches to it (+switch-master) and go-redis follows; the old
// primary is then demoted and those writes are lost, and the case asserts
// they are seen. The fourth is the third with min-replicas-to-write 1 and
// min-replicas-max-lag 1 on the primary: it refuses writes as soon as the
// promoted replica leaves it, so the gap is answered by the failure policy
// instead, and the case asserts that next to nothing is re-granted.
func TestSentinelFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("fault suite: starts redis-server, a replica, redis-sentinel and ratelimitd")
	}
	zerolog.SetGlobalLevel(zerolog.Disabled)
	t.Cleanup(func() { zerolog.SetGlobalLevel(zerolog.TraceLevel) })
	t.Run("in-sync", func(t *testing.T) { failover(t, failoverCase{}) })
	t.Run("replica-lag-50ms", func(t *testing.T) { failover(t, failoverCase{lag: 50 * time.Millisecond}) })
	t.Run("planned", func(t *testing.T) { failover(t, failoverCase{planned: true}) })
	t.Run("planned-min-replicas", func(t *testing.T) { failover(t, failoverCase{planned: true, minReplicas: true}) })
}

// failoverCase is how the primary goes.
type failoverCase struct {
	// lag is latency put on the replication link (0: none).
	lag time.Duration
	// planned: the fault is SENTINEL FAILOVER m, sent to the Sentinel (the
	// old primary stays up and Sentinel demotes it); else the primary is
	// killed (SIGKILL).
	planned bool
	// minReplicas starts the primary (not the replica: with one replica,
	// a promoted replica so configured would refuse writes until Sentinel
	// has demoted the old primary and it has synced, about 10 s after the
	// switch) with min-replicas-to-write 1 and min-replicas-max-lag 1.
	minReplicas bool
}

// minReplicasSlack is how many tokens the planned failover may still
// re-grant with min-replicas-to-write on the primary: the checks it runs
// in the event-loop turn in which it sees the promoted replica go (at most
// one per load worker) and those it had answered whose writes were still
// on their way to the replica.
const minReplicasSlack = capacity

func (c failoverCase) String() string {
	s := fmt.Sprintf("replica lag %v", c.lag)
	if c.planned {
		s = "planned, " + s
	}
	if c.minReplicas {
		s += ", min-replicas-to-write 1"
	}
	return s
}

func failover(t *testing.T, fc failoverCase) {
	lag := fc.lag
	var args []string
	if fc.minReplicas {
		args = []string{"--min-replicas-to-write", "1", "--min-replicas-max-lag", "1"}
	}
	primary := testutil.StartRedis(t, args...)
	upstream := primary.Addr
	kill := primary.Stop // SIGKILL: what it had not replicated is lost
	if lag > 0 {
		proxy := newProxy(t, "replication", primary.Addr)
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(toxic("lag", "latency", "downstream", fmt.Sprintf(`"latency":%d`, lag.Milliseconds())))); err != nil {
			t.Fatal(err)
		}
		upstream = proxy.Listen
		// The proxy holds what it delayed: cut the link with it, so that
		// the replica never gets the last lag's worth of writes.
		kill = func() { proxy.Stop(); primary.Stop() }
	}
	host, port, _ := strings.Cut(upstream, ":")
	replica := testutil.StartRedis(t, "--replicaof", host, port)
	testutil.WaitFor(t, 10*time.Second, "replica in sync", func() bool {
		return strings.Contains(info(replica.Addr, "replication"), "master_link_status:up")
	})
	sentinel, sentinelLog := startSentinel(t, primary.Port)
	fault, event, since := kill, "the primary was killed", "the kill"
	var watch *switchWatch
	faultErr := make(chan error, 1)
	if fc.planned {
		event, since = "SENTINEL FAILOVER was sent", "SENTINEL FAILOVER"
		fault = func() {
			sc := redis.NewClient(&redis.Options{Addr: sentinel, MaxRetries: -1, PoolSize: 1, DisableIdentity: true})
			defer sc.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			faultErr <- sc.Do(ctx, "SENTINEL", "FAILOVER", "m").Err()
		}
	}
	sentinelTail := func() string {
		b, _ := os.ReadFile(sentinelLog)
		l := strings.Split(strings.TrimSpace(string(b)), "\n")
		return strings.Join(l[max(0, len(l)-30):], "\n")
	}

	rulesFile := filepath.Join(t.TempDir(), "rules.json")
	bucket := fmt.Sprintf(`"algorithm":"token_bucket","capacity":%d,"refill_per_second":%d`, capacity, refill)
	if err := os.WriteFile(rulesFile, []byte(`[`+
		`{"id":"open","match":{"resource":"GET /open"},`+bucket+`,"failure_mode":"open"},`+
		`{"id":"closed","match":{"resource":"GET /closed"},`+bucket+`,"failure_mode":"closed"},`+
		fmt.Sprintf(`{"id":"quota","match":{"resource":"GET /quota"},"algorithm":"token_bucket","capacity":%d,"refill_per_second":1,"failure_mode":"open"}]`, quotaCapacity)), 0o600); err != nil {
		t.Fatal(err)
	}
	g := runEnforcer(t, "--redis-sentinel-addrs", sentinel, "--redis-master-name", "m", "--rules", rulesFile)
	g.healthy(t, "sentinel-before")
	if t.Failed() {
		return
	}

	if fc.planned {
		watch = watchSwitch(sentinel, primary.Addr, replica.Addr)
		defer watch.close()
	}
	// One key for the whole failover: the bucket bound is checked across it.
	g.rules = []string{"open", "closed", "quota"}
	var (
		drained  bool // quota rejected by Redis after the failover
		killMu   sync.Mutex
		killedAt time.Time
		killOnce sync.Once
		start    = time.Now()
		policy   = map[string]int{} // failure-policy answers after the kill
		streak   = map[string]int{}
		steadyAt time.Time
	)
	killed := func() time.Time { killMu.Lock(); defer killMu.Unlock(); return killedAt }
	// gone reports whether the enforcer has left the old primary, so that
	// what Redis answers from then on comes from the promoted replica. A
	// killed primary: both rules have been answered by the failure policy.
	// A planned failover may bring few or no failure-policy answers, and
	// the old primary keeps answering until Sentinel switches: gone once
	// the Sentinel names the replica, for checks sent after that.
	gone := func(s sample) bool { return policy["open"] > 0 && policy["closed"] > 0 }
	if fc.planned {
		gone = func(s sample) bool {
			_, switchedAt, _, _, _ := watch.state()
			return !switchedAt.IsZero() && s.sent.After(switchedAt)
		}
	}
	samples := g.load("failover", failoverBound+5*time.Second, func(s sample) bool {
		if s.done.Sub(start) < 300*time.Millisecond {
			return false
		}
		killOnce.Do(func() {
			go func() {
				killMu.Lock()
				killedAt = time.Now()
				killMu.Unlock()
				fault()
			}()
		})
		k := killed()
		if k.IsZero() || s.sent.Before(k) {
			return false
		}
		if s.err != nil || s.failOpen {
			if s.err == nil {
				policy[s.rule]++
			}
			if s.rule != "quota" {
				streak = map[string]int{}
				steadyAt = time.Time{}
			}
			return false
		}
		if !gone(s) {
			return false // not yet seen the primary gone
		}
		if fc.planned {
			// A check the old primary ran after the steady streak began
			// was not answered from the new primary: begin again.
			if _, _, _, wroteBy, _ := watch.state(); !steadyAt.IsZero() && !wroteBy.Before(steadyAt) {
				streak = map[string]int{}
				steadyAt = time.Time{}
			}
		}
		if s.rule == "quota" {
			drained = drained || !s.allowed
		} else {
			if steadyAt.IsZero() {
				steadyAt = s.done
			}
			streak[s.rule]++
		}
		return drained && streak["open"] >= 10 && streak["closed"] >= 10 && s.done.Sub(steadyAt) >= steadyFor
	})
	g.rules = nil
	k := killed()
	if k.IsZero() || steadyAt.IsZero() || streak["open"] < 10 || streak["closed"] < 10 || !drained {
		t.Fatalf("not recovered (or quota not drained: %v) %v after %s (failure policy open %d closed %d)\nsentinel: %s\n%s\n%s\nsentinel log:\n%s",
			!drained, failoverBound+5*time.Second, event, policy["open"], policy["closed"], info(sentinel, "sentinel"), g.metrics(), g.stderr.String(), sentinelTail())
	}
	select {
	case err := <-faultErr:
		if err != nil {
			t.Errorf("SENTINEL FAILOVER m: %v", err)
		}
	default:
	}
	took := steadyAt.Sub(k)
	if took > failoverBound {
		t.Errorf("answered from the promoted replica %v after %s, above the bound %v", took, event, failoverBound)
	}
	if !strings.Contains(info(replica.Addr, "replication"), "role:master") {
		t.Errorf("the replica was not promoted: %s", info(replica.Addr, "replication"))
	}

	failed, closedAdmitted, quotaBeforeKill, quotaEmptyAtKill := 0, 0, 0, false
	admitted := map[string]int{} // from Redis, over the whole load
	first, last := samples[0].sent, samples[0].done
	var lat []time.Duration
	for _, s := range samples {
		if s.sent.Before(first) {
			first = s.sent
		}
		if s.done.After(last) {
			last = s.done
		}
		if !s.sent.Before(k) && s.sent.Before(steadyAt) {
			lat = append(lat, s.latency())
		}
		switch {
		case s.err != nil:
			failed++
			if failed <= 3 {
				t.Errorf("%s rule: check failed during the failover: %v", s.rule, s.err)
			}
		case s.rule == "open" && s.failOpen && !s.allowed:
			failed++
			t.Errorf("open rule: rejected by the failure policy during the failover")
		case s.rule == "closed" && s.failOpen && s.allowed:
			closedAdmitted++
		case s.allowed && !s.failOpen:
			admitted[s.rule]++
			if s.rule == "quota" && s.done.Before(k) {
				quotaBeforeKill++
			}
		case s.rule == "quota" && !s.failOpen && s.done.Before(k):
			quotaEmptyAtKill = true
		}
	}
	if closedAdmitted > 0 {
		t.Errorf("closed rule: %d checks admitted by the failure policy during the failover, want 0", closedAdmitted)
	}
	slices.Sort(lat)
	var p50, p99, worst time.Duration
	if len(lat) > 0 {
		p50, p99, worst = lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1]
	}
	if bound := 2*storeTimeout + latencySlack; p99 > bound {
		t.Errorf("latency during the failover: p99 %v, above the bound %v", p99, bound)
	}
	// Without lost writes a rule admits from Redis at most capacity +
	// refill x elapsed on one key (failure-policy answers touch no bucket).
	// What is above that was re-granted by the failover.
	span := last.Sub(first)
	bound := capacity + int(refill*span.Seconds()) + 1
	regranted := map[string]int{}
	for _, rule := range []string{"open", "closed", "quota"} {
		b, c := bound, capacity
		if rule == "quota" {
			b, c = quotaCapacity+int(span.Seconds())+1, quotaCapacity
		}
		regranted[rule] = max(0, admitted[rule]-b)
		if regranted[rule] > c {
			t.Errorf("rule %s admitted %d from Redis in %v across the failover, %d above its bucket's bound %d: more than one bucket's capacity (%d) re-granted",
				rule, admitted[rule], span.Round(time.Millisecond), regranted[rule], b, c)
		}
	}
	if lag > 0 && regranted["quota"] == 0 {
		t.Errorf("quota rule: nothing re-granted although the replica lagged %v behind the primary when it was killed: lost writes are not measured", lag)
	}
	if fc.planned && !fc.minReplicas && regranted["quota"] == 0 {
		t.Errorf("quota rule: nothing re-granted although the old primary took writes between the promotion and the switch: lost writes are not measured")
	}
	if fc.minReplicas {
		for _, rule := range []string{"open", "closed", "quota"} {
			if regranted[rule] > minReplicasSlack {
				t.Errorf("rule %s: %d re-granted with min-replicas-to-write 1 on the primary, want at most %d", rule, regranted[rule], minReplicasSlack)
			}
		}
		if policy["open"] == 0 || policy["closed"] == 0 {
			t.Errorf("failure policy open %d closed %d: the primary refused no write (NOREPLICAS) between the promotion and the switch", policy["open"], policy["closed"])
		}
	}
	if quotaEmptyAtKill || quotaBeforeKill == 0 {
		t.Errorf("quota rule: %d admitted before the kill, empty at the kill %v: the failover did not interrupt its draining, nothing measured", quotaBeforeKill, quotaEmptyAtKill)
	}
	dur := steadyAt.Sub(k)
	t.Logf("sentinel failover (%v): %d checks in %v (%.0f/s); %d during the failover (%v): failed %d, failure policy open %d closed %d (closed admitted %d); latency p50 %v p99 %v max %v; answered from the promoted replica %v after %s",
		fc, len(samples), span.Round(time.Millisecond), float64(len(samples))/span.Seconds(), len(lat), dur.Round(time.Millisecond),
		failed, policy["open"], policy["closed"], closedAdmitted, p50, p99, worst, took.Round(time.Millisecond), since)
	t.Logf("sentinel failover (%v): admitted from Redis on one key: open %d closed %d, bound %d (capacity %d + %d/s x %v + 1); re-granted open %d closed %d",
		fc, admitted["open"], admitted["closed"], bound, capacity, refill, span.Round(time.Millisecond), regranted["open"], regranted["closed"])
	t.Logf("sentinel failover (%v): quota (capacity %d, 1/s): %d admitted before %s, %d in all, bound %d: re-granted by lost writes %d",
		fc, quotaCapacity, quotaBeforeKill, since, admitted["quota"], quotaCapacity+int(span.Seconds())+1, regranted["quota"])

	g.healthy(t, "sentinel-after")
	if !fc.planned {
		return
	}
	// The enforcer must have left the old primary (still up, and still a
	// primary until Sentinel demotes it) for good: no script ran there
	// once the checks counted as answered from the new primary, through
	// the healthy phase after.
	watch.close()
	promotedAt, switchedAt, wroteAfter, wroteBy, afterPromotion := watch.state()
	if !wroteAfter.Before(steadyAt) {
		t.Errorf("the old primary ran a script between %v and %v after %s, after the checks counted as answered from the new primary (%v after)",
			wroteAfter.Sub(k).Round(time.Millisecond), wroteBy.Sub(k).Round(time.Millisecond), since, took.Round(time.Millisecond))
	}
	if promotedAt.IsZero() || switchedAt.IsZero() {
		t.Errorf("the watch saw the replica promoted at %v and Sentinel switch at %v (zero: never)", promotedAt, switchedAt)
	}
	t.Logf("sentinel failover (%v): replica promoted %v after %s, Sentinel switched %v after (%v later), as polled; the old primary ran %d script calls without error after the poll that saw the promotion, the last %v after %s; old primary now %s",
		fc, promotedAt.Sub(k).Round(time.Millisecond), since, switchedAt.Sub(k).Round(time.Millisecond), switchedAt.Sub(promotedAt).Round(time.Millisecond),
		afterPromotion, wroteBy.Sub(k).Round(time.Millisecond), since, role(primary.Addr))
}

// role returns the role line of the Redis at addr's INFO replication.
func role(addr string) string {
	for _, l := range strings.Split(info(addr, "replication"), "\n") {
		if strings.HasPrefix(l, "role:") {
			return strings.TrimSpace(l)
		}
	}
	return "unknown"
}
