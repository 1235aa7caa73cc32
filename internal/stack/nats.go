package stack

import (
	"fmt"
	"net/url"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// startNATS starts one embedded NATS server per region, each its own cluster,
// joined by gateways into a super-cluster, and waits until every gateway is
// connected. A gateway connection with a delay (Config.Delay) dials a delay
// proxy instead of the remote server.
//
// Each server advertises a gateway address nothing listens on: a peer adds
// the advertised address to the configured one and, when a gateway
// reconnects (after a Partition), would otherwise pick the server's real
// address at random and bypass the delay proxy. Dialling the advertised
// address is refused at once, and the peer goes on to the proxy.
//
// Ports are picked free and then bound by the servers, so another process
// can take one in between; a failed attempt is torn down and retried with
// new ports.
func (s *Stack) startNATS(regions []string) error {
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		if err = s.startNATSOnce(regions); err == nil {
			return nil
		}
		for _, srv := range s.nats {
			srv.Shutdown()
			srv.WaitForShutdown()
		}
		for _, p := range s.proxies {
			p.Close()
		}
		s.nats, s.proxies = nil, nil
	}
	return err
}

func (s *Stack) startNATSOnce(regions []string) error {
	gw := map[string]int{}
	for _, r := range regions {
		p, err := freePort()
		if err != nil {
			return err
		}
		gw[r] = p
	}
	for _, r := range regions {
		cp, err := freePort()
		if err != nil {
			return err
		}
		o := &server.Options{ServerName: "nats-" + r, Host: "127.0.0.1", Port: cp, NoLog: true, NoSigs: true}
		o.Cluster.Name = r
		dead, err := freePort()
		if err != nil {
			return err
		}
		o.Gateway = server.GatewayOpts{Name: r, Host: "127.0.0.1", Port: gw[r], Advertise: fmt.Sprintf("127.0.0.1:%d", dead)}
		for _, other := range regions {
			if other == r {
				continue
			}
			host := fmt.Sprintf("127.0.0.1:%d", gw[other])
			if d := s.cfg.Delay[r][other]; d > 0 || s.cfg.Partitionable {
				p, err := newDelayProxy(host, d)
				if err != nil {
					return fmt.Errorf("stack: delay proxy %s -> %s: %w", r, other, err)
				}
				p.from, p.to = r, other
				s.proxies = append(s.proxies, p)
				host = p.Addr()
			}
			u := &url.URL{Scheme: "nats", Host: host}
			o.Gateway.Gateways = append(o.Gateway.Gateways, &server.RemoteGatewayOpts{Name: other, URLs: []*url.URL{u}})
		}
		srv, err := server.NewServer(o)
		if err != nil {
			return fmt.Errorf("stack: nats %s: %w", r, err)
		}
		srv.Start()
		s.nats = append(s.nats, srv)
		if !srv.ReadyForConnections(10 * time.Second) {
			return fmt.Errorf("stack: nats %s not ready within 10s", r)
		}
		s.natsURL[r] = srv.ClientURL()
	}
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if s.gatewaysUp(len(regions) - 1) {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("stack: NATS gateways did not connect within 15s")
}

func (s *Stack) gatewaysUp(peers int) bool {
	for _, srv := range s.nats {
		gwz, err := srv.Gatewayz(nil)
		if err != nil || len(gwz.OutboundGateways) < peers {
			return false
		}
		in := 0
		for _, conns := range gwz.InboundGateways {
			if len(conns) > 0 {
				in++
			}
		}
		if in < peers {
			return false
		}
	}
	return true
}
