// Package usage carries usage deltas from enforcers to their own region's
// sync agent: the admitted and rejected cost per global rule and bucket key
// since the last flush.
//
// An enforcer calls Recorder.Add on the request path. A Publisher drains the
// Recorder every interval (100 ms by default), at the interval's multiples
// on the wall clock (NextFlush: every enforcer at the same instants, which
// the sync agent ticks between), encodes the deltas in a
// compact binary Batch and publishes it on Subject(region), a region-local
// NATS subject; with no deltas, an empty batch (no groups), so that the
// agent hears every enforcer at every flush and can tell a flush that is
// late (a stalled NATS server) from one with no usage (sync/agent waits
// for late usage before its demand estimates read the interval). The
// agent receives batches with Subscribe and folds them into its demand
// estimates.
//
// Invariants:
//   - Never blocks the request path. Add takes one short, sharded mutex and
//     does no I/O and, once the key's shard has grown, no allocation. All NATS
//     work happens on the Publisher's own goroutine.
//   - Bounded memory. A Recorder holds at most maxKeys distinct (rule, key)
//     pairs between two drains; additions for further keys are dropped and
//     counted (Dropped). Decode allocates at most a constant factor of its
//     input, which is itself limited to MaxMessageSize.
//   - Malformed input never changes anything. Decode either returns a
//     complete, valid Batch or an error wrapping ErrMalformed, and never
//     panics; Subscribe drops such messages and reports them to onBad.
//
// Usage is demand information, not capacity: losing a batch (a publish
// error, a NATS outage) makes the agent underestimate demand for one
// interval, never lets a region enforce more than its share. Deltas are not
// idempotent, so a receiver that may see duplicates can drop them by
// (Enforcer, Seq); core NATS does not duplicate messages.
//
// The subject is not authenticated beyond NATS permissions, so a receiver
// takes every delta as untrusted: Decode checks the form only. Counts are
// anything from 0 to 2^63-1 (a larger one is malformed), so two of them
// may add past int64: the sync agent adds them with saturation, and its
// ledger bounds the demand they make (sync/ledger, DemandCap). Strings are
// bytes: the enforcers only send rules and keys that are valid UTF-8
// (regional refuses a request whose client key or attributes are not:
// check.go), and the agent
// drops a delta whose rule or key is not, alone, and applies the rest of
// its batch.
//
// # Wire format (version 1)
//
//	magic    byte 0xA1 (format version 1; other values are rejected)
//	region   string
//	enforcer string
//	seq      uvarint
//	ndeltas  uvarint              total deltas in the batch
//	ngroups  uvarint
//	ngroups x group:
//	  rule   string               written once per group
//	  nkeys  uvarint (>= 1)
//	  nkeys x:
//	    key      string
//	    admitted uvarint
//	    rejected uvarint
//
// where string is a uvarint length (at most MaxStringLen) followed by that
// many bytes. Encode groups the deltas by rule (stable: rules in order of
// first appearance, keys in their original order within a rule), so each
// rule id is written once per batch; Recorder.Drain already returns deltas
// sorted by rule and key. The sum of the nkeys must equal ndeltas and no
// byte may follow the last group. With 11-byte keys ("user:000123") and
// counts below 128 a delta costs 14 bytes; a message adds about 30 bytes of
// header and 12 per rule (see BenchmarkEncode).
//
// Front coding of sorted keys (shared prefix length + suffix) was considered
// and left out: it saves a few bytes per key but lets a small message
// describe many long keys, so decoded size would no longer be bounded by the
// input size.
package usage
