// Package launch starts real servers on free loopback ports: redis-server
// processes, an embedded single-member etcd, and embedded NATS servers, alone
// or joined by gateways into a super-cluster the way a multi-region
// deployment is. It is the one place that knows how to start them: the local
// stack (cmd/internal/stack) runs on it, and the tests use it through
// internal/testutil, which ties each server's lifetime to a testing.TB.
//
// Invariants: every server listens on 127.0.0.1 only, on a port that was
// free a moment before it bound it; a start that finds its port taken by
// someone else (another process bound it in between) fails and is retried on
// new ports, so a server handed out is always the one this package started.
// Stop (or Shutdown) waits until the server is gone and is safe to call
// twice; Restart comes back on the same ports (and, for etcd, the same data).
package launch
