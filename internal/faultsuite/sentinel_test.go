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

// failoverBound is how long after the primary is killed both rules must be
// answered from Redis again, on the promoted replica: Sentinel notices the
// primary down after 500 ms (down-after-milliseconds), elects itself and
// promotes the replica in about a second, go-redis follows the switch, and
// the breaker's open second passes.
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
// primary at port as master "m" with quorum 1, stopped when the test ends.
func startSentinel(t *testing.T, primaryPort int) string {
	t.Helper()
	bin := testutil.RedisServerPath(t)
	dir := t.TempDir()
	port := testutil.FreePort(t)
	conf := filepath.Join(dir, "sentinel.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(`port %d
bind 127.0.0.1
dir %s
logfile %s
sentinel monitor m 127.0.0.1 %d 1
sentinel down-after-milliseconds m 500
sentinel failover-timeout m 5000
sentinel parallel-syncs m 1
`, port, dir, filepath.Join(dir, "sentinel.log"), primaryPort)), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, conf, "--sentinel")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start redis-sentinel: %v", err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	addr := "127.0.0.1:" + strconv.Itoa(port)
	testutil.WaitFor(t, 10*time.Second, "sentinel sees the primary and its replica", func() bool {
		return strings.Contains(info(addr, "sentinel"), "status=ok,address=127.0.0.1:"+strconv.Itoa(primaryPort)+",slaves=1")
	})
	return addr
}

// TestSentinelFailover kills a Redis primary under load while ratelimitd
// follows it through Sentinel, and checks the failure policy during the
// failover, the time until the promoted replica answers, and how many
// tokens the failover re-granted: writes the old primary acknowledged but
// had not yet replicated are lost, so a bucket can hand out again what it
// already gave. On loopback the replica is never behind (nothing is lost);
// the second case puts 50 ms of latency on the replication link (a
// toxiproxy proxy between replica and primary, stopped with the primary),
// so that the writes of the last 50 ms before the kill are lost, and
// asserts they are seen.
func TestSentinelFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("fault suite: starts redis-server, a replica, redis-sentinel and ratelimitd")
	}
	zerolog.SetGlobalLevel(zerolog.Disabled)
	t.Cleanup(func() { zerolog.SetGlobalLevel(zerolog.TraceLevel) })
	t.Run("in-sync", func(t *testing.T) { failover(t, 0) })
	t.Run("replica-lag-50ms", func(t *testing.T) { failover(t, 50*time.Millisecond) })
}

func failover(t *testing.T, lag time.Duration) {
	primary := testutil.StartRedis(t)
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
	sentinel := startSentinel(t, primary.Port)

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
	samples := g.load("failover", failoverBound+5*time.Second, func(s sample) bool {
		if s.done.Sub(start) < 300*time.Millisecond {
			return false
		}
		killOnce.Do(func() {
			go func() {
				killMu.Lock()
				killedAt = time.Now()
				killMu.Unlock()
				kill()
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
		if policy["open"] == 0 || policy["closed"] == 0 {
			return false // not yet seen the primary gone
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
		t.Fatalf("not recovered (or quota not drained: %v) %v after the primary was killed (failure policy open %d closed %d)\nsentinel: %s\n%s\n%s",
			!drained, failoverBound+5*time.Second, policy["open"], policy["closed"], info(sentinel, "sentinel"), g.metrics(), g.stderr.String())
	}
	took := steadyAt.Sub(k)
	if took > failoverBound {
		t.Errorf("answered from the promoted replica %v after the primary was killed, above the bound %v", took, failoverBound)
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
	if quotaEmptyAtKill || quotaBeforeKill == 0 {
		t.Errorf("quota rule: %d admitted before the kill, empty at the kill %v: the failover did not interrupt its draining, nothing measured", quotaBeforeKill, quotaEmptyAtKill)
	}
	dur := steadyAt.Sub(k)
	t.Logf("sentinel failover (replica lag %v): %d checks in %v (%.0f/s); %d during the failover (%v): failed %d, failure policy open %d closed %d (closed admitted %d); latency p50 %v p99 %v max %v; answered from the promoted replica %v after the kill",
		lag, len(samples), span.Round(time.Millisecond), float64(len(samples))/span.Seconds(), len(lat), dur.Round(time.Millisecond),
		failed, policy["open"], policy["closed"], closedAdmitted, p50, p99, worst, took.Round(time.Millisecond))
	t.Logf("sentinel failover (replica lag %v): admitted from Redis on one key: open %d closed %d, bound %d (capacity %d + %d/s x %v + 1); re-granted open %d closed %d",
		lag, admitted["open"], admitted["closed"], bound, capacity, refill, span.Round(time.Millisecond), regranted["open"], regranted["closed"])
	t.Logf("sentinel failover (replica lag %v): quota (capacity %d, 1/s): %d admitted before the kill, %d in all, bound %d: re-granted by lost writes %d",
		lag, quotaCapacity, quotaBeforeKill, admitted["quota"], quotaCapacity+int(span.Seconds())+1, regranted["quota"])

	g.healthy(t, "sentinel-after")
}
