// Package faultsuite holds the fault suite: real faults injected between a
// real enforcer and a real Redis while load runs, with the outcome of each
// fault measured and asserted. It has no code of its own, only tests.
//
// The suite starts a redis-server on a free port, puts a toxiproxy proxy
// (Shopify's fault proxy, embedded as a Go library, no binary to install)
// in front of it, and runs the ratelimitd daemon in-process
// (enforcerd.Run) with --redis-addr pointing at the proxy. Two rules share
// the load: a token bucket with failure_mode open and the same bucket with
// failure_mode closed. Every case goes through four phases, with load
// running throughout:
//
//  1. healthy: every answer comes from Redis (fail_open false), and the
//     open rule admits no more than its bucket allows (capacity plus
//     refill over the phase's duration) on a fresh key;
//  2. fault: a toxic is added (or the proxy disabled); no check fails (no
//     RPC error, every open-rule answer allowed: from Redis or fail-open),
//     every closed-rule answer from the failure policy is rejected, and
//     latency stays near the store timeout (p99 and max are bounded);
//  3. recovery: the toxic is removed; the time until both rules are
//     answered from Redis again is measured and bounded;
//  4. healthy again, with the bucket bound checked on a fresh key.
//
// The faults: latency above the store timeout, latency with jitter around
// the timeout, a bandwidth limit, a slicer (replies cut into small pieces),
// connection resets (reset_peer), a half-open connection that swallows data
// (the timeout toxic with no close: a blackhole), and the proxy disabled
// (connections refused).
//
// A second proxy stands in front of etcd, which ratelimitd watches for its
// rules (Redis direct): while the proxy resets or refuses connections,
// checks keep their rules and are answered from Redis, a rule written to
// etcd meanwhile is not seen, and once the fault ends it is enforced within
// a stated bound.
//
// A third stands between ratelimitd and NATS, which carries its usage
// reports to the region's sync agent (global rules, --static-global):
// while the proxy delays, swallows, resets or refuses, every check is still
// answered from Redis with its usual latency (NATS is not on the check
// path), and once the fault ends reports arrive again within a stated
// bound.
//
// The NATS gateway links between regions go through a toxiproxy proxy per
// direction (launch.SuperClusterOptions.Dial), behind a filter of the
// gateway protocol (launch.NewGatewayProxy: without it a cut region of
// three redials its peers through the third region's proxies, and the cut
// is one-way), with two and three regions,
// each with its own Redis, enforcer and sync agent, signed reports and load
// on one key of a global rule: under latency and jitter the rule stays
// served; under resets, a half-open link or a cut longer than the lease two
// regions keep their positions (neither can be reclaimed by silence) and
// stay served, and of three regions the cut one falls to its floor while
// the survivors reclaim its share; in every 1 s window the regions together admit at most
// the global bound (burst + rate x 1 s, plus the test clock's slack), and
// after each fault the rule is served again within lease + 5 s. A region
// cut off from its peers and from etcd (its sync agent's etcd connection
// through a proxy too) for 20 s, at two and three regions, serves its base
// share again within the same bound once the cut ends.
//
// A Redis primary with a replica under one Sentinel (ratelimitd with
// --redis-sentinel-addrs) is killed while load runs: the failure policy
// answers until the replica is promoted, both rules are answered from it
// within a stated bound, and the tokens re-granted because writes the old
// primary acknowledged were lost (a lagging replica never got them) are
// measured and bounded by one bucket. The same primary is also failed over
// on purpose (SENTINEL FAILOVER): it stays up and takes writes from the
// replica's promotion until Sentinel switches, writes that are lost too;
// they are measured and bounded the same way, and with
// min-replicas-to-write on the primary they are refused instead.
//
// Each case logs its figures (load held, checks
// failed, latency during the fault, time to recover); docs/operations.md
// quotes them from a run.
package faultsuite
