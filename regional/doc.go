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
//     Such answers carry fail_open=true.
//   - A shadow rule is evaluated and its would-be rejections are counted and
//     logged, but it never rejects.
package regional
