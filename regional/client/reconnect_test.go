package client_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/client"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// TestReconnectAfterOutage: a Client whose enforcer was down answers from
// the enforcer again within about a second of it serving, however long the
// outage. Before, the Client used gRPC's default reconnect backoff (1s,
// growing 1.6 times per failed attempt up to 120s), and calls fail fast
// while it waits: after an outage of 11s the next attempt came about 5s
// after the enforcer was back (after 150s, about 30s), and every check in
// between was answered by the failure policy: with FailOpen, unlimited.
//
// The outage is 11s because gRPC's default attempts then fall at about 9.3s
// and 15.8s (±20% jitter each) after the connection broke, so the old
// client waits about 5s; with the Client's bounded backoff the wait is at
// most about 1.2s.
func TestReconnectAfterOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server and waits out an 11s outage")
	}
	r := testutil.StartRedis(t)
	rc := redis.NewClient(&redis.Options{Addr: r.Addr})
	t.Cleanup(func() { rc.Close() })
	rs := []rules.Rule{tokenBucket("orders", "POST /orders", 1000)}
	e, stop, err := serveEnforcer(rc, rs)
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(t, client.WithAddress(e.addr), client.WithTimeout(time.Second))
	ctx := context.Background()
	req := client.Request{ClientKey: "user:1", Resource: "POST /orders"}
	if d, err := c.Check(ctx, req); err != nil || d.Unreachable != nil || d.RuleID != "orders" {
		t.Fatalf("before the outage: %+v, %v; want an answer of the enforcer", d, err)
	}

	stop()
	const outage = 11 * time.Second
	tick := time.NewTicker(100 * time.Millisecond) // one check every 100ms, as the report did
	defer tick.Stop()
	for end := time.Now().Add(outage); time.Now().Before(end); <-tick.C {
		if d, err := c.Check(ctx, req); err != nil || d.Unreachable == nil || !d.Allowed {
			t.Fatalf("enforcer down: %+v, %v; want the failure policy's answer (allowed, Unreachable set)", d, err)
		}
	}

	// The enforcer again, on the same address and store.
	l := listenAgain(t, e.addr)
	_, stop, err = serveEnforcerOn(l, rc, rs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	serving := time.Now() // l is bound: connections are accepted from now on
	fast := time.NewTicker(10 * time.Millisecond)
	defer fast.Stop()
	for n := 0; ; n++ {
		d, err := c.Check(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if d.Unreachable == nil {
			if took := time.Since(serving); took > 2*time.Second {
				t.Errorf("first answer of the enforcer %v after it was serving again (%d failure-policy answers in between), want within 2s", took.Round(time.Millisecond), n)
			} else {
				t.Logf("first answer of the enforcer %v after it was serving again", took.Round(time.Millisecond))
			}
			if d.RuleID != "orders" || !d.Allowed {
				t.Errorf("after the outage: %+v, want allowed by orders", d)
			}
			return
		}
		if time.Since(serving) > 15*time.Second {
			t.Fatalf("still answered by the failure policy 15s after the enforcer was back: %v", d.Unreachable)
		}
		<-fast.C
	}
}

// listenAgain listens on addr, which a stopped server just left: briefly
// retried, in case the port is not free at once.
func listenAgain(t *testing.T, addr string) net.Listener {
	t.Helper()
	var l net.Listener
	var err error
	retry := time.NewTicker(20 * time.Millisecond)
	defer retry.Stop()
	for end := time.Now().Add(5 * time.Second); ; <-retry.C {
		if l, err = net.Listen("tcp", addr); err == nil || time.Now().After(end) {
			break
		}
	}
	if err != nil {
		t.Fatalf("listen on %s again: %v", addr, err)
	}
	return l
}
