package redisstore

import "fmt"

// Sharded sync agents (sync/agent, "Shards"): the agents of one region
// split the hash slots of its Redis Cluster into N contiguous ranges, and
// shard i writes the marker copies of its own range only. A check reads the
// copy of its key's slot (ClusterMarkerKey) as before, so the enforcer needs
// no change: the copy it reads is the one of the shard that owns the key.

// ShardSlots returns the hash slots [lo, hi) of shard i of n: the Slots
// slots split into n contiguous ranges, as evenly as integers allow.
func ShardSlots(i, n int) (lo, hi int) {
	return i * Slots / n, (i + 1) * Slots / n
}

// ShardOf returns the shard of n that owns key: the one whose ShardSlots
// range holds key's hash slot.
func ShardOf(key string, n int) int {
	if n <= 1 {
		return 0
	}
	return (HashSlot(key)*n + n - 1) / Slots
}

// WithMarkerSlots makes WriteMarker write only the marker copies of the
// hash slots [lo, hi) (ShardSlots of the agent's shard). It needs a Redis
// Cluster client (New fails otherwise): a single server has one marker per
// rule, which one shard cannot own alone. Default: every slot.
func WithMarkerSlots(lo, hi int) Option {
	return func(o *options) error {
		if lo < 0 || hi > Slots || lo >= hi {
			return fmt.Errorf("redisstore: marker slots [%d, %d) must be a non-empty range within [0, %d)", lo, hi, Slots)
		}
		o.slotLo, o.slotHi = lo, hi
		return nil
	}
}

// markerSlots is the range of slots whose marker copies WriteMarker writes.
func (o options) markerSlots() (lo, hi int) {
	if o.slotHi == 0 {
		return 0, Slots
	}
	return o.slotLo, o.slotHi
}
