package testutil

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/apportion/apportion/internal/launch"
)

// NATSServer is an embedded nats-server started for one test (launch.NATS).
//
// While a region of a super-cluster is shut down its own clients are
// disconnected too (region loss, not a pure network partition between
// regions that keeps local traffic running; the embedded server cannot drop
// its gateways at run time). Restart brings it back on the same ports.
type NATSServer struct {
	*launch.NATS
}

// StartNATS starts one embedded nats-server on a free loopback port and shuts
// it down when the test ends. configure, if given, adjusts the options
// before start (e.g. MaxPayload); it runs after StartNATS has set the port
// and silenced logging, and applies again on Restart.
func StartNATS(tb testing.TB, configure ...func(*server.Options)) *NATSServer {
	tb.Helper()
	s, err := launch.StartNATS(configure...)
	if err != nil {
		tb.Fatalf("testutil: start nats-server: %v", err)
	}
	tb.Cleanup(s.Shutdown)
	return &NATSServer{s}
}

// StartSuperCluster starts one embedded nats-server per region joined by
// gateways (launch.StartSuperCluster) and returns once every gateway is up.
// All servers are shut down when the test ends. Gateways run in
// interest-only mode: use WaitForGatewayInterest after subscribing, instead
// of sleeping.
func StartSuperCluster(tb testing.TB, regions ...string) map[string]*NATSServer {
	tb.Helper()
	cluster, err := launch.StartSuperCluster(regions, launch.SuperClusterOptions{})
	if err != nil {
		tb.Fatalf("testutil: start NATS super-cluster: %v", err)
	}
	out := make(map[string]*NATSServer, len(cluster))
	for r, s := range cluster {
		tb.Cleanup(s.Shutdown)
		out[r] = &NATSServer{s}
	}
	return out
}

// Connect opens a client connection that retries forever on disconnect and
// is closed when the test ends.
func (s *NATSServer) Connect(tb testing.TB, opts ...nats.Option) *nats.Conn {
	tb.Helper()
	opts = append([]nats.Option{
		nats.MaxReconnects(-1),
		nats.ReconnectWait(20 * time.Millisecond),
		nats.Name(tb.Name()),
	}, opts...)
	nc, err := nats.Connect(s.ClientURL(), opts...)
	if err != nil {
		tb.Fatalf("testutil: connect to nats %s: %v", s.ClientURL(), err)
	}
	tb.Cleanup(nc.Close)
	return nc
}

// Restart shuts the server down (if running) and starts it again with the
// same options and ports. It does not wait for gateways: call
// WaitForGateways for that.
func (s *NATSServer) Restart(tb testing.TB) {
	tb.Helper()
	if err := s.NATS.Restart(); err != nil {
		tb.Fatalf("testutil: %v", err)
	}
}

// WaitForGateways waits until every running server in cluster has an
// outbound and an inbound gateway connection to every other running server.
// Servers that are shut down are ignored.
func WaitForGateways(tb testing.TB, cluster map[string]*NATSServer) {
	tb.Helper()
	c := make(map[string]*launch.NATS, len(cluster))
	for r, s := range cluster {
		c[r] = s.NATS
	}
	WaitFor(tb, 20*time.Second, "NATS gateways to connect", func() bool { return launch.GatewaysUp(c) })
}

// WaitForGatewayInterest waits until a message published on subject at this
// server would be forwarded to remote's gateway. Call it after the remote
// subscriber has subscribed (and flushed) and before publishing, instead of
// sleeping.
func (s *NATSServer) WaitForGatewayInterest(tb testing.TB, remote, subject string) {
	tb.Helper()
	WaitFor(tb, 10*time.Second, fmt.Sprintf("interest of %s in %q at %s", remote, subject, s.Region), func() bool {
		return s.HasGatewayInterest(remote, subject)
	})
}
