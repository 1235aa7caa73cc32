package stack

import (
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/launch"
	"github.com/apportion/apportion/internal/testutil"
	"github.com/nats-io/nats.go"
)

// echo serves one echo listener until the test ends.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
	return ln.Addr().String()
}

func TestDelayProxyDelaysBothDirectionsInOrder(t *testing.T) {
	const delay = 30 * time.Millisecond
	p, err := launch.NewDelayProxy(echo(t), delay)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	msg := strings.Repeat("0123456789", 1000)
	start := time.Now()
	go func() {
		for i := 0; i < len(msg); i += 1000 {
			c.Write([]byte(msg[i : i+1000]))
		}
	}()
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	rtt := time.Since(start)
	if string(got) != msg {
		t.Fatal("bytes reordered or changed")
	}
	if rtt < 2*delay || rtt > 2*delay+500*time.Millisecond {
		t.Fatalf("round trip %v, want about %v", rtt, 2*delay)
	}
	p.Close()
	p.Close() // twice is fine
	if _, err := net.DialTimeout("tcp", p.Addr(), 100*time.Millisecond); err == nil {
		t.Fatal("proxy still accepts after Close")
	}
}

// Named regions whose gateways run through delay proxies: a request from
// one region answered in the other takes at least the two one-way delays,
// and every gateway connection is its own link's proxy's (no bypass through
// gateway URLs learnt from the peer).
func TestStackDelayMatrixAndNames(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	testutil.RedisServerPath(t)
	const d = 40 * time.Millisecond
	s, err := Start(context.Background(), Config{
		RegionNames:  []string{"north", "south"},
		Delay:        map[string]map[string]time.Duration{"north": {"south": d}, "south": {"north": d}},
		SyncInterval: 200 * time.Millisecond, SyncLease: 2 * time.Second,
		Rules: []byte(globalRule2),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	if s.Regions[0].Name != "north" || s.Regions[1].Name != "south" {
		t.Fatalf("regions %v", s.Regions)
	}
	checkGatewayRoutes(t, s)
	north, err := nats.Connect(s.Regions[0].NATSURL)
	if err != nil {
		t.Fatal(err)
	}
	defer north.Close()
	south, err := nats.Connect(s.Regions[1].NATSURL)
	if err != nil {
		t.Fatal(err)
	}
	defer south.Close()
	if _, err := south.Subscribe("ping", func(m *nats.Msg) { m.Respond(m.Data) }); err != nil {
		t.Fatal(err)
	}
	south.Flush()
	var best time.Duration
	testutil.WaitFor(t, 10*time.Second, "a reply across the gateways", func() bool {
		start := time.Now()
		if _, err := north.Request("ping", []byte("x"), time.Second); err != nil {
			return false
		}
		best = time.Since(start)
		return true
	})
	for i := 0; i < 5; i++ {
		start := time.Now()
		if _, err := north.Request("ping", []byte("x"), time.Second); err == nil {
			best = min(best, time.Since(start))
		}
	}
	t.Logf("best round trip north -> south -> north: %v (one-way delay %v)", best, d)
	if best < 2*d {
		t.Fatalf("round trip %v, shorter than twice the one-way delay %v", best, d)
	}
}

const globalRule2 = `
- id: g
  match: { resource: "GET /g" }
  algorithm: token_bucket
  capacity: 100
  refill_per_second: 100
  scope: global
  regions: { north: 1, south: 1 }
  min_share: 0.1
`

// A delay on one link puts every link through a proxy of its own, the
// others without delay: a link without one would pass the gateway gossip
// on, and its server would learn and dial the other links' proxies. So
// every region can be cut, as with Partitionable.
func TestDelayOnOneLinkProxiesEveryLink(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	const d = 5 * time.Millisecond
	s, err := Start(context.Background(), Config{RegionNames: []string{"a", "b", "c"}, EmbeddedRedis: true,
		Delay: map[string]map[string]time.Duration{"a": {"b": d}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	if len(s.proxies) != 6 {
		t.Fatalf("%d proxies, want one per link of three regions, 6", len(s.proxies))
	}
	for _, p := range s.proxies {
		if want := s.cfg.Delay[p.from][p.to]; p.Delay() != want {
			t.Errorf("proxy %s -> %s: delay %v, want %v", p.from, p.to, p.Delay(), want)
		}
	}
	checkGatewayRoutes(t, s)
	if err := s.Partition("c", true); err != nil {
		t.Fatal(err)
	}
	if err := s.Partition("c", false); err != nil {
		t.Fatal(err)
	}
}
