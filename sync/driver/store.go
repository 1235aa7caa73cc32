package driver

import (
	"math"
	"time"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/ledger"
)

// StoreRule is what the store needs of a rule besides the ledger's writes.
type StoreRule struct {
	// Algorithm is "" or token_bucket (Capacity and Rate), or fixed_window
	// or sliding_window (a global window: Limit and Window).
	Algorithm rules.Algorithm
	Capacity  int64         // thousandths of a token (rules.Rule.Capacity x 1000)
	Rate      float64       // tokens per second (rules.Rule.RefillPerSecond)
	Limit     int64         // a window's global limit per window (rules.Rule.Limit)
	Window    time.Duration // a window's window (rules.Rule.Window)
	Total     int64         // units of the whole limit (the spec's)
	Floor     int64         // this region's floor units
}

// IsWindow reports whether p is a global window (the store's records are
// written with WriteWindowShares, which answers a refusal with a Refusal).
func (p StoreRule) IsWindow() bool {
	return p.Algorithm == rules.FixedWindow || p.Algorithm == rules.SlidingWindow
}

// StoreWrites turns a rule's ledger writes into the share records and
// marker writes of regional/redisstore, in the order the agent applies them
// (records in one WriteShares or WriteWindowShares call, then each marker).
// The agent writes them to Redis, the simulator to the store's Go reference
// model. A record's TTL (for Release records) is the time the bucket needs
// to forget its use, plus a second: a token bucket's refill from empty, a
// window's two windows.
func StoreWrites(ws []ledger.Write, p StoreRule) ([]redisstore.ShareRecord, []redisstore.Marker) {
	// Sized once (a marker or two too many): grown by append, a chunk of
	// the agent's writes left its smaller copies to the next GC.
	return AppendStoreWrites(make([]redisstore.ShareRecord, 0, len(ws)), ws, p)
}

// AppendStoreWrites is StoreWrites appending the records to recs: the agent
// writes a flush's records in chunks through one buffer.
func AppendStoreWrites(recs []redisstore.ShareRecord, ws []ledger.Write, p StoreRule) ([]redisstore.ShareRecord, []redisstore.Marker) {
	base := redisstore.ShareRecord{Total: p.Total, Floor: p.Floor}
	var ttl time.Duration
	if p.IsWindow() {
		base.Algorithm, base.Limit, base.Window = p.Algorithm, p.Limit, p.Window
		ttl = 2 * p.Window
	} else {
		base.Capacity, base.Rate = p.Capacity, allocation.Thousandths(p.Rate)
		ttl = time.Duration(float64(base.Capacity) / float64(base.Rate) * float64(time.Second))
	}
	base.TTL = min(ttl+time.Second, 365*24*time.Hour)
	var markers []redisstore.Marker
	for _, w := range ws {
		if w.Key == ledger.MarkerKey {
			var mw ledger.MarkerWrite
			if w.Marker != nil {
				mw = *w.Marker
			}
			markers = append(markers, redisstore.Marker{Inc: w.Version.Inc, Seq: w.Version.Seq, Units: w.Units,
				Lease: mw.Lease.Truncate(time.Millisecond), Create: mw.Create, Boot: mw.Boot, RunID: mw.RunID})
			continue
		}
		rec := base
		rec.Key, rec.Inc, rec.Seq, rec.Units, rec.Release = w.Key, w.Version.Inc, w.Version.Seq, w.Units, w.Release
		recs = append(recs, rec)
	}
	return recs, markers
}

// Applied is the store's answer to one rule's writes of a flush.
type Applied struct {
	// Confirmations: the version the store holds for each key written (or
	// the marker, ledger.MarkerKey).
	Confirmations []ledger.Confirmation
	// Refused are the window records the store refused as below what their
	// key has used of its window; the driver tells the ledger (Ledger.Hold)
	// before it feeds the confirmations.
	Refused []Refusal
}

// Refusal is a refused window record: Need is the fewest units Key can take
// now, Until the time until its window ends (redisstore.WindowApplied).
type Refusal struct {
	Key   string
	Need  int64
	Until time.Duration
}

// Versions are WriteShares' versions as WriteWindowShares' answers (none refused).
func Versions(vs []redisstore.Version) []redisstore.WindowApplied {
	out := make([]redisstore.WindowApplied, len(vs))
	for i, v := range vs {
		out[i].Version = v
	}
	return out
}

// Confirmations is the Applied of a WriteWindowShares call's answers (or
// WriteShares' versions through Versions; one per record, in order) and of
// the marker writes' versions.
func Confirmations(recs []redisstore.ShareRecord, vs []redisstore.WindowApplied, markers []redisstore.Version) Applied {
	var out Applied
	out.Add(recs, vs, markers)
	return out
}

// Add appends what Confirmations returns to a: a store call's answers added
// to those of the flush's earlier calls (the agent writes a rule's records
// in chunks; sized once for all of them, the confirmations of a flush
// writing every key are not copied as they grow).
func (a *Applied) Add(recs []redisstore.ShareRecord, vs []redisstore.WindowApplied, markers []redisstore.Version) {
	for i, v := range vs {
		if i >= len(recs) {
			break
		}
		a.Confirmations = append(a.Confirmations, ledger.Confirmation{Key: recs[i].Key, Version: ledger.Version{Inc: v.Version.Inc, Seq: v.Version.Seq}})
		if v.Need > 0 {
			a.Refused = append(a.Refused, Refusal{Key: recs[i].Key, Need: v.Need, Until: v.Until})
		}
	}
	for _, v := range markers {
		a.Confirmations = append(a.Confirmations, ledger.Confirmation{Key: ledger.MarkerKey, Version: ledger.Version{Inc: v.Inc, Seq: v.Seq}})
	}
}

// WindowWait is how much longer than a token bucket's a survivor waits
// before it reclaims a silent region's share of a window rule (added to the
// ledger's Margin): one window on the silent region's store clock,
// W(1+rho)/(1-rho) on the survivor's. The silent store falls to its floor
// when its lease lapses, but what it admitted in that window stays
// admitted; its units may be used elsewhere only once that window is over.
func WindowWait(window time.Duration, rho float64) time.Duration {
	return time.Duration(math.Ceil(float64(window) * (1 + rho) / (1 - rho)))
}
