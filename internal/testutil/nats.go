package testutil

import (
	"fmt"
	"net"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// NATSServer is an embedded nats-server started for one test. It listens on
// loopback only and logs nothing.
//
// A server started by StartSuperCluster also runs a gateway named after its
// region. Shutdown followed by Restart brings the server back on the same
// client and gateway ports, so clients (which reconnect by default) and the
// other regions' gateways (which retry every second) find it again. That is
// how a test cuts a region off and lets it rejoin: while a region is shut
// down its own clients are disconnected too (region loss, not a pure
// network partition between regions that keeps local traffic running; the
// embedded server cannot drop its gateways at run time).
type NATSServer struct {
	// Region is the gateway (and cluster) name; "" for StartNATS.
	Region string

	clientPort int
	gwPort     int
	remotes    map[string]int // other region -> its gateway port
	configure  []func(*server.Options)

	mu  sync.Mutex
	srv *server.Server // nil while shut down; guarded by mu
}

// StartNATS starts one embedded nats-server on a free loopback port and shuts
// it down when the test ends. configure, if given, adjusts the options
// before start (e.g. MaxPayload); it runs after StartNATS has set the port
// and silenced logging, and applies again on Restart.
func StartNATS(tb testing.TB, configure ...func(*server.Options)) *NATSServer {
	tb.Helper()
	s := &NATSServer{clientPort: server.RANDOM_PORT, configure: configure}
	if err := s.start(); err != nil {
		tb.Fatalf("testutil: start nats-server: %v", err)
	}
	// Pin the port the server picked, so Restart comes back on it.
	s.clientPort = s.Server().Addr().(*net.TCPAddr).Port
	tb.Cleanup(s.Shutdown)
	return s
}

// StartSuperCluster starts one embedded nats-server per region, each its own
// cluster named after the region, and joins them with NATS gateways the way
// a multi-region deployment is built: every server's gateway options name
// every other region's gateway URL. It returns once every server has an
// outbound and an inbound gateway connection to every other region. All
// servers are shut down when the test ends.
//
// Gateways run in interest-only mode: a message crosses to another region
// only after that region's subscription interest has reached the publishing
// server. Use WaitForGatewayInterest after subscribing, instead of sleeping.
func StartSuperCluster(tb testing.TB, regions ...string) map[string]*NATSServer {
	tb.Helper()
	if len(regions) == 0 {
		tb.Fatalf("testutil: StartSuperCluster needs at least one region")
	}
	seen := map[string]bool{}
	for _, r := range regions {
		if r == "" || seen[r] {
			tb.Fatalf("testutil: StartSuperCluster: empty or duplicate region %q", r)
		}
		seen[r] = true
	}
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		cluster, err := startSuperCluster(tb, regions)
		if err != nil {
			lastErr = err
			continue
		}
		for _, s := range cluster {
			tb.Cleanup(s.Shutdown)
		}
		WaitForGateways(tb, cluster)
		return cluster
	}
	tb.Fatalf("testutil: start NATS super-cluster: %v", lastErr)
	return nil
}

func startSuperCluster(tb testing.TB, regions []string) (map[string]*NATSServer, error) {
	gwPorts := map[string]int{}
	for _, r := range regions {
		gwPorts[r] = FreePort(tb)
	}
	cluster := make(map[string]*NATSServer, len(regions))
	for _, r := range regions {
		s := &NATSServer{Region: r, clientPort: FreePort(tb), gwPort: gwPorts[r], remotes: map[string]int{}}
		for _, other := range regions {
			if other != r {
				s.remotes[other] = gwPorts[other]
			}
		}
		if err := s.start(); err != nil {
			for _, started := range cluster {
				started.Shutdown()
			}
			return nil, fmt.Errorf("region %s: %w", r, err)
		}
		cluster[r] = s
	}
	return cluster, nil
}

