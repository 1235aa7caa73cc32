package launch

import (
	"fmt"
	"net/url"
	"os"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Etcd is an embedded single-member etcd server on loopback ports, with a
// quiet logger. Its data lives in Dir, so Stop followed by Restart keeps
// every key and the same client and peer ports.
type Etcd struct {
	// Endpoint is the client URL, e.g. "http://127.0.0.1:23790".
	Endpoint string
	Dir      string

	clientPort, peerPort int
	e                    *embed.Etcd
}

// StartEtcd starts an embedded etcd with its data in dir, on free ports, and
// returns once it serves. It trades durability for speed (no fsync): for
// tests and the local stack only.
func StartEtcd(dir string) (*Etcd, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("launch: etcd dir: %w", err)
	}
	return retry(5, func() (*Etcd, error) {
		cp, err := FreePort()
		if err != nil {
			return nil, err
		}
		pp, err := FreePort()
		if err != nil {
			return nil, err
		}
		s := &Etcd{Dir: dir, clientPort: cp, peerPort: pp, Endpoint: fmt.Sprintf("http://127.0.0.1:%d", cp)}
		if err := s.start(); err != nil {
			return nil, err
		}
		return s, nil
	})
}

func (s *Etcd) config() *embed.Config {
	cu := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", s.clientPort)}
	pu := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", s.peerPort)}
	cfg := embed.NewConfig()
	cfg.Name = "apportion"
	cfg.Dir = s.Dir
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{cu}, []url.URL{cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.UnsafeNoFsync = true // throw-away data; keeps a shared machine fast
	// A single member: short ticks make start-up and Close (which waits up
	// to 5s + 2 elections for open watch streams) quicker.
	cfg.TickMs, cfg.ElectionMs = 10, 100
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	return cfg
}

func (s *Etcd) start() error {
	e, err := embed.StartEtcd(s.config())
	if err != nil {
		return fmt.Errorf("launch: etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return fmt.Errorf("launch: etcd failed while starting: %w", err)
	case <-time.After(30 * time.Second):
		e.Close()
		return fmt.Errorf("launch: etcd on %s was not ready within 30s", s.Endpoint)
	}
	s.e = e
	return nil
}

// Stop closes the server and waits until it has released its ports. Safe to
// call twice.
func (s *Etcd) Stop() {
	if s.e == nil {
		return
	}
	s.e.Close()
	s.e = nil
}

// Restart starts the server again with the same data and ports; call Stop
// first to make an outage of any length.
func (s *Etcd) Restart() error {
	s.Stop()
	if err := again(50, 50*time.Millisecond, s.start); err != nil {
		return fmt.Errorf("launch: restart etcd: %w", err)
	}
	return nil
}

// Client returns a new etcd client for the server. It keeps working across
// Stop and Restart (the client reconnects); the caller closes it.
func (s *Etcd) Client() (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{Endpoints: []string{s.Endpoint}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
}
