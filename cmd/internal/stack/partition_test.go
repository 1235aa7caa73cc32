package stack

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
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
	// Both ends of each link: a's view of its connections can be complete
	// before c lists its inbound one from a (the flake: "c: no inbound
	// gateway connection from a" in checkGatewayRoutes).
	testutil.WaitFor(t, 15*time.Second, "a's gateways back", func() bool {
		return linked(t, s.nats[0], "b") && linked(t, s.nats[0], "c") && linked(t, s.nats[1], "a") && linked(t, s.nats[2], "a")
	})
	for len(got) > 0 {
		sawCut = sawCut || <-got == "cut"
	}
	if sawCut {
		t.Fatal("a message published in the cut region reached b")
	}
	// The gateways reconnected through their own links' proxies, not to
	// the peers' own addresses nor through another link's proxy.
	checkGatewayRoutes(t, s)
}

// checkGatewayRoutes fails t unless every gateway connection of the stack,
// in both directions, goes through the proxy of its own link: each server's
// outbound connection to a peer is connected to its proxy to that peer,
// each inbound connection from a peer comes from the peer's proxy to it,
// and the only URL a server holds for a peer is its proxy's (so that a
// reconnect dials it too). Call it with every gateway connected.
func checkGatewayRoutes(t *testing.T, s *Stack) {
	t.Helper()
	for i, srv := range s.nats {
		me := s.cfg.RegionNames[i]
		gwz, err := srv.Gatewayz(nil)
		if err != nil {
			t.Fatal(err)
		}
		vz, err := srv.Varz(nil)
		if err != nil {
			t.Fatal(err)
		}
		urls := map[string][]string{}
		for _, g := range vz.Gateway.Gateways {
			urls[g.Name] = g.URLs
		}
		for _, peer := range s.cfg.RegionNames {
			if peer == me {
				continue
			}
			out, in := s.proxy(me, peer), s.proxy(peer, me)
			if out == nil || in == nil {
				t.Errorf("gateway links %s <-> %s: proxies %v and %v", me, peer, out, in)
				continue
			}
			og := gwz.OutboundGateways[peer]
			if og == nil || og.Connection == nil || og.Connection.Port != portOf(out.Addr()) {
				var conn any
				if og != nil {
					conn = og.Connection
				}
				t.Errorf("%s -> %s: outbound gateway connection %+v, want one through its proxy at %s", me, peer, conn, out.Addr())
			}
			upstream := in.UpstreamPorts()
			if len(gwz.InboundGateways[peer]) == 0 {
				t.Errorf("%s: no inbound gateway connection from %s", me, peer)
			}
			for _, ig := range gwz.InboundGateways[peer] {
				if ig.Connection == nil || !upstream[ig.Connection.Port] {
					t.Errorf("%s <- %s: inbound gateway connection %+v does not come from the proxy %s -> %s (its connections from ports %v)",
						me, peer, ig.Connection, peer, me, upstream)
				}
			}
			if got := urls[peer]; len(got) != 1 || got[0] != out.Addr() {
				t.Errorf("%s knows %s's gateway at %v, want only its proxy %s", me, peer, got, out.Addr())
			}
		}
	}
}

// crossing is a message published in region from and received in region
// to, with its payload.
type crossing struct{ from, to, tag string }

// crossings has a NATS client in every region of a stack, each subscribed
// to what the others publish on cross.<region>; what they receive is
// checked against the cuts (note).
type crossings struct {
	s     *Stack
	conns []*nats.Conn
	got   chan crossing
	// cutTags holds the tags published during the cut of a region (tag ->
	// region): none of them may ever cross between that region and another.
	cutTags  map[string]string
	reported map[crossing]bool // the breaches reported (tag "")
}

func newCrossings(t *testing.T, s *Stack) *crossings {
	x := &crossings{s: s, got: make(chan crossing, 1<<16), cutTags: map[string]string{}, reported: map[crossing]bool{}}
	for _, r := range s.Regions {
		nc, err := nats.Connect(r.NATSURL)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		to := r.Name
		if _, err := nc.Subscribe("cross.>", func(m *nats.Msg) {
			if from := strings.TrimPrefix(m.Subject, "cross."); from != to {
				x.got <- crossing{from: from, to: to, tag: string(m.Data)}
			}
		}); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		x.conns = append(x.conns, nc)
	}
	return x
}

