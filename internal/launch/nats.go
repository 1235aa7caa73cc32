package launch

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATS is an embedded nats-server on loopback that logs nothing. A server of
// a super-cluster also runs a gateway named after its region. Shutdown
// followed by Restart brings it back on the same client and gateway ports, so
// clients (which reconnect by default) and the other regions' gateways
// (which retry every second) find it again.
type NATS struct {
	// Region is the gateway (and cluster) name; "" for a lone server.
	Region string

	clientPort int
	gwPort     int
	advertise  string            // gateway address advertised to peers; "" for the real one
	remotes    map[string]string // other region -> the address its gateway is dialled at
	configure  []func(*server.Options)

	mu  sync.Mutex
	srv *server.Server // nil while shut down; guarded by mu
}

// StartNATS starts one embedded nats-server on a free loopback port.
// configure, if given, adjusts the options before start (e.g. MaxPayload); it
// runs after the port is set and logging silenced, and again on Restart.
func StartNATS(configure ...func(*server.Options)) (*NATS, error) {
	s := &NATS{clientPort: server.RANDOM_PORT, configure: configure}
	if err := s.start(); err != nil {
		return nil, err
	}
	s.clientPort = s.Server().Addr().(*net.TCPAddr).Port // Restart comes back on it
	return s, nil
}

// Dialer chooses the address region from dials to reach region to's gateway,
// which listens at addr: addr itself, or the address of a proxy in between
// (a delay or a cut). It runs once per ordered pair while the cluster starts.
type Dialer func(from, to, addr string) (string, error)

// SuperClusterOptions configures StartSuperCluster.
type SuperClusterOptions struct {
	// Dial routes gateway connections (nil: direct).
	Dial Dialer
	// Configure adjusts every server's options before start.
	Configure []func(*server.Options)
}

// StartSuperCluster starts one embedded nats-server per region, each its own
// cluster named after the region, joined by gateways (every server's gateway
// options name every other region's gateway), and returns once every server
// has an outbound and an inbound gateway connection to every other region.
//
// With a Dial, each server advertises a gateway address nothing listens on:
// a peer adds the advertised address to the configured one and, when a
// gateway reconnects, would otherwise pick the server's real address at
// random and bypass the proxy. Dialling the advertised address is refused at
// once, and the peer goes on to the configured one. That is not enough with
// three regions or more: a server also gossips to a peer the URLs it uses
// for the others (its own proxies), and a cut region redials through them;
// the proxies Dial returns must filter the gateway protocol (GatewayFilter:
// NewGatewayProxy does, and goes in front of one that does not).
//
// Gateways run in interest-only mode: a message crosses to another region
// only after that region's subscription interest has reached the publishing
// server (see HasGatewayInterest).
func StartSuperCluster(regions []string, opt SuperClusterOptions) (map[string]*NATS, error) {
	if len(regions) == 0 {
		return nil, errors.New("launch: a super-cluster needs at least one region")
	}
	seen := map[string]bool{}
	for _, r := range regions {
		if r == "" || seen[r] {
			return nil, fmt.Errorf("launch: empty or duplicate region %q", r)
		}
		seen[r] = true
	}
	return retry(3, func() (map[string]*NATS, error) {
		cluster, err := startSuperCluster(regions, opt)
		if err != nil {
			return nil, err
		}
		if err := WaitForGateways(cluster, 20*time.Second); err != nil {
			for _, s := range cluster {
				s.Shutdown()
			}
			return nil, err
		}
		return cluster, nil
	})
}

