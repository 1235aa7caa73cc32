// Package regional is the enforcer: it matches a request against the rule
// index, evaluates every matched rule's bucket in one Redis script call, and
// answers allowed or rejected over gRPC (ratelimit.v1.RateLimiter) and HTTP
// (POST /v1/check).
//
// Invariants:
//   - A request is allowed only if every enforced (non-shadow) matched rule
//     allows it, and a rejected request consumes nothing from any rule: the
//     store evaluates all buckets of one request atomically.
//   - A check never blocks on the rule source: the rule index is swapped
//     atomically, so a check sees either the old or the new rule set whole.
//   - A store outage never turns into an API outage unless a rule says so:
//     each store call has a short timeout, a circuit breaker stops calling a
//     failing store, and then every matched rule's failure_mode decides
//     (open: allow; closed: reject; local: an in-process token bucket).
//     Such answers carry fail_open=true. On a Redis Cluster the store is
//     a failure domain per master (DomainStore; breaker.go), each with its
//     own breaker and, in the store, its own queue and pipelines: a master
//     that fails sends only its own keys' checks to the failure policy,
//     and the other masters' checks are answered by Redis as before.
//   - The enforcer fails open only when the store fails, never under its
//     own load. The timeout measures Redis (silent for the timeout, beyond
//     this process's own measured lag and its own scripts in flight), not
//     the time a check waits inside the enforcer; that wait is bounded on
//     its own (QueueTimeout), and a check past it is shed: answered
//     rejected without Redis (shed=true), never admitted unchecked. The
//     breaker counts store failures only (timeouts, connection errors, a
//     Redis that is loading, busy or read-only), never a caller's
//     cancellation, a shed check, or a request the store refuses. Nor
//     does it answer from the failure policy once the store is back: while
//     it is open one check at a time (at most one per 10 ms) goes to look,
//     and once Redis answers (after errors: a check succeeds) the checks go
//     to it though the breaker waits out its open time (heardAgain).
//   - One bad rule or key harms nobody: a rule whose bucket the store cannot
//     hold is found when the rule set is loaded and answered by its own
//     failure_mode without the store; a store error about one bucket (a
//     script error) answers that check alone, by its rules' failure_mode,
//     without touching the breaker; so does a Redis Cluster's refusal
//     about the slot of the check's keys (TRYAGAIN for keys a migration has
//     split, MOVED or ASK past the redirections).
//   - Under overload (checks queued for Redis at ShedQueue, or Redis's
//     recent round trip at ShedLatency) checks whose matched rules are all
//     priority "low" are shed; priority "high" (the default) keeps going to
//     Redis. A shed check consumes nothing, so no bucket passes its bound.
//   - CheckBatch (gRPC CheckLimits) sends all its requests to Redis in one
//     pipeline (on a Cluster one per master, concurrently) and answers them
//     in order, each as Check would alone: each request through the breaker
//     of its own keys' domain.
//   - local_batch: N (batch.go): every token admitted was taken from Redis
//     first; an enforcer holds at most N-1 tokens of a key at a time.
//   - split: k: a hot key's sub-buckets hold 1/k of the limit each and
//     never admit more than the rule's bound together.
//   - A shadow rule is evaluated and its would-be rejections are counted and
//     logged, but it never rejects.
package regional
