// Package envoy serves Envoy's rate-limit protocol,
// envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit, on an
// Enforcer, so that Envoy, Istio and Envoy Gateway use apportion unchanged.
// Register adds the service to the enforcer's gRPC server.
//
// Mapping of a RateLimitRequest. Each descriptor is one Enforcer.Check:
//
//   - ClientKey: the value of the first entry whose key is in the client key
//     list (WithClientKeyEntries; default client_key, remote_address,
//     generic_key, user_id, api_key, in that order of preference). A
//     descriptor without such an entry is InvalidArgument naming it.
//   - Resource: the value of the "resource" entry; else the request's domain,
//     a space and the value of the first resource entry (WithResourceEntries;
//     default path, header_match), e.g. "edge /orders"; else the domain alone.
//   - Attributes: every entry, key -> value (the first of repeated keys
//     wins), and "domain" -> the request's domain unless an entry is named so.
//   - Cost: the descriptor's hits_addend when set, else the request's;
//     0 means 1. A descriptor with is_negative_hits (a refund) is answered OK
//     and consumes nothing: apportion does not refund. A descriptor's limit
//     override is ignored: limits come from apportion's rules.
//
// Response: overall_code is OVER_LIMIT when any descriptor is. Each
// descriptor status carries the binding rule (rule id in current_limit.name)
// of that descriptor's check; a descriptor that no rule matched is OK with no
// current_limit. limit_remaining is the binding rule's remaining tokens;
// duration_until_reset is its reset_after_ms when OK, and when OVER_LIMIT its
// retry_after_ms (the time until the request would pass, which is what a
// fixed window's reset means to a client). current_limit is a rate: the
// binding rule's limit over its period (a window algorithm's window, a
// bucket's time to refill from empty, so for a token bucket the refill rate),
// expressed per the unit among SECOND, MINUTE, HOUR and DAY nearest to that
// period and rounded to a whole number of requests (the next larger unit when
// that rounds to 0): 100 per 1m is 100/MINUTE, a token bucket refilling
// 10/s is 10/SECOND, one refilling 0.5/s over a 200s period is 30/MINUTE.
//
// Failure policy: an answer from a rule's failure_mode while the store is
// unreachable (fail_open in ratelimit.v1) is OK when it allows, so a Redis
// outage never turns into rejections unless a rule says failure_mode closed.
//
// Invariant: descriptors are checked concurrently and independently, not as
// one atomic bucket set (they may name different client keys, and a Check
// takes one). Like Envoy's reference service, a descriptor that passes
// consumes its tokens even when another descriptor of the same request is
// over limit. Every descriptor is mapped before any is checked, so a request
// whose mapping is invalid (no client key, an empty entry key, a client key
// over regional.MaxClientKeyBytes) consumes nothing; the enforcer's own input
// limits (cost above its maximum, over-long values) fail the whole request
// with InvalidArgument after the other descriptors' checks.
package envoy