func startSuperCluster(regions []string, opt SuperClusterOptions) (map[string]*NATS, error) {
	gw := map[string]int{}
	for _, r := range regions {
		p, err := FreePort()
		if err != nil {
			return nil, err
		}
		gw[r] = p
	}
	cluster := make(map[string]*NATS, len(regions))
	fail := func(err error) (map[string]*NATS, error) {
		for _, s := range cluster {
			s.Shutdown()
		}
		return nil, err
	}
	for _, r := range regions {
		cp, err := FreePort()
		if err != nil {
			return fail(err)
		}
		s := &NATS{Region: r, clientPort: cp, gwPort: gw[r], remotes: map[string]string{}, configure: opt.Configure}
		if opt.Dial != nil {
			dead, err := FreePort()
			if err != nil {
				return fail(err)
			}
			s.advertise = fmt.Sprintf("127.0.0.1:%d", dead)
		}
		for _, other := range regions {
			if other == r {
				continue
			}
			addr := fmt.Sprintf("127.0.0.1:%d", gw[other])
			if opt.Dial != nil {
				if addr, err = opt.Dial(r, other, addr); err != nil {
					return fail(fmt.Errorf("launch: gateway %s -> %s: %w", r, other, err))
				}
			}
			s.remotes[other] = addr
		}
		if err := s.start(); err != nil {
			return fail(fmt.Errorf("launch: nats %s: %w", r, err))
		}
		cluster[r] = s
	}
	return cluster, nil
}

func (s *NATS) options() *server.Options {
	o := &server.Options{ServerName: "nats", Host: "127.0.0.1", Port: s.clientPort, NoLog: true, NoSigs: true}
	if s.Region != "" {
		o.ServerName = "nats-" + s.Region
		o.Cluster.Name = s.Region
		o.Gateway = server.GatewayOpts{Name: s.Region, Host: "127.0.0.1", Port: s.gwPort, Advertise: s.advertise}
		names := make([]string, 0, len(s.remotes))
		for name := range s.remotes {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			u := &url.URL{Scheme: "nats", Host: s.remotes[name]}
			o.Gateway.Gateways = append(o.Gateway.Gateways, &server.RemoteGatewayOpts{Name: name, URLs: []*url.URL{u}})
		}
	}
	for _, f := range s.configure {
		f(o)
	}
	return o
}

func (s *NATS) start() error {
	srv, err := server.NewServer(s.options())
	if err != nil {
		return fmt.Errorf("launch: nats: %w", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		return fmt.Errorf("launch: nats-server (region %q, port %d) not ready within 10s", s.Region, s.clientPort)
	}
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
	return nil
}

// Server returns the running embedded server, or nil while it is shut down.
func (s *NATS) Server() *server.Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.srv
}

// ClientURL is the URL clients connect to, e.g. "nats://127.0.0.1:4222". It
// stays the same across Shutdown and Restart.
func (s *NATS) ClientURL() string {
	return fmt.Sprintf("nats://127.0.0.1:%d", s.clientPort)
}

// Shutdown stops the server and waits for it to be gone: its clients are
// disconnected and the other regions lose their gateways to it. Safe to call
// twice.
func (s *NATS) Shutdown() {
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
// same options and ports. It does not wait for gateways (WaitForGateways).
func (s *NATS) Restart() error {
	s.Shutdown()
	if err := again(50, 20*time.Millisecond, s.start); err != nil {
		return fmt.Errorf("launch: restart nats-server: %w", err)
	}
	return nil
}

// Gateways reports the remote regions this server has an outbound and an
// inbound gateway connection to.
func (s *NATS) Gateways() (out, in map[string]bool) {
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

// GatewaysUp reports whether every running server in cluster has an
// outbound and an inbound gateway connection to every other running server.
// Servers that are shut down are ignored.
func GatewaysUp(cluster map[string]*NATS) bool {
	for name, s := range cluster {
		if s.Server() == nil {
			continue
		}
		out, in := s.Gateways()
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
}

// WaitForGateways waits up to timeout until GatewaysUp.
func WaitForGateways(cluster map[string]*NATS, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for !GatewaysUp(cluster) {
		if time.Now().After(deadline) {
			return fmt.Errorf("launch: NATS gateways did not connect within %v", timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// HasGatewayInterest reports whether this server would forward a message
// published on subject (in the default account) to remote's gateway: that
// is, whether a subscription of remote that matches subject has reached it.
func (s *NATS) HasGatewayInterest(remote, subject string) bool {
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
