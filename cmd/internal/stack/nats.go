package stack

import (
	"fmt"

	"github.com/apportion/apportion/internal/launch"
)

// startNATS starts one embedded NATS server per region, each its own cluster,
// joined by gateways into a super-cluster (launch.StartSuperCluster), and
// waits until every gateway is connected. A gateway connection with a delay
// (Config.Delay), or every one when the stack is partitionable, dials a delay
// proxy instead of the remote server.
func (s *Stack) startNATS(regions []string) error {
	dial := func(from, to, addr string) (string, error) {
		d := s.cfg.Delay[from][to]
		if d <= 0 && !s.cfg.Partitionable {
			return addr, nil
		}
		p, err := newDelayProxy(addr, d)
		if err != nil {
			return "", fmt.Errorf("stack: delay proxy %s -> %s: %w", from, to, err)
		}
		p.from, p.to = from, to
		s.proxies = append(s.proxies, p)
		return p.Addr(), nil
	}
	var opt launch.SuperClusterOptions
	if s.cfg.Partitionable || len(s.cfg.Delay) > 0 {
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
