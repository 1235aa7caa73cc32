// Package live plays a scenario against the real binaries on this machine:
// cmd/internal/stack's regions (an embedded NATS server per region joined by
// gateways through delay proxies that inject the scenario's one-way delay
// matrix, a redis-server, the real enforcer and the real sync agent with the
// scenario's interval, lease and witness lease (its other sync settings,
// when not the agent's defaults, are named in the report's notes), one
// etcd), one global rule with the scenario's min_share and weights (a token
// bucket of its rate and burst, or with rule.window a fixed window of
// burst requests per window, the replay starting at a window's start of
// the stores' clock for a window up to a minute), and the scenario's
// requests replayed in real time as gRPC CheckLimit calls to each region's
// enforcer. The very requests the simulator generates for the same scenario
// and seed are sent, so the enforcers' own decisions are scored with the
// simulator's metrics next to its prediction (the ideal and the ledger).
// Events of one region are played on the stack: a partition cuts its
// gateways (Stack.Partition) for the event's interval, the registry staying
// reachable; a region_loss cuts them and stops its sync agent
// (Stack.StopAgent), and with a `for` brings the region back with its Redis
// restarted empty (Stack.RestartRedis) and its agent started again
// (Stack.StartAgent); an agent_restart stops and starts the agent; a
// store_reset restarts its Redis empty.
//
// Invariant: every figure of the live column comes from the enforcers'
// answers (and, for shares and sync bytes, the agents' metrics), timed by
// the send time of each request; nothing of it is simulated.
package live
