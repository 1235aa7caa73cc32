package stack

import (
	"fmt"

	"github.com/apportion/apportion/internal/launch"
)

// startNATS starts one embedded NATS server per region, each its own cluster,
// joined by gateways into a super-cluster (launch.StartSuperCluster), and
// waits until every gateway is connected.
//
// When the stack is partitionable or any link has a delay (Config.Delay),
// every gateway connection, from each region to each other, dials a proxy
// of its own (no delay where Delay gives none). They all need one: the
// proxies keep the gateway URLs the servers gossip from reaching the other
// servers (gateway.go), and a link without a proxy would pass them on —
// its peer would learn, and then dial, the other links' proxies or the
// servers' own addresses. With the proxies, a gateway connection from a to
// b, first or reconnected, always goes through a's proxy to b: a cut of a
// region closes every connection between it and the others, both ways.
func (s *Stack) startNATS(regions []string) error {
	proxied := s.cfg.Partitionable
	for _, row := range s.cfg.Delay {
		for _, d := range row {
			proxied = proxied || d > 0
		}
	}
	dial := func(from, to, addr string) (string, error) {
		p, err := launch.NewGatewayProxy(addr, s.cfg.Delay[from][to])
		if err != nil {
			return "", fmt.Errorf("stack: gateway proxy %s -> %s: %w", from, to, err)
		}
		s.setProxy(&link{from: from, to: to, Proxy: p})
		return p.Addr(), nil
	}
	var opt launch.SuperClusterOptions
	if proxied {
		opt.Dial = dial
	}
	cluster, err := launch.StartSuperCluster(regions, opt)
	if err != nil {
		for _, p := range s.proxies {
			p.Close()
		}
		s.proxies = nil
		return fmt.Errorf("stack: %w", err)
	}
	for _, r := range regions {
		n := cluster[r]
		s.natsServers = append(s.natsServers, n)
		s.nats = append(s.nats, n.Server())
		s.natsURL[r] = n.ClientURL()
	}
	return nil
}

// link is the proxy of the gateway link from -> to.
type link struct {
	from, to string
	*launch.Proxy
}

// setProxy makes p the proxy of its link. A start of the super-cluster that
// launch retries dials every link again: the former attempt's proxy of the
// link is closed and replaced, so that each link has one proxy, the one
// its gateway uses (Partition, isCut).
func (s *Stack) setProxy(p *link) {
	for i, old := range s.proxies {
		if old.from == p.from && old.to == p.to {
			old.Close()
			s.proxies[i] = p
			return
		}
	}
	s.proxies = append(s.proxies, p)
}

// proxy is the proxy of the gateway link from -> to, or nil.
func (s *Stack) proxy(from, to string) *link {
	for _, p := range s.proxies {
		if p.from == from && p.to == to {
			return p
		}
	}
	return nil
}
