// Package etcdstore keeps rate-limit rules in etcd, one canonical JSON document
// per rule under a prefix (default "/ratelimit/rules/", key = prefix + id), and
// delivers live rule sets to enforcers.
//
// Store is the write side used by the admin API and rlctl: Get, List, Put and
// Delete, with optimistic concurrency on the key's ModRevision (an etcd Txn).
// Invariant: Put normalizes and validates first, so Store never writes an
// invalid rule, and what it writes is the canonical encoding of the rule.
// A global rule's split (regions, weights, min_share) never changes under
// its id: Put refuses one that differs from the stored global rule's or
// from the split the sync agents registered for the id (their registry
// document under WithRegistryPrefix, default DefaultRegistryPrefix, which
// outlives the rule), and its write is conditional on both keys as read
// (re-read and re-checked when only a concurrent change broke it). ListAll
// also returns the stored documents that are not valid rules.
//
// Watcher is the read side, a rules.Source: it loads a snapshot, then watches
// from the snapshot's revision + 1 and delivers the complete rule set after
// every change. Invariants:
//   - a delivered set holds only valid rules. A document that fails validation
//     (written by hand, or by an older binary) is logged, counted and skipped,
//     and the last good version of that rule stays in the set: the one the
//     watcher had, or for a watcher started after the bad write the last
//     valid version in etcd's history since the key was created (unless
//     compacted away);
//   - the caller never waits on etcd: while etcd is unreachable the last set
//     stays in force and Run keeps reconnecting with exponential backoff;
//   - after a compaction past the watched revision, or any watch error, the
//     watcher reloads a full snapshot, so it always converges to exactly the
//     valid rules stored in etcd;
//   - with WithCacheFile, the last delivered set is written atomically
//     (temporary file + rename) and served at start-up when etcd cannot be
//     reached, so an enforcer restarted during an etcd outage keeps its rules.
package etcdstore
