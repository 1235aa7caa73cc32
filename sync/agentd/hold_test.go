package agentd

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// elected campaigns at key with a new session of the campaign's TTL and
// returns the session and election once elected.
func elected(t *testing.T, ec *clientv3.Client, key string) (*concurrency.Session, *concurrency.Election) {
	t.Helper()
	sess, err := concurrency.NewSession(ec, concurrency.WithTTL(campaignTTL))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	el := concurrency.NewElection(sess, key)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := el.Campaign(ctx, "me"); err != nil {
		t.Fatal(err)
	}
	return sess, el
}

// holding runs holdTerm for a term and returns a channel that gets its
// result when it returns.
func holding(t *testing.T, ec *clientv3.Client, sess *concurrency.Session, el *concurrency.Election, log *slog.Logger, other <-chan struct{}) chan []*concurrency.Session {
	t.Helper()
	term, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	out := make(chan []*concurrency.Session, 1)
	go func() { out <- holdTerm(term, context.Background(), ec, sess, el, log, other) }()
	return out
}

// TestHoldTermResumes: a leader whose session stopped renewing (the lease
// still alive in etcd, as after an etcd outage shorter than the lease
// extension etcd gives on restart) keeps its term and renews the same
// lease: its key stays the leader's.
func TestHoldTermResumes(t *testing.T) {
	e := testutil.StartEtcd(t)
	ec := e.Client(t)
	sess, el := elected(t, ec, "/test/leader")
	logs := &testutil.SyncBuffer{}
	held := holding(t, ec, sess, el, slog.New(slog.NewTextHandler(logs, nil)), nil)
	sess.Orphan() // the keepalive stops: Done closes, the lease lives on for its TTL
	testutil.WaitFor(t, 10*time.Second, "the session resumed", func() bool {
		return strings.Contains(logs.String(), "etcd session resumed")
	})
	select {
	case <-held:
		t.Fatalf("the term ended: %s", logs)
	default:
	}
	// Renewed: past the TTL the key is still there and still the leader's.
	time.Sleep(time.Duration(campaignTTL+1) * time.Second) // the lease would have expired unrenewed
	resp, err := el.Leader(context.Background())
	if err != nil || string(resp.Kvs[0].Key) != el.Key() {
		t.Fatalf("leader after the TTL: %v %v, want our key %s (renewed)", resp, err, el.Key())
	}
}

// TestHoldTermStepsDownForAnotherLeader: once etcd names another leader,
// the term ends.
func TestHoldTermStepsDownForAnotherLeader(t *testing.T) {
	e := testutil.StartEtcd(t)
	ec := e.Client(t)
	sess, el := elected(t, ec, "/test/leader")
	logs := &testutil.SyncBuffer{}
	sess.Orphan()
	// Our lease ends (as when etcd expired it while we could not reach it)
	// and another process is elected.
	if _, err := ec.Revoke(context.Background(), sess.Lease()); err != nil {
		t.Fatal(err)
	}
	elected(t, ec, "/test/leader")
	held := holding(t, ec, sess, el, slog.New(slog.NewTextHandler(logs, nil)), nil)
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatalf("the term went on under another leader: %s", logs)
	}
	if !strings.Contains(logs.String(), "another process leads") {
		t.Fatalf("log %q, want it to say another process leads", logs)
	}
}

// TestHoldTermStepsDownForAnotherAgent: while etcd is unreachable, hearing
// another agent of the region ends the term (a standby elected while this
// leader was cut off from etcd).
func TestHoldTermStepsDownForAnotherAgent(t *testing.T) {
	e := testutil.StartEtcd(t)
	ec := e.Client(t)
	sess, el := elected(t, ec, "/test/leader")
	e.Stop()
	logs := &testutil.SyncBuffer{}
	other := make(chan struct{}, 1)
	held := holding(t, ec, sess, el, slog.New(slog.NewTextHandler(logs, nil)), other)
	testutil.WaitFor(t, 20*time.Second, "the session lost", func() bool {
		return strings.Contains(logs.String(), "etcd session lost")
	})
	select {
	case <-held:
		t.Fatalf("the term ended with etcd unreachable and no other agent: %s", logs)
	default:
	}
	other <- struct{}{}
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatalf("the term went on after another agent was heard: %s", logs)
	}
	if !strings.Contains(logs.String(), "another agent of this region is heard") {
		t.Fatalf("log %q", logs)
	}
}

// TestStandbyLeaderActsThroughEtcdOutage: with --standby, an etcd outage
// longer than the election's lease leaves the leader acting (its region's
// global rules would otherwise sit at their floors for the whole outage),
// the standby standing by, and after etcd returns the same term goes on.
func TestStandbyLeaderActsThroughEtcdOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	r := testutil.StartRedis(t)
	ns := testutil.StartNATS(t)
	e := testutil.StartEtcd(t)
	args := []string{"--region", "a", "--redis-addr", r.Addr, "--nats-url", ns.ClientURL(), "--etcd-endpoints", e.Endpoint,
		"--http-addr", "127.0.0.1:0", "--standby", "--report-seed-file", testSeedFile(t, "a")}
	log1, log2 := &testutil.SyncBuffer{}, &testutil.SyncBuffer{}
	p1 := startCommandLog(t, log1, args...)
	leader := func(rc *runningCommand) bool {
		_, body := rc.get("/metrics")
		return strings.Contains(body, `apportion_sync_leader{region="a"} 1`)
	}
	testutil.WaitFor(t, 20*time.Second, "the first to lead", func() bool { return leader(p1) })
	p2 := startCommandLog(t, log2, args...)
	testutil.WaitFor(t, 20*time.Second, "the second to campaign", func() bool {
		return strings.Contains(log2.String(), "standby: campaigning")
	})

	e.Stop()
	start := time.Now()
	testutil.WaitFor(t, 30*time.Second, "the leader's session lost", func() bool {
		return strings.Contains(log1.String(), "etcd session lost; acting on")
	})
	t.Logf("session lost %v after etcd stopped", time.Since(start).Round(100*time.Millisecond))
	// A few retries of holdTerm with etcd down: still acting.
	time.Sleep(3 * holdRetry)
	if !leader(p1) || leader(p2) {
		t.Fatalf("with etcd down: leader gauges %v and %v, want the first only\n%s", leader(p1), leader(p2), log1)
	}
	if c, body := p1.get("/readyz"); c != http.StatusOK || strings.Contains(body, "standby") {
		t.Fatalf("leader /readyz with etcd down: %d %q, want 200 as the agent", c, body)
	}

	e.Restart(t)
	testutil.WaitFor(t, 30*time.Second, "the session resumed", func() bool {
		return strings.Contains(log1.String(), "etcd session resumed")
	})
	if strings.Count(log1.String(), "elected; acting") != 1 || strings.Contains(log1.String(), "stepping down") || !leader(p1) || leader(p2) {
		t.Fatalf("after etcd returned: want the same term on the first, the second standing by\nfirst:\n%s\nsecond:\n%s", log1, log2)
	}
}
