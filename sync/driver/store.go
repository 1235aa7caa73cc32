package driver

import (
	"time"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/sync/ledger"
)

// StoreRule is what the store needs of a rule besides the ledger's writes.
type StoreRule struct {
	Capacity int64   // thousandths of a token (rules.Rule.Capacity x 1000)
	Rate     float64 // tokens per second (rules.Rule.RefillPerSecond)
	Total    int64   // units of the whole limit (the spec's)
	Floor    int64   // this region's floor units
}

// StoreWrites turns a rule's ledger writes into the share records and
// marker writes of regional/redisstore, in the order the agent applies them
// (records in one WriteShares call, then each marker). The agent writes them
// to Redis, the simulator to the store's Go reference model.
func StoreWrites(ws []ledger.Write, p StoreRule) ([]redisstore.ShareRecord, []redisstore.Marker) {
	capacity := p.Capacity
	rate := allocation.Thousandths(p.Rate)
	// TTL: time to refill the whole bucket from empty, plus a second.
	ttl := time.Duration(float64(capacity)/float64(rate)*float64(time.Second)) + time.Second
	var recs []redisstore.ShareRecord
	var markers []redisstore.Marker
	for _, w := range ws {
		if w.Key == ledger.MarkerKey {
			markers = append(markers, redisstore.Marker{Inc: w.Version.Inc, Seq: w.Version.Seq, Units: w.Units,
				Lease: w.Lease.Truncate(time.Millisecond), Create: w.Create, RunID: w.RunID})
			continue
		}
		recs = append(recs, redisstore.ShareRecord{Key: w.Key, Inc: w.Version.Inc, Seq: w.Version.Seq, Units: w.Units,
			Release: w.Release, Capacity: capacity, Rate: rate, Total: p.Total, Floor: p.Floor, TTL: min(ttl, 365*24*time.Hour)})
	}
	return recs, markers
}

// Confirmations are the confirmations of a WriteShares call's versions
// (one per record, in order) and of the marker writes' versions.
func Confirmations(recs []redisstore.ShareRecord, vs []redisstore.Version, markers []redisstore.Version) []ledger.Confirmation {
	var out []ledger.Confirmation
	for i, v := range vs {
		if i < len(recs) {
			out = append(out, ledger.Confirmation{Key: recs[i].Key, Version: ledger.Version{Inc: v.Inc, Seq: v.Seq}})
		}
	}
	for _, v := range markers {
		out = append(out, ledger.Confirmation{Key: ledger.MarkerKey, Version: ledger.Version{Inc: v.Inc, Seq: v.Seq}})
	}
	return out
}
