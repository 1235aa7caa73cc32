// Package strategy holds the ways of enforcing a global limit across regions
// that the simulator compares, one file each: the centralized ideal (the
// reference), a static split, independent regions, async usage sync without a
// ledger (the common industry approach) and the share ledger of this project
// (sync/ledger driven by the sync agent's own loop, sync/driver).
//
// Invariant: every strategy enforces each region's requests with the token
// bucket arithmetic of the enforcer's Redis script: the ledger with the
// script's Go reference model itself (regional/redisstore.Model), the others
// with sim.Bucket, which a test holds to that model; so the strategies differ
// only in how they set and feed those buckets.
package strategy

import "github.com/apportion/apportion/simulations/sim"

// All returns the five strategies in report order, the ideal first.
func All() []sim.Strategy {
	return []sim.Strategy{&Ideal{}, &Static{}, &Independent{}, &Async{}, &Ledger{}}
}

// buckets is one region's buckets, one per key, allocated on first use.
type buckets []sim.Bucket

// newBuckets returns one bucket per key, each a fixed window if its key is.
func newBuckets(keys []sim.Key) buckets {
	b := make(buckets, len(keys))
	for i, k := range keys {
		b[i].W = k.WindowMs
	}
	return b
}
