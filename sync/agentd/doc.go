// Package agentd is the sync agent's daemon, as regional/enforcerd is the
// enforcer's: RunCommand parses the flags (each also read from
// APPORTION_<FLAG>), connects to Redis, NATS and etcd, serves /metrics,
// /healthz, /readyz and the shares endpoint on --http-addr, optionally
// campaigns for leadership in etcd (--standby), and runs one sync/agent.Agent
// until its context ends; its subcommands keygen, pubkey and keys manage the
// report signing keys. cmd/syncagent is a thin main around it, and the local
// stack runs it in-process.
//
// Invariant: RunCommand returns only after everything it started has
// stopped (the agent, its HTTP server, the election), and it refuses to
// start without a report signing key unless told --insecure-unsigned-reports.
package agentd
