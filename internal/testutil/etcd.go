package testutil

import (
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/apportion/apportion/internal/launch"
)

// Etcd is an embedded single-member etcd server started for one test. Its
// data lives in a t.TempDir(), so Stop followed by Restart keeps every key and
// the same client and peer ports.
type Etcd struct {
	*launch.Etcd
}

// StartEtcd starts an embedded etcd on free loopback ports, with a quiet
// logger, and stops it when the test ends.
func StartEtcd(tb testing.TB) *Etcd {
	tb.Helper()
	e, err := launch.StartEtcd(tb.TempDir())
	if err != nil {
		tb.Fatalf("testutil: start embedded etcd: %v", err)
	}
	tb.Cleanup(e.Stop)
	return &Etcd{e}
}

// Restart starts the server again with the same data dir and the same ports.
// Call Stop first to simulate an outage of any length.
func (s *Etcd) Restart(tb testing.TB) {
	tb.Helper()
	if err := s.Etcd.Restart(); err != nil {
		tb.Fatalf("testutil: %v", err)
	}
}

// Client returns an etcd client for the server, closed when the test ends.
// It keeps working across Stop and Restart (the client reconnects).
func (s *Etcd) Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	c, err := s.Etcd.Client()
	if err != nil {
		tb.Fatalf("testutil: etcd client: %v", err)
	}
	tb.Cleanup(func() { c.Close() })
	return c
}