// publish publishes tag from every region and flushes: the local servers
// have it when publish returns.
func (x *crossings) publish(t *testing.T, tag string) {
	t.Helper()
	for i, nc := range x.conns {
		if err := nc.Publish("cross."+x.s.Regions[i].Name, []byte(tag)); err != nil {
			t.Fatal(err)
		}
	}
	for _, nc := range x.conns {
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
}

// note fails t when c was published during the cut of a region and
// crossed between it and another.
func (x *crossings) note(t *testing.T, c crossing) {
	t.Helper()
	if cut, ok := x.cutTags[c.tag]; ok && (c.from == cut || c.to == cut) && !x.reported[crossing{from: c.from, to: c.to}] {
		x.reported[crossing{from: c.from, to: c.to}] = true
		t.Errorf("a message published in %s during the cut of %s reached %s", c.from, cut, c.to)
	}
}

// await publishes tag from every region every 50 ms until it has crossed
// between every ordered pair of regions, and returns how long that took;
// it fails t after within.
func (x *crossings) await(t *testing.T, tag string, within time.Duration) time.Duration {
	t.Helper()
	var names []string
	for _, r := range x.s.Regions {
		names = append(names, r.Name)
	}
	return x.awaitAmong(t, tag, within, names...)
}

// awaitAmong is await for the ordered pairs of the regions named only.
func (x *crossings) awaitAmong(t *testing.T, tag string, within time.Duration, regions ...string) time.Duration {
	t.Helper()
	want := map[[2]string]bool{}
	for _, a := range regions {
		for _, b := range regions {
			if a != b {
				want[[2]string{a, b}] = true
			}
		}
	}
	start := time.Now()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(within)
	x.publish(t, tag)
	for len(want) > 0 {
		select {
		case c := <-x.got:
			x.note(t, c)
			if c.tag == tag {
				delete(want, [2]string{c.from, c.to})
			}
		case <-tick.C:
			x.publish(t, tag)
		case <-deadline:
			var missing []string
			for p := range want {
				missing = append(missing, p[0]+" -> "+p[1])
			}
			slices.Sort(missing)
			t.Fatalf("%s: after %v, nothing crossed %s", tag, within, strings.Join(missing, ", "))
		}
	}
	return time.Since(start)
}

// duringCut publishes a tag of the cut of region from every region every
// 20 ms for d, and returns how many crossed each ordered pair meanwhile.
func (x *crossings) duringCut(t *testing.T, region string, d time.Duration) map[[2]string]int {
	t.Helper()
	crossed := map[[2]string]int{}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	end := time.After(d)
	for n := 0; ; {
		select {
		case c := <-x.got:
			x.note(t, c)
			if x.cutTags[c.tag] == region {
				crossed[[2]string{c.from, c.to}]++
			}
		case <-tick.C:
			n++
			tag := fmt.Sprintf("cut of %s, %d", region, n)
			x.cutTags[tag] = region
			x.publish(t, tag)
		case <-end:
			return crossed
		}
	}
}

// joined lists the gateway connections between region and the others, as
// either side sees them ("a -> b out", "b <- a in").
func joined(t *testing.T, s *Stack, region string) []string {
	t.Helper()
	var links []string
	for i, srv := range s.nats {
		me := s.cfg.RegionNames[i]
		gwz, err := srv.Gatewayz(nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, peer := range s.cfg.RegionNames {
			if peer == me || (me != region && peer != region) {
				continue
			}
			if og := gwz.OutboundGateways[peer]; og != nil && og.Connection != nil {
				links = append(links, fmt.Sprintf("%s -> %s out (to port %d)", me, peer, og.Connection.Port))
			}
			if n := len(gwz.InboundGateways[peer]); n > 0 {
				links = append(links, fmt.Sprintf("%s <- %s in (%d)", me, peer, n))
			}
		}
	}
	return links
}

// cutWindow is how long TestPartitionCutsBothWays publishes across a cut,
// and healBound how soon after the heal messages must cross every way
// again: a server redials a dropped gateway about every second (nats-server
// waits 1 s plus up to 0.1 s, then 1 s between rounds of attempts; during a
// cut each attempt reaches the proxy and is closed) and sends its interest
// once connected. Measured 0.65-0.71 s, with -race too.
const (
	cutWindow = 400 * time.Millisecond
	healBound = 10 * time.Second
)

// TestPartitionCutsBothWays cuts each region of three in turn, after the
// gateways have reconnected from the previous cut (when a server used to
// dial another link's proxy, learnt from the gateway gossip): during each
// cut no message crosses between the cut region and the others in either
// direction, while the other two still reach each other; after each heal,
// messages cross between every pair both ways within healBound, and every
// gateway connection goes through its own link's proxy.
func TestPartitionCutsBothWays(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	s := startStack(t, Config{RegionNames: []string{"a", "b", "c"}, Partitionable: true, EmbeddedRedis: true})
	x := newCrossings(t, s)
	x.await(t, "before the cuts", 15*time.Second)
	checkGatewayRoutes(t, s)
	for round, region := range []string{"a", "b", "c", "a"} {
		if err := s.Partition(region, true); err != nil {
			t.Fatal(err)
		}
		// Until the servers have seen the cut connections close; then a
		// link that stayed up is a cut that did not hold.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			links := joined(t, s, region)
			if len(links) == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("cut of %s: 10 s on, gateway connections still join it to the others: %s", region, strings.Join(links, ", "))
				break
			}
		}
		crossed := x.duringCut(t, region, cutWindow)
		for _, from := range s.cfg.RegionNames {
			for _, to := range s.cfg.RegionNames {
				pair := [2]string{from, to}
				switch {
				case from == to:
				case from == region || to == region:
					if crossed[pair] > 0 {
						t.Errorf("cut of %s: %d messages crossed %s -> %s", region, crossed[pair], from, to)
					}
				case crossed[pair] == 0:
					t.Errorf("cut of %s: nothing crossed %s -> %s, which are not cut", region, from, to)
				}
			}
		}
		if err := s.Partition(region, false); err != nil {
			t.Fatal(err)
		}
		took := x.await(t, fmt.Sprintf("healed %s (%d)", region, round), healBound)
		t.Logf("cut of %s: published across it for %v; after the heal messages crossed every way within %v (bound %v)",
			region, cutWindow, took.Round(time.Millisecond), healBound)
		checkGatewayRoutes(t, s)
		if t.Failed() {
			t.FailNow()
		}
	}
}

