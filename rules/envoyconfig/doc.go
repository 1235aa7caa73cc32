// Package envoyconfig converts an envoyproxy/ratelimit configuration file
// into apportion rules that the Envoy service (regional/envoy) enforces the
// way envoyproxy/ratelimit would: the same descriptor gets the same limit,
// counted per the same identity, over the same window.
//
// Invariant: a file envoyproxy/ratelimit refuses is refused, and so is one
// that uses a feature the import cannot reproduce (metadata, unless
// IgnoreMetadata); every error names the field by its path
// in the file and its line. Nothing is silently dropped except
// statistics-only settings (detailed_metric, value_to_metric: apportion's
// metrics are per rule).
//
// # Mapping
//
// Every configuration node (a descriptor at some depth, reached by its
// parents' keys and values) becomes one rule, unless it only has children
// and no rate_limit (its children's rules imply it). The rule:
//
//   - id: envoyproxy/ratelimit's statistics name of the node,
//     domain.key_value.key (e.g. "rl.source_cluster_proxy.destination_cluster_mock"),
//     with characters other than [A-Za-z0-9_.-] written "-";
//   - match: domain (the request's domain) and envoy.node (the node's
//     path, NodePath: "source_cluster=proxy|destination_cluster=mock";
//     a level without value is the key alone, "foo|bar"), plus
//     envoy.name and envoy.replaces from rate_limit.name and
//     rate_limit.replaces, envoy.quota "true" for quota_mode, and
//     envoy.share: the levels whose node has share_threshold;
//   - key: [envoy.descriptor]: one bucket per descriptor identity (every
//     entry's key and value), as envoyproxy/ratelimit keeps one counter per
//     domain and entries;
//   - fixed_window, limit requests_per_unit, window the unit (1s, 1m, 1h,
//     24h, 168h for a week, 720h for a 30-day month, 8760h for a 365-day
//     year): envoyproxy/ratelimit's fixed windows, aligned to the epoch;
//   - shadow: shadow_mode.
//
// Three kinds of node have no bucket; their rules carry envoy.limit and
// placeholder bucket fields (limit 1) that are never evaluated: "unlimited"
// (rate_limit.unlimited: the descriptor is OK and counted nowhere), "0"
// (requests_per_unit 0, or none given: the descriptor is always over limit)
// and "none" (a leaf without rate_limit: the descriptor is not limited, and
// does not fall back to a key-only sibling).
//
// The Envoy service resolves each descriptor to at most one node exactly
// as envoyproxy/ratelimit does (per level: the key and value, else a
// wildcard value, else the key alone; the limit applies only when the
// descriptor ends at that node), applies replaces across the request's
// descriptors, answers over limit when a descriptor not in quota mode is or
// every quota-mode one is, and checks the node's rule alone (see
// regional/envoy).
package envoyconfig
