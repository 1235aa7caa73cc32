// Package envoy serves Envoy's rate-limit protocol,
// envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit, on an
// Enforcer, so that Envoy, Istio and Envoy Gateway use apportion unchanged,
// and so that a configuration of envoyproxy/ratelimit imported with
// rules/envoyconfig limits every descriptor the way envoyproxy/ratelimit
// would. Register adds the service to the enforcer's gRPC server.
//
// Mapping of a RateLimitRequest. Each descriptor is one Enforcer.Check:
//
//   - ClientKey: the value of the first entry, with a non-empty value, whose
//     key is in the client key list (WithClientKeyEntries; default
//     client_key, remote_address, generic_key, user_id, api_key, in that
//     order of preference); without one, the descriptor's identity: its
//     entries as key=value joined by "|" (envoyconfig.Identity), e.g.
//     "key1=foo" or "source_cluster=proxy|destination_cluster=mock". Over
//     regional.MaxClientKeyBytes it is hashed (below). The value alone,
//     whichever entry gave it: a rule that matches descriptors keyed by
//     different entries counts equal values in one bucket (docs/api.md
//     says how to keep a client-set entry out of another's bucket).
//   - Resource: the value of the "resource" entry; else the request's domain,
//     a space and the value of the first resource entry (WithResourceEntries;
//     default path, header_match), e.g. "edge /orders"; else the domain
//     alone. Over 1024 bytes, it is hashed as a whole.
//   - Attributes: every entry, key -> value (the first of repeated keys
//     wins; a key or value over 1024 bytes is hashed), "domain" -> the
//     request's domain (hashed over 1024 bytes) unless an entry is named so,
//     and "envoy.descriptor" -> the identity (envoyconfig.Identity). Entries
//     named envoy.descriptor, envoy.node, envoy.name, envoy.replaces,
//     envoy.limit, envoy.quota or envoy.share are not attributes: this
//     service sets those. With more than 64 attributes (a check's maximum),
//     only those that the rules matching the descriptor read (match keys
//     and key parts) are kept, rule by rule in id order; a rule whose
//     attributes do not fit beside those of the rules before it is not
//     applied, as if it did not match, and a descriptor to which no rule can
//     be applied is OK without current_limit, like one no rule matches.
//   - Hashing: a part that does not fit the enforcer (over its limit, or not
//     valid UTF-8: Envoy forwards header bytes as they came, so a request
//     that proto3 refuses for them is decoded by decodeLenient instead of
//     failing the call), and one that is already of the hashed form, is replaced
//     by "sha256:" and the hex SHA-256 of it. That is injective: a kept part
//     never has the hashed form, so two different parts never share a
//     bucket or a match value, and a client cannot send the hashed form of a
//     long value to be counted as (or match a rule written for) that value.
//     A rule matches a long part by its hashed form, or by "*".
//   - Cost: the descriptor's hits_addend when set, else the request's;
//     0 means 1. A descriptor with is_negative_hits (a refund) is answered OK
//     and consumes nothing: apportion does not refund. A descriptor without
//     entries is answered OK (no limit can apply). A cost above the
//     enforcer's maximum is OVER_LIMIT for that descriptor, with a body
//     naming hits_addend. A descriptor's limit override is ignored: limits
//     come from apportion's rules.
//
// Imported configuration. The service derives, from the rules of the
// enforcer's current rule index that carry envoy.node (rules/envoyconfig),
// envoyproxy/ratelimit's configuration tree per domain, and resolves each
// descriptor as envoyproxy/ratelimit does: per entry the node keyed
// key_value, else the first wildcard node matching it (longest fixed text
// first), else the node keyed by the key alone; the node's limit applies
// only when the descriptor's last entry reaches it. Then, across the
// request, every resolved node's replaces removes the other named nodes
// (not unlimited ones). A descriptor resolved to a bucket node is checked
// with that node's match attributes set (so its rule matches, and no other
// imported rule; at share_threshold levels the identity holds the wildcard
// value, so all the values it matches share one bucket); to an unlimited node it is OK with limit_remaining
// 4294967295 and no check; to a requests_per_unit 0 node it is OVER_LIMIT
// (OK in shadow mode) with current_limit 0 per its unit and no check.
// Any other descriptor is checked with the attributes above, so rules
// written for apportion apply to every descriptor they match.
//
// Response: overall_code is OVER_LIMIT when any descriptor is, except that
// descriptors of quota_mode nodes make it OVER_LIMIT only when all of them
// are (envoyproxy/ratelimit's quota mode). Each
// descriptor status carries the binding rule of that descriptor's check
// (rule id in current_limit.name); a descriptor that no enforced rule bound
// (none matched, or only shadow rules did) is OK or OVER_LIMIT with no
// current_limit. limit_remaining is the binding rule's remaining tokens.
// current_limit is the binding rule's limit in tokens (a window's limit, a
// bucket's capacity) per the shortest unit (SECOND, MINUTE, HOUR, DAY,
// WEEK, MONTH of 30 days, YEAR of 365) at least as long as the rule's
// period (its window; a bucket's time to refill from empty): exact for an
// imported rule (20 per 1m is 20/MINUTE), and otherwise consistent with
// the bucket: limit_remaining never exceeds requests_per_unit and the rule
// is full again within one unit (a token bucket of capacity 3 refilling
// 1/s is 3/MINUTE). duration_until_reset is reset_after_ms when OK, and
// when OVER_LIMIT retry_after_ms (the time until the request would pass,
// which is what a fixed window's reset means to a client), or
// reset_after_ms when waiting cannot help. With WithResponseHeaders, the
// most restrictive descriptor's headers are those regional/header writes
// for every front end; when waiting cannot help, raw_body says why (Envoy
// sends it as the body of its 429) and there is no retry-after.
//
// Failure policy: an answer from a rule's failure_mode while the store is
// unreachable (fail_open in ratelimit.v1) is OK when it allows, so a Redis
// outage never turns into rejections unless a rule says failure_mode closed.
//
// Invariant: every descriptor envoyproxy/ratelimit accepts is answered, on
// its own, and within the enforcer's limits whatever its size (the call
// fails only with no or too many descriptors, a hits_addend beyond any
// cost, or no rule set loaded yet; FuzzShouldRateLimit checks it; the
// first three, like a request that does not decode, count once as invalid
// in apportion_requests_total). A
// descriptor the enforcer would still refuse is answered alone, OK without
// current_limit as one no rule matches, and counted as invalid in
// apportion_requests_total; no other descriptor's answer changes. Descriptors are checked
// concurrently and independently, not as one atomic bucket set (they may
// name different client keys, and a Check takes one): like
// envoyproxy/ratelimit, a descriptor that passes consumes its tokens even
// when another descriptor of the same request is over limit.
package envoy
