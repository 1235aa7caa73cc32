package ledger

import "time"

// Version orders the writes of one region to its store: by incarnation, then
// by sequence. The store keeps, per key, the highest version it has applied.
type Version struct {
	Inc uint64
	Seq uint64
}

// Less reports whether v is ordered before o.
func (v Version) Less(o Version) bool {
	if v.Inc != o.Inc {
		return v.Inc < o.Inc
	}
	return v.Seq < o.Seq
}

// MarkerKey is the Key of a Write that sets the region's store marker.
const MarkerKey = ""

// Write is one instruction for the region's own store (Redis). See the package
// doc for the store contract; in short:
//
//   - Key != MarkerKey: set the key's share record to Units at Version, if
//     Version is above the stored one: settle the bucket at the old rate,
//     set the new rate and capacity, clamp the tokens, all in one script.
//     Release means the key is back at its initial part and the record may
//     expire with the bucket; otherwise the record must not expire.
//   - Key == MarkerKey: the marker. Create (with the store's RunID) sets it on
//     a store whose run id is RunID; a renewal (Create false) only updates a
//     marker of the same incarnation. Units is the share of every key without
//     a record; Lease is how long, on the store's clock from applying the
//     write, the marker stays valid.
type Write struct {
	Key     string
	Version Version
	Units   int64
	Release bool
	Create  bool
	RunID   string
	Lease   time.Duration
}

// Output is what an input asks the agent to do, in this order: apply Writes
// to the local store, publish Report to all regions, and submit every
// Contribution to the reclaim registry (etcd, compare-and-swap).
type Output struct {
	Writes        []Write
	Report        *Report
	Contributions []Contribution
	// Fenced: this incarnation is over (its store lease is lapsing or lapsed).
	// The agent must start a new incarnation; the ledger ignores further input.
	Fenced bool
}

// Report is one region's periodic message. All slices are sorted (Acks by
// Region then Inc, Keys by Key, counters by Region) so encodings are deterministic.
type Report struct {
	From string
	Inc  uint64
	Seq  uint64
	// Base is the sender's units for keys it has no per-key state for.
	Base int64
	Acks []Ack
	Keys []KeyReport
}

// Ack acknowledges the highest report sequence heard from one incarnation of
// a region. Frozen says the sender has frozen that incarnation for reclaim:
// it will ignore it from now on.
type Ack struct {
	Region string
	Inc    uint64
	Seq    uint64
	Frozen bool
}

// KeyReport is the sender's state for one key.
type KeyReport struct {
	Key      string
	Demand   int64 // units per the global limit, EWMA
	Position int64 // the units the sender enforces
	Gave     []Counter
	Applied  []Counter
}

// Counter is a cumulative, monotone count of units for a peer incarnation:
// in Gave, confirmed units given to it; in Applied, units of its gifts applied.
type Counter struct {
	Region string
	Inc    uint64
	Units  int64
}

// Incarnation names one life of a region.
type Incarnation struct {
	Region string
	Inc    uint64
}

// KeyUnits is a per-key amount of units.
type KeyUnits struct {
	Key   string
	Units int64
}

// Contribution is a survivor's input to the reclaim of a frozen incarnation:
// per key, Q = (confirmed units it gave the incarnation) - (units of the
// incarnation's gifts it applied).
// The survivor keeps -Q in its own position for good.
type Contribution struct {
	Of   Incarnation
	From Incarnation
	Q    []KeyUnits // sorted by Key, zero entries omitted
}

// Record is the reclaim registry's view of the reclaim of one incarnation.
// Once Complete, each key's free units Phi = Base + Own[key] + sum of Q[key]
// over Contributions (never negative: clamped at 0) are split by weight among
// Recipients, one incarnation per other region.
type Record struct {
	Of            Incarnation
	Complete      bool
	Base          int64
	Own           []KeyUnits
	Contributions []Contribution
	Recipients    []Incarnation
	// Required lists the incarnations whose contributions complete the record.
	Required []Incarnation
}
