package stack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// linked reports whether srv has a live gateway connection to peer in each
// direction.
func linked(tb testing.TB, srv *server.Server, peer string) bool {
	tb.Helper()
	gwz, err := srv.Gatewayz(nil)
	if err != nil {
		tb.Fatal(err)
	}
	og := gwz.OutboundGateways[peer]
	return og != nil && og.Connection != nil && len(gwz.InboundGateways[peer]) > 0
}

// Partition cuts one region's gateways both ways and heals them: while cut,
// a message published in the cut region reaches no other region (and the
// other regions still reach each other); once healed, the gateways
// reconnect through the proxies by themselves and messages pass again.
func TestPartitionCutsAndHeals(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	ctx := context.Background()
	s, err := Start(ctx, Config{RegionNames: []string{"a", "b", "c"}, Partitionable: true, EmbeddedRedis: true,
		Delay: map[string]map[string]time.Duration{"a": {"b": 5 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if err := s.Partition("a", false); err != nil { // after Close: a no-op
			t.Errorf("partition after close: %v", err)
		}
	})
	if err := s.Partition("nowhere", true); err == nil {
		t.Error("partition of an unknown region accepted")
	}
	conns := make([]*nats.Conn, len(s.Regions))
	for i, r := range s.Regions {
		nc, err := nats.Connect(r.NATSURL)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		conns[i] = nc
	}
	got := make(chan string, 1024) // what b receives
	if _, err := conns[1].Subscribe("p", func(m *nats.Msg) { got <- string(m.Data) }); err != nil {
		t.Fatal(err)
	}
	conns[1].Flush()
	sawCut := false
	// passes publishes from conns[from] until b gets one: the link is up.
	passes := func(from int, what string) {
		t.Helper()
		n := 0
		testutil.WaitFor(t, 15*time.Second, what, func() bool {
			n++
			conns[from].Publish("p", fmt.Appendf(nil, "%s %d", what, n))
			conns[from].Flush()
			for {
				select {
				case m := <-got:
					sawCut = sawCut || m == "cut"
					if strings.HasPrefix(m, what) {
						return true
					}
				case <-time.After(50 * time.Millisecond):
					return false
				}
			}
		})
	}
	passes(0, "before")

	if err := s.Partition("a", true); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "a's gateways down", func() bool {
		for i, other := range []string{"b", "c"} {
			if linked(t, s.nats[0], other) || linked(t, s.nats[i+1], "a") {
				return false
			}
		}
		return true
	})
	// a has no gateway connection, so this message is dropped now or never:
	// core NATS does not hold messages for a later connection.
	conns[0].Publish("p", []byte("cut"))
	if err := conns[0].Flush(); err != nil {
		t.Fatal(err)
	}
	passes(2, "c during the cut") // b and c still reach each other

	if err := s.Partition("a", false); err != nil {
		t.Fatal(err)
	}
	passes(0, "healed")
	testutil.WaitFor(t, 15*time.Second, "a's gateways back", func() bool {
		return linked(t, s.nats[0], "b") && linked(t, s.nats[0], "c")
	})
	for len(got) > 0 {
		sawCut = sawCut || <-got == "cut"
	}
	if sawCut {
		t.Fatal("a message published in the cut region reached b")
	}
	// The gateways reconnected through the proxies, not to the peers' own
	// (advertised) addresses.
	ports := map[int]bool{}
	for _, p := range s.proxies {
		ports[p.ln.Addr().(*net.TCPAddr).Port] = true
	}
	for _, srv := range s.nats {
		gwz, err := srv.Gatewayz(nil)
		if err != nil {
			t.Fatal(err)
		}
		for name, og := range gwz.OutboundGateways {
			if og.Connection == nil || !ports[og.Connection.Port] {
				t.Errorf("%s: outbound gateway to %s bypasses the proxies: %+v", srv.Name(), name, og.Connection)
			}
		}
	}
}

// Without Partitionable, a link without delay has no proxy to cut.
func TestPartitionNeedsProxies(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	s, err := Start(context.Background(), Config{Regions: 2, EmbeddedRedis: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if err := s.Partition(s.Regions[0].Name, true); !errors.Is(err, ErrNoProxy) {
		t.Fatalf("partition without proxies: %v, want ErrNoProxy", err)
	}
}
