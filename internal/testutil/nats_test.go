package testutil

import (
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

func TestStartNATS(t *testing.T) {
	if testing.Short() {
		t.Skip("starts an embedded nats-server")
	}
	s := StartNATS(t, func(o *server.Options) { o.MaxPayload = 4096 })
	nc := s.Connect(t)
	if got := nc.MaxPayload(); got != 4096 {
		t.Fatalf("MaxPayload = %d, want 4096 (configure not applied)", got)
	}
	msgs := make(chan *nats.Msg, 1)
	if _, err := nc.ChanSubscribe("t.x", msgs); err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish("t.x", []byte("hi")); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		if string(m.Data) != "hi" {
			t.Fatalf("got %q", m.Data)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no message")
	}

	// Restart keeps the URL; the client reconnects by itself.
	url := s.ClientURL()
	s.Restart(t)
	if s.ClientURL() != url {
		t.Fatalf("URL changed across restart: %s -> %s", url, s.ClientURL())
	}
	WaitFor(t, 10*time.Second, "client to reconnect", nc.IsConnected)
}

// TestSuperClusterGateway publishes in us-east and receives in eu-west,
// across the gateway, waiting for interest propagation instead of sleeping.
// It then cuts eu-west off (Shutdown) and brings it back (Restart).
func TestSuperClusterGateway(t *testing.T) {
	if testing.Short() {
		t.Skip("starts embedded nats-servers joined by gateways")
	}
	const subject = "ratelimit.report.us-east"
	sc := StartSuperCluster(t, "us-east", "eu-west", "ap-south")
	if len(sc) != 3 {
		t.Fatalf("got %d servers", len(sc))
	}
	for region, s := range sc {
		if got := s.Server().NumOutboundGateways(); got != 2 {
			t.Fatalf("%s: %d outbound gateways, want 2", region, got)
		}
		if got := s.Server().ClusterName(); got != region {
			t.Fatalf("%s: cluster name %q", region, got)
		}
	}
	east, west := sc["us-east"], sc["eu-west"]

	sub := west.Connect(t)
	msgs := make(chan *nats.Msg, 16)
	if _, err := sub.ChanSubscribe("ratelimit.report.*", msgs); err != nil {
		t.Fatal(err)
	}
	if err := sub.Flush(); err != nil {
		t.Fatal(err)
	}
	if east.HasGatewayInterest("eu-west", "ratelimit.usage.us-east") {
		t.Fatal("interest reported for a subject nobody subscribed to")
	}
	east.WaitForGatewayInterest(t, "eu-west", subject)

	pub := east.Connect(t)
	if err := pub.Publish(subject, []byte("report-1")); err != nil {
		t.Fatal(err)
	}
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		if m.Subject != subject || string(m.Data) != "report-1" {
			t.Fatalf("got %s %q", m.Subject, m.Data)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("message did not cross the gateway")
	}

	// Cut eu-west off: us-east loses its gateway and the interest with it.
	west.Shutdown()
	WaitFor(t, 10*time.Second, "us-east to drop its gateway to eu-west", func() bool {
		out, _ := east.Gateways()
		return !out["eu-west"]
	})
	if east.HasGatewayInterest("eu-west", subject) {
		t.Fatal("interest survived the region's shutdown")
	}

	// Rejoin: gateways reconnect, the subscriber's client reconnects and
	// re-sends its subscription, and traffic flows again.
	west.Restart(t)
	WaitForGateways(t, sc)
	WaitFor(t, 10*time.Second, "eu-west subscriber to reconnect", sub.IsConnected)
	east.WaitForGatewayInterest(t, "eu-west", subject)
	if err := pub.Publish(subject, []byte("report-2")); err != nil {
		t.Fatal(err)
	}
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		if string(m.Data) != "report-2" {
			t.Fatalf("got %q", m.Data)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("message did not cross the gateway after the restart")
	}
}
