package testutil

import (
	"fmt"
	"net/url"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Etcd is an embedded single-member etcd server started for one test. Its
// data lives in a t.TempDir(), so Stop followed by Restart keeps every key and
// the same client and peer ports.
type Etcd struct {
	// Endpoint is the client URL, e.g. "http://127.0.0.1:23790".
	Endpoint string
	Dir      string

	clientPort, peerPort int
	e                    *embed.Etcd
}

// StartEtcd starts an embedded etcd on free loopback ports, with a quiet
// logger, and stops it when the test ends.
func StartEtcd(tb testing.TB) *Etcd {
	tb.Helper()
	dir := tb.TempDir()
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		s := &Etcd{Dir: dir, clientPort: FreePort(tb), peerPort: FreePort(tb)}
		s.Endpoint = fmt.Sprintf("http://127.0.0.1:%d", s.clientPort)
		if err := s.start(); err != nil {
			lastErr = err
			continue
		}
		tb.Cleanup(s.Stop)
		return s
	}
	tb.Fatalf("testutil: start embedded etcd: %v", lastErr)
	return nil
}

func (s *Etcd) config() *embed.Config {
	cu := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", s.clientPort)}
	pu := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", s.peerPort)}
	cfg := embed.NewConfig()
	cfg.Name = "test"
	cfg.Dir = s.Dir
	cfg.ListenClientUrls = []url.URL{cu}
	cfg.AdvertiseClientUrls = []url.URL{cu}
	cfg.ListenPeerUrls = []url.URL{pu}
	cfg.AdvertisePeerUrls = []url.URL{pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.UnsafeNoFsync = true // test data only; keeps the shared test machine fast
	// A single member: short ticks make start-up and Close (which waits up
	// to 5s + 2 elections for open watch streams) quicker.
	cfg.TickMs = 10
	cfg.ElectionMs = 100
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	return cfg
}

func (s *Etcd) start() error {
	e, err := embed.StartEtcd(s.config())
	if err != nil {
		return err
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return fmt.Errorf("etcd failed while starting: %w", err)
	case <-time.After(30 * time.Second):
		e.Close()
		return fmt.Errorf("etcd on %s was not ready within 30s", s.Endpoint)
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

// Restart starts the server again with the same data dir and the same ports.
// Call Stop first to simulate an outage of any length.
func (s *Etcd) Restart(tb testing.TB) {
	tb.Helper()
	s.Stop()
	var err error
	for i := 0; i < 50; i++ {
		if err = s.start(); err == nil {
			return
		}
		// A port may be held for a moment after Close; retry briefly.
		time.Sleep(50 * time.Millisecond)
	}
	tb.Fatalf("testutil: restart embedded etcd: %v", err)
}

// Client returns an etcd client for the server, closed when the test ends.
// It keeps working across Stop and Restart (the client reconnects).
func (s *Etcd) Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	c, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{s.Endpoint},
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		tb.Fatalf("testutil: etcd client: %v", err)
	}
	tb.Cleanup(func() { c.Close() })
	return c
}