func (s *NATSServer) options() *server.Options {
	o := &server.Options{
		ServerName: "nats-test",
		Host:       "127.0.0.1",
		Port:       s.clientPort,
		NoLog:      true,
		NoSigs:     true,
	}
	if s.Region != "" {
		o.ServerName = "nats-" + s.Region
		o.Cluster.Name = s.Region
		o.Gateway = server.GatewayOpts{Name: s.Region, Host: "127.0.0.1", Port: s.gwPort}
		names := make([]string, 0, len(s.remotes))
		for name := range s.remotes {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			u := &url.URL{Scheme: "nats", Host: fmt.Sprintf("127.0.0.1:%d", s.remotes[name])}
			o.Gateway.Gateways = append(o.Gateway.Gateways, &server.RemoteGatewayOpts{Name: name, URLs: []*url.URL{u}})
		}
	}
	for _, f := range s.configure {
		f(o)
	}
	return o
}

func (s *NATSServer) start() error {
	srv, err := server.NewServer(s.options())
	if err != nil {
		return err
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		return fmt.Errorf("nats-server (region %q, port %d) not ready within 10s", s.Region, s.clientPort)
	}
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
	return nil
}

// Server returns the running embedded server, or nil while it is shut down.
func (s *NATSServer) Server() *server.Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.srv
}

// ClientURL is the URL clients connect to, e.g. "nats://127.0.0.1:4222". It
// stays the same across Shutdown and Restart.
func (s *NATSServer) ClientURL() string {
	return fmt.Sprintf("nats://127.0.0.1:%d", s.clientPort)
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

// Shutdown stops the server and waits for it to be gone. Its clients are
// disconnected and the other regions lose their gateways to it. Safe to call
// twice.
func (s *NATSServer) Shutdown() {
	s.mu.Lock()
	srv := s.srv
	s.srv = nil
	s.mu.Unlock()
	if srv == nil {
		return
	}
	srv.Shutdown()
	srv.WaitForShutdown()
}

// Restart shuts the server down (if running) and starts it again with the
// same options and ports. It does not wait for gateways: call
// WaitForGateways for that.
func (s *NATSServer) Restart(tb testing.TB) {
	tb.Helper()
	s.Shutdown()
	var err error
	// The old listener may take a moment to release its port.
	for i := 0; i < 50; i++ {
		if err = s.start(); err == nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	tb.Fatalf("testutil: restart nats-server: %v", err)
}

// gateways reports the remote regions this server has an outbound and an
// inbound gateway connection to.
func (s *NATSServer) gateways() (out, in map[string]bool) {
	srv := s.Server()
	out, in = map[string]bool{}, map[string]bool{}
	if srv == nil {
		return out, in
	}
	gwz, err := srv.Gatewayz(nil)
	if err != nil {
		return out, in
	}
	for name := range gwz.OutboundGateways {
		out[name] = true
	}
	for name, conns := range gwz.InboundGateways {
		if len(conns) > 0 {
			in[name] = true
		}
	}
	return out, in
}

// WaitForGateways waits until every running server in cluster has an
// outbound and an inbound gateway connection to every other running server.
// Servers that are shut down are ignored.
func WaitForGateways(tb testing.TB, cluster map[string]*NATSServer) {
	tb.Helper()
	WaitFor(tb, 20*time.Second, "NATS gateways to connect", func() bool {
		for name, s := range cluster {
			if s.Server() == nil {
				continue
			}
			out, in := s.gateways()
			for other, o := range cluster {
				if other == name || o.Server() == nil {
					continue
				}
				if !out[other] || !in[other] {
					return false
				}
			}
		}
		return true
	})
}

// HasGatewayInterest reports whether this server would forward a message
// published on subject (in the default account) to remote's gateway: that
// is, whether a subscription of remote that matches subject has reached it.
func (s *NATSServer) HasGatewayInterest(remote, subject string) bool {
	srv := s.Server()
	if srv == nil {
		return false
	}
	gwz, err := srv.Gatewayz(&server.GatewayzOptions{
		Name:                 remote,
		AccountName:          server.DEFAULT_GLOBAL_ACCOUNT,
		AccountSubscriptions: true,
	})
	if err != nil {
		return false
	}
	rgw := gwz.OutboundGateways[remote]
	if rgw == nil {
		return false
	}
	for _, acc := range rgw.Accounts {
		if acc.InterestMode != server.InterestOnly.String() {
			// Optimistic mode (not used by current servers) forwards
			// unless told otherwise; we cannot see that list, so only
			// interest-only mode counts as known interest.
			continue
		}
		for _, sub := range acc.Subs {
			if server.SubjectMatchesFilter(subject, sub) {
				return true
			}
		}
	}
	return false
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
