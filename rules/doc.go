// Package rules holds the rate-limit rule model, its validation, the matching
// index and the sources that deliver rule sets (a file, etcd).
//
// Invariant: a rule that fails validation is never applied. Every error names
// the field that is wrong (see FieldError), and a source that meets a bad
// document keeps serving the last good rule set.
//
// # Rule format decisions
//
// Documents are strict JSON (YAML files are converted to JSON first and then
// meet the same checks): unknown fields, field names in the wrong case and
// repeated fields are refused, as is data after the document and a document
// over MaxRuleSize (64 KiB).
//
//   - id: 1..128 characters of [A-Za-z0-9_.-], not "." or "..": it is part of
//     etcd keys, admin URLs and Redis keys.
//   - token_bucket and leaky_bucket take capacity (1..1e12) and
//     refill_per_second (above 0, at most 1e9); window algorithms take limit
//     (1..1e12) and window (a whole number of milliseconds, 1ms..366 days).
//     Setting the other algorithm family's fields is an error, not ignored.
//   - match: keys are "resource" or attribute names ("client_key" is refused:
//     rules select requests, key picks the bucket). A value is exact or "*"
//     (present, any value; for resource: not empty). A value that contains
//     "*" among other characters is refused rather than taken literally, so
//     that nobody mistakes it for a pattern.
//   - key: "client_key" (the default), "resource" or attribute names, no
//     repeats.
//   - scope regional (default) must not set regions or min_share (refused, so
//     that a rule is never believed to be split when it is not); scope global
//     needs regions (weights finite and above 0) and min_share in [0, 1].
//     Global applies to every algorithm: a region's static share of the rate
//     and capacity, or of the limit, is its weight over the sum of weights.
//     token_bucket, fixed_window and sliding_window are coordinated
//     (Coordinated: the sync agents move shares by demand, starting from
//     the static ones); leaky_bucket and sliding_log keep the static share.
//   - failure_mode open (default), closed or local; priority high (default)
//     or low.
//   - Numbers are refused, naming the field, where the store cannot hold
//     them: capacity at most 2^38 thousandths of a token, refill_per_second
//     at least 0.001 (a thousandth per second), limit at most 2^40 and limit
//     x window (ms) at most 2^52, and for a global leaky_bucket or sliding_log
//     every region's static share at least one unit (a thousandth of a
//     token, or one request).
//   - local_batch (tokens a token_bucket's enforcer takes from the store at
//     a time; 0 or 1: off) is at most capacity. split (sub-buckets of a hot
//     key; 0 or 1: off) is 2..64, for a regional token_bucket without
//     local_batch whose share per sub-bucket stays at least a thousandth.
//
// # Matching
//
// Index groups rules by shape (the sorted match keys, each exact or "*") and
// hashes the exact values per shape, so that a lookup costs one hash lookup
// per distinct shape, whatever the number of rules.
package rules
