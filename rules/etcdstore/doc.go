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
// (re-read and re-checked when only a concurrent change broke it). A global
// rule's algorithm, and a global window rule's window, are those of the
// first valid global version of its key's life (its versions since the key
// was last created): Put refuses a rule that changes them, whatever the
// stored document says, so putting back the original over a hand-written
// change is accepted. ListAll also returns the stored documents that are
// not valid rules, and Get explains them, including the global rules the
// Watcher skips (a split other than the registered one, an algorithm or
// window other than its life's first): Store and Watcher share that
// decision (life.go), so every process judges a stored version alike.
//
// Watcher is the read side, a rules.Source: it loads a snapshot, then watches
// from the snapshot's revision + 1 and delivers the complete rule set after
// every change. Invariants:
//   - a delivered set holds only valid rules. A document that fails validation
//     (written by hand, or by an older binary), or a global rule whose
//     algorithm or window differs from its key's life's first valid global
//     version, is logged, counted and skipped, and the last good version of
//     that rule stays in the set: the one the watcher had in that life, or
//     for a watcher that did not follow the life (started after the bad
//     write, or reloading after a compaction) the last valid version in
//     etcd's history since the key was created, read in one watch of the
//     key however many versions it has (from the compaction revision on
//     where compaction removed the start; a deleted rule is not brought
//     back). Running and fresh watchers so deliver the same set;
//   - the caller never waits on etcd: while etcd is unreachable the last set
//     stays in force and Run keeps reconnecting with exponential backoff;
//   - after a compaction past the watched revision, or any watch error, the
//     watcher reloads a full snapshot, so it always converges to exactly the
//     valid rules stored in etcd;
//   - the watcher remembers etcd's cluster id and the revision it applied:
//     when a linearizable answer (a snapshot, or the probe of a silent
//     watch) has a revision below it, or any answer another cluster id,
//     etcd's history changed (restored from a snapshot, or replaced), and
//     it logs that once (WARN), ends the watch and delivers a fresh
//     snapshot judged as a new watcher would, although its revision is
//     lower. A watch answer's revision proves nothing (a lagging member may
//     answer);
//   - every delivery sets the WithRevisionGauge gauge to the set's revision
//     (a cached set: its cached revision), and every snapshot delivered is
//     logged (INFO) with its revision;
//   - with WithCacheFile, the last delivered set is written atomically
//     (temporary file + rename) and served at start-up when etcd cannot be
//     reached, so an enforcer restarted during an etcd outage keeps its rules.
package etcdstore