// TestPartitionSeveralRegionsAtOnce cuts three regions of four at once
// over the fault control (as rlstack's users do) and heals them one after
// the other. A link is cut while either of its regions is: once the first
// is healed, it and the region never cut reach each other again, while the
// two still cut stay cut off from every region, each other included. Once
// all are healed, every pair of regions is linked again and a message
// published in each region reaches every other within healBound, and the
// fault control says no region is cut. (The first heal used to restore
// every link of the region, those to the regions still cut included; the
// fault control then took those regions for healed, refused to heal them,
// and their other links stayed cut for good.)
func TestPartitionSeveralRegionsAtOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	names := []string{"a", "b", "c", "d"}
	s := startStack(t, Config{RegionNames: names, Partitionable: true, EmbeddedRedis: true, FaultsAddr: "127.0.0.1:0"})
	base := "http://" + s.FaultsAddr + FaultsPath
	fault := func(action, region string) {
		t.Helper()
		resp, err := http.Post(base+"/"+action+"?region="+region, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("POST %s?region=%s: %d %s", action, region, resp.StatusCode, bytes.TrimSpace(b))
		}
	}
	// wantCut checks that the fault control says exactly the regions cut
	// are, and that each link's proxy is cut if and only if one of its
	// regions is.
	wantCut := func(when string, cut ...string) {
		t.Helper()
		resp, err := http.Get(base)
		if err != nil {
			t.Fatal(err)
		}
		var st FaultState
		err = json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range st.Regions {
			if want := slices.Contains(cut, r.Region); r.Cut != want {
				t.Errorf("%s: GET %s says %s cut: %v, want %v", when, FaultsPath, r.Region, r.Cut, want)
			}
		}
		for _, p := range s.proxies {
			if want := slices.Contains(cut, p.from) || slices.Contains(cut, p.to); p.IsCut() != want {
				t.Errorf("%s: link %s -> %s cut: %v, want %v", when, p.from, p.to, p.IsCut(), want)
			}
		}
	}
	x := newCrossings(t, s)
	x.await(t, "before the cuts", 15*time.Second)

	cut := []string{"a", "b", "c"}
	for _, r := range cut {
		fault("cut", r)
	}
	wantCut("after the cuts", cut...)
	testutil.WaitFor(t, 10*time.Second, "the cut regions' gateways down", func() bool {
		for _, r := range cut {
			if len(joined(t, s, r)) > 0 {
				return false
			}
		}
		return true
	})

	fault("heal", "a")
	wantCut("a healed", "b", "c")
	took := x.awaitAmong(t, "a healed", healBound, "a", "d")
	t.Logf("a healed: a and d reached each other within %v", took.Round(time.Millisecond))
	crossed := x.duringCut(t, "b", cutWindow) // b's cut tags: note reports any that crosses to or from b
	for pair, n := range crossed {
		if n > 0 && (slices.Contains(pair[:], "b") || slices.Contains(pair[:], "c")) {
			t.Errorf("a healed, b and c still cut: %d messages crossed %s -> %s", n, pair[0], pair[1])
		}
	}
	if crossed[[2]string{"a", "d"}] == 0 || crossed[[2]string{"d", "a"}] == 0 {
		t.Errorf("a healed: a and d, neither cut, did not reach each other both ways: %v", crossed)
	}
	for _, r := range []string{"b", "c"} {
		if links := joined(t, s, r); len(links) > 0 {
			t.Errorf("a healed, %s still cut: gateway connections join it to others: %s", r, strings.Join(links, ", "))
		}
	}

	fault("heal", "b")
	fault("heal", "c")
	wantCut("all healed")
	took = x.await(t, "all healed", healBound)
	t.Logf("all healed: messages crossed between every pair both ways within %v (bound %v)", took.Round(time.Millisecond), healBound)
	testutil.WaitFor(t, healBound, "every pair of regions linked", func() bool {
		for i, srv := range s.nats {
			for _, peer := range names {
				if peer != names[i] && !linked(t, srv, peer) {
					return false
				}
			}
		}
		return true
	})
	checkGatewayRoutes(t, s)
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

// portOf is the port of a "host:port" address (0 if it has none).
func portOf(addr string) int {
	_, p, _ := net.SplitHostPort(addr)
	n, _ := strconv.Atoi(p)
	return n
}
