package stack

import (
	"context"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/redis/go-redis/v9"
)

// restartBound is how long after a restart region a, whose clients send
// all the demand, may take to serve the whole limit again. After its Redis
// restarted empty: the agent sees the new run id at its next tick and
// writes every record and then its marker again (an interval and two
// store writes). After its agent restarted with no state: a new
// incarnation from etcd, its first marker, the peers hearing it and
// giving it the share back (the earlier incarnation is closed by the new
// one's marker, so its reclaim completes at once). Measured: see the
// test's log; the bound leaves room for ten regions under the race
// detector, as partitionHealBound does.
const restartBound = 15 * time.Second

// TestStackRestartLiveness restarts region a's Redis (empty, a new run id: the
// stack's RestartRedis), then its sync agent (stopped, so that its
// store's marker lapses and a falls to its floor, then started again with
// no state), then flushes a's Redis (FLUSHALL: the same run id), then
// stops every region's agent and starts them all again, while a's clients
// send twice a global limit, on the real stack at 2 and 10 regions and at
// 1/s and 10,000/s. After each, a serves the whole limit again within
// restartBound.
func TestStackRestartLiveness(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	testutil.RedisServerPath(t)
	eachSize(t, restartLiveness)
}

func restartLiveness(t *testing.T, n int, rate int64) {
	ctx := context.Background()
	g := startGlobal(t, n, rate, 3*time.Second)
	s, limit, serving := g.s, g.limit, g.serving

	// Redis restarts empty. Checks in the moment it is down are answered by
	// the failure policy (not serving here); none once it is back.
	runID := redisRunID(t, s.Regions[0].RedisAddr)
	before := runID()
	g.failOpenOK = true
	if err := s.RestartRedis("a"); err != nil {
		t.Fatal(err)
	}
	restarted := time.Now()
	if after := runID(); after == before {
		t.Fatalf("Redis run id %s before and after the restart: it did not restart", after)
	}
	testutil.WaitFor(t, restartBound, "a to serve the limit again after its Redis restarted", func() bool { return limit() >= serving })
	t.Logf("Redis restarted: a enforces %d of %d again after %v (bound %v)", limit(), rate, time.Since(restarted).Round(time.Millisecond), restartBound)
	g.failOpenOK = false

	// The agent stops; once a's marker has lapsed (a at its floor, 0),
	// it starts again with no state.
	if err := s.StopAgent("a"); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	testutil.WaitFor(t, 10*time.Second, "a to fall to its floor with its agent down", func() bool { return limit() == 0 })
	t.Logf("agent stopped: a at its floor after %v", time.Since(stopped).Round(time.Millisecond))
	if err := s.StartAgent(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	testutil.WaitFor(t, restartBound, "a to serve the limit again after its agent restarted", func() bool { return limit() >= serving })
	t.Logf("agent started again: a enforces %d of %d after %v (bound %v)", limit(), rate, time.Since(back).Round(time.Millisecond), restartBound)
	if err := s.StartAgent(ctx, "a"); err == nil {
		t.Error("StartAgent of a running agent: no error")
	}

	// a's Redis loses its data without a restart (FLUSHALL: the run id
	// stays): the agent's next marker renewal finds no marker and
	// re-asserts every share as after a restart.
	rc := redis.NewClient(&redis.Options{Addr: s.Regions[0].RedisAddr})
	defer rc.Close()
	before = runID()
	if err := rc.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	flushed := time.Now()
	if limit() != 0 {
		t.Fatal("a serves more than its floor right after FLUSHALL: the flush did not reach its bucket")
	}
	testutil.WaitFor(t, restartBound, "a to serve the limit again after FLUSHALL", func() bool { return limit() >= serving })
	t.Logf("Redis flushed: a enforces %d of %d again after %v (bound %v)", limit(), rate, time.Since(flushed).Round(time.Millisecond), restartBound)
	if after := runID(); after != before {
		t.Fatalf("Redis run id %s before FLUSHALL and %s after: it restarted", before, after)
	}

	// Every region's agent stops; once a is at its floor, they all start
	// again with no state.
	for _, r := range s.Regions {
		if err := s.StopAgent(r.Name); err != nil {
			t.Fatal(err)
		}
	}
	testutil.WaitFor(t, 10*time.Second, "a to fall to its floor with every agent down", func() bool { return limit() == 0 })
	for _, r := range s.Regions {
		if err := s.StartAgent(ctx, r.Name); err != nil {
			t.Fatal(err)
		}
	}
	back = time.Now()
	testutil.WaitFor(t, restartBound, "a to serve the limit again after every agent restarted", func() bool { return limit() >= serving })
	t.Logf("every agent started again: a enforces %d of %d after %v (bound %v)", limit(), rate, time.Since(back).Round(time.Millisecond), restartBound)
}

// redisRunID returns a function that answers the run id of the Redis
// server at addr, waiting for it to answer.
func redisRunID(t *testing.T, addr string) func() string {
	t.Helper()
	rc := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { rc.Close() })
	st, err := redisstore.New(rc)
	if err != nil {
		t.Fatal(err)
	}
	return func() string {
		t.Helper()
		var id string
		testutil.WaitFor(t, 10*time.Second, "Redis to answer INFO", func() bool {
			id, err = st.RunID(context.Background())
			return err == nil
		})
		return id
	}
}
