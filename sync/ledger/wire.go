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
//   - Key == MarkerKey: the marker, with Marker set. Units is the share of
//     every key without a record; the rest is in Marker.
//
// A tick that moves every key writes every key, and the writes of one flush
// wait together for the store: the marker's fields are behind a pointer so
// that a key's write is 56 bytes, not 72.
type Write struct {
	Key     string
	Version Version
	Units   int64
	Release bool
	// Marker is set for Key == MarkerKey only.
	Marker *MarkerWrite
}

// MarkerWrite is what a marker write has besides its version and units.
// Create (with the store's RunID) sets the marker on a store whose run id is
// RunID; a renewal (Create false) only updates a marker of the same
// incarnation. Lease is how long, on the store's clock from applying the
// write, the marker stays valid.
type MarkerWrite struct {
	Create bool
	// Boot, with Create: this is the region's first incarnation's first
	// marker and its store has not been reset; the store may give keys it
	// enforced at the floor until now the boot fill (regional/redisstore).
	Boot  bool
	RunID string
	Lease time.Duration
}

// Create reports whether w is a marker write that creates the marker.
func (w Write) Create() bool { return w.Marker != nil && w.Marker.Create }

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
	// Superseded, with Fenced, is the store's marker that ended this
	// incarnation: one it never wrote (Ledger.ShareApplied): a newer
	// incarnation of this region's, or another life with this one's
	// number. Zero when it fenced for another reason.
	Superseded Version
	// Close, when not zero, asks the agent to record Registry.Close(Close):
	// this incarnation's marker is confirmed, so every earlier incarnation of
	// its region is at its floor for good. Repeated until a Record with
	// Closer set for this incarnation reaches ReclaimRecorded.
	Close Incarnation
	// Take, when its Region is set, asks the agent to take a silent
	// peer's witness key (witness.go) and call WitnessTaken if it did.
	Take Take
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
	// Closes lists the sender's closures of peers' key retirements not yet
	// acknowledged (retire.go), sorted by Key, Region, Inc. Like Acks it
	// belongs to the report as a whole (a split report repeats it).
	Closes []Closure
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
	// Retire, when not zero, says the sender is retiring the key (retire.go):
	// its counters above are final, and the number names this retirement.
	Retire uint64
}

// Closure tells incarnation Inc of Region that the sender has closed its
// pair with it on Key for retirement number Retire: from the report that
// first carried the closure on, the sender's counters for that pair count
// afresh (retire.go).
type Closure struct {
	Key    string
	Region string
	Inc    uint64
	Retire uint64
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

// Record is the reclaim registry's view of one incarnation: its reclaim and
// what reclaims have paid it.
//
// Once Complete, the incarnation is over for everyone: peers freeze it, and
// it fences itself. Cohort lists the incarnations reclaimed together with it;
// the record of the first member carries the units they freed, per key
// Base + Keys[key] (Base alone for keys not listed), which the registry split
// by weight among Recipients (the newest unreclaimed incarnation of every
// region, members excepted; in whole tokens with a Quantum: Registry.split)
// and added to their Paid.
type Record struct {
	Of       Incarnation
	Complete bool
	Base     int64
	Keys     []KeyUnits
	Cohort   []Incarnation
	// Contributions received so far (incomplete records).
	Contributions []Contribution
	Recipients    []Incarnation
	// Required lists the incarnations whose contribution (or closure) the
	// reclaim waits for (incomplete records).
	Required []Incarnation
	// Closer: Of has recorded (Registry.Close) that its predecessors are over.
	Closer bool
	// Paid is everything reclaims have paid Of so far, cumulative: a ledger
	// applies what it has not applied yet (and only while it holds a lease).
	Paid *Payment
}

// Payment is a cumulative payment to one incarnation: Base units on every
// key, plus Keys[key] on the keys listed.
type Payment struct {
	Seq  uint64 // number of payouts so far: a ledger ignores an older Payment
	Base int64
	Keys []KeyUnits
}
