package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/apportion/apportion/rules"
)

// Global marks a global token bucket: the Bucket's Capacity and Rate are the
// GLOBAL capacity and rate (thousandths), of which the store enforces a
// share in units (see the package doc, "Global buckets").
type Global struct {
	Rule  string // rule id: names the marker (MarkerKey)
	Units int64  // U, units of the whole limit, in [1, MaxUnits]
	Floor int64  // this region's floor units, in [0, Units]
}

// Version orders a region's writes to its store: by incarnation, then by
// sequence (the ledger's Version).
type Version struct{ Inc, Seq uint64 }

// Less reports whether v is ordered before o.
func (v Version) Less(o Version) bool {
	if v.Inc != o.Inc {
		return v.Inc < o.Inc
	}
	return v.Seq < o.Seq
}

// Marker is a write of a rule's marker: the incarnation whose share records
// count, and the default units of keys without a record.
type Marker struct {
	Inc, Seq uint64
	Units    int64         // default units for keys without a record, in [0, MaxUnits]
	Lease    time.Duration // validity from apply, on the store's clock (whole ms, in [0, MaxLease])
	Create   bool
	RunID    string // with Create: the store run id the marker is for
}

// ShareRecord is a write of one key's share record.
type ShareRecord struct {
	Key            string // bucket key (from Key())
	Inc, Seq       uint64
	Units          int64 // in [0, Total]
	Release        bool  // the record may expire with the bucket (else the key is made persistent)
	Capacity, Rate int64 // the rule's GLOBAL capacity and rate, thousandths (for settling and clamping)
	Total          int64 // U
	Floor          int64 // the region's floor units, in [0, Total]
	TTL            time.Duration
}

// Bounds of the global-bucket parameters. Records store Inc in 3 bytes, Seq
// in 5 and Units (with the Release bit) in 4, which keeps a bucket holding a
// record at 36 bytes of state; MaxUnits also keeps the share arithmetic
// exact in Lua (see shareOf).
const (
	MaxUnits = int64(1) << 26
	MaxInc   = uint64(1)<<24 - 1
	MaxSeq   = uint64(1)<<40 - 1
	MaxLease = 24 * time.Hour
)

// errNotImplemented: intermediate commit, the scripts follow.
var errNotImplemented = errors.New("redisstore: not implemented yet")

// MarkerKey is the Redis key of a rule's marker: "rl:marker:<rule id
// escaped as in Key>". It has no hash tag (see the package doc on Redis Cluster).
func MarkerKey(ruleID string) string {
	var b strings.Builder
	b.WriteString("rl:marker:")
	escape(&b, ruleID, true)
	return b.String()
}

func validateGlobal(i int, b Bucket) error {
	g := b.Global
	switch {
	case g == nil:
		return nil
	case b.Algorithm != rules.TokenBucket:
		return fmt.Errorf("%w: buckets[%d].Global is only for %s", ErrInvalidBucket, i, rules.TokenBucket)
	case g.Rule == "":
		return fmt.Errorf("%w: buckets[%d].Global.Rule is empty", ErrInvalidBucket, i)
	case g.Units < 1 || g.Units > MaxUnits:
		return fmt.Errorf("%w: buckets[%d].Global.Units %d must be in [1, 2^26]", ErrInvalidBucket, i, g.Units)
	case g.Floor < 0 || g.Floor > g.Units:
		return fmt.Errorf("%w: buckets[%d].Global.Floor %d must be in [0, Units]", ErrInvalidBucket, i, g.Floor)
	}
	return nil
}

func validateVersion(inc, seq uint64) error {
	if inc > MaxInc || seq > MaxSeq {
		return fmt.Errorf("%w: version (%d, %d) beyond (2^24-1, 2^40-1)", ErrInvalidShare, inc, seq)
	}
	return nil
}

func validateMarker(rule string, m Marker) error {
	switch {
	case rule == "":
		return fmt.Errorf("%w: rule is empty", ErrInvalidShare)
	case m.Units < 0 || m.Units > MaxUnits:
		return fmt.Errorf("%w: marker units %d must be in [0, 2^26]", ErrInvalidShare, m.Units)
	case m.Lease < 0 || m.Lease > MaxLease || m.Lease%time.Millisecond != 0:
		return fmt.Errorf("%w: marker lease %v must be whole ms in [0, %v]", ErrInvalidShare, m.Lease, MaxLease)
	case m.Create && m.RunID == "":
		return fmt.Errorf("%w: marker create without RunID", ErrInvalidShare)
	}
	return validateVersion(m.Inc, m.Seq)
}

func validateRecord(i int, r ShareRecord) error {
	switch {
	case r.Key == "":
		return fmt.Errorf("%w: records[%d].Key is empty", ErrInvalidShare, i)
	case r.Total < 1 || r.Total > MaxUnits:
		return fmt.Errorf("%w: records[%d].Total %d must be in [1, 2^26]", ErrInvalidShare, i, r.Total)
	case r.Units < 0 || r.Units > r.Total:
		return fmt.Errorf("%w: records[%d].Units %d must be in [0, Total]", ErrInvalidShare, i, r.Units)
	case r.Floor < 0 || r.Floor > r.Total:
		return fmt.Errorf("%w: records[%d].Floor %d must be in [0, Total]", ErrInvalidShare, i, r.Floor)
	case r.Capacity < 1 || r.Capacity > MaxCapacity:
		return fmt.Errorf("%w: records[%d].Capacity %d must be in [1, %d]", ErrInvalidShare, i, r.Capacity, MaxCapacity)
	case r.Rate < 1 || r.Rate > MaxRate:
		return fmt.Errorf("%w: records[%d].Rate %d must be in [1, %d]", ErrInvalidShare, i, r.Rate, MaxRate)
	case r.TTL < 0 || r.TTL > 365*24*time.Hour:
		return fmt.Errorf("%w: records[%d].TTL %v must be in [0, 365d]", ErrInvalidShare, i, r.TTL)
	}
	if err := validateVersion(r.Inc, r.Seq); err != nil {
		return fmt.Errorf("records[%d]: %w", i, err)
	}
	return nil
}

// RunID returns the store's current run id (INFO server run_id); it changes
// when Redis restarts.
func (s *Store) RunID(ctx context.Context) (string, error) {
	info, err := s.client.Info(ctx, "server").Result()
	if err != nil {
		return "", fmt.Errorf("redisstore: run id: %w", err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "run_id:"); ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("%w: INFO server without run_id", ErrBadReply)
}

// WriteMarker applies m for rule; it returns the marker version the store
// holds afterwards.
func (s *Store) WriteMarker(ctx context.Context, rule string, m Marker) (Version, error) {
	if err := validateMarker(rule, m); err != nil {
		return Version{}, err
	}
	return Version{}, errNotImplemented
}

// WriteShares applies each record (one script call per record, pipelined);
// it returns per record the version the store holds for that key afterwards.
func (s *Store) WriteShares(ctx context.Context, rule string, recs []ShareRecord) ([]Version, error) {
	for i, r := range recs {
		if err := validateRecord(i, r); err != nil {
			return nil, err
		}
	}
	return nil, errNotImplemented
}
