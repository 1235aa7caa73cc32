package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
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
	// Boot, with Create: the writer's first incarnation makes its first
	// Create and has seen no store reset, so the keys it enforced at the
	// floor before it may get the boot fill (package doc, "The boot fill";
	// only for Inc 1: a store incarnation mapped from a later epoch of
	// sharded agents never fills). The store cannot tell a first boot from a
	// Redis that restarted empty; only the writer can. Ignored without
	// Create.
	Boot bool
}

// ShareRecord is a write of one key's share record.
type ShareRecord struct {
	Key            string // bucket key (from Key())
	Inc, Seq       uint64
	Units          int64 // in [0, Total]
	Release        bool  // the record may expire with the bucket (else the key keeps it for Hold)
	Capacity, Rate int64 // the rule's GLOBAL capacity and rate, thousandths (for settling and clamping)
	// Algorithm is "" or token_bucket (Capacity and Rate), or fixed_window
	// or sliding_window (a global window: Limit and Window; see global_window.go).
	Algorithm rules.Algorithm
	Limit     int64         // a global window's GLOBAL limit per window
	Window    time.Duration // a global window's window (whole ms)
	Total     int64         // U
	Floor     int64         // the region's floor units, in [0, Total]
	// TTL is the least TTL of a Release record's key (it also gets the
	// bucket's: the time to forget its use).
	TTL time.Duration
	// Hold is the least TTL of the key of any other record (it also gets the
	// bucket's); zero makes the key persistent. A writer that gives a held
	// key a Hold must re-write its record before the Hold runs out, or the
	// key is forgotten and enforces the marker's default units (see the
	// package doc, "Record TTLs").
	Hold time.Duration
}

// keyTTL is the least TTL r gives its key (Release: TTL; else Hold).
func (r ShareRecord) keyTTL() time.Duration {
	if r.Release {
		return r.TTL
	}
	return r.Hold
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
	case !GlobalAlgorithm(b.Algorithm):
		return fmt.Errorf("%w: buckets[%d].Global is only for %s, %s and %s", ErrInvalidBucket, i, rules.TokenBucket, rules.FixedWindow, rules.SlidingWindow)
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
	case r.TTL < 0 || r.TTL > 365*24*time.Hour:
		return fmt.Errorf("%w: records[%d].TTL %v must be in [0, 365d]", ErrInvalidShare, i, r.TTL)
	case r.Hold < 0 || r.Hold > 365*24*time.Hour:
		return fmt.Errorf("%w: records[%d].Hold %v must be in [0, 365d]", ErrInvalidShare, i, r.Hold)
	}
	if err := validateVersion(r.Inc, r.Seq); err != nil {
		return fmt.Errorf("records[%d]: %w", i, err)
	}
	return r.validateLimit(i)
}

// EmbeddedRunID is the run id of a server that answers that INFO server is
// not supported (an embedded server such as miniredis, whose data lives and
// dies with the process). It is not hexadecimal, so it never equals a Redis
// run id.
const EmbeddedRunID = "embedded"

// RunID returns the store's current run id (INFO server run_id); it changes
// when Redis restarts. On a Cluster it is a digest of the slot map and every
// master's run id (see the package doc). A server that answers that INFO server is not
// supported has the fixed run id EmbeddedRunID (the scripts read it the
// same way); any other error, a network one included, is returned.
func (s *Store) RunID(ctx context.Context) (string, error) {
	if s.cluster != nil {
		return s.clusterRunID(ctx)
	}
	info, err := s.client.Info(ctx, "server").Result()
	if infoUnsupported(err) {
		return EmbeddedRunID, nil
	}
	if err != nil {
		return "", fmt.Errorf("redisstore: run id: %w", err)
	}
	return parseRunID(info)
}

// parseRunID reads the run id from an INFO server reply exactly as the
// scripts do (Lua string.match(info, 'run_id:(%x+)')): the hex digits after
// the first "run_id:" followed by at least one. Reading it any other way
// would let the two disagree, and then no marker would ever apply.
func parseRunID(info string) (string, error) {
	for rest := info; ; {
		i := strings.Index(rest, "run_id:")
		if i < 0 {
			return "", fmt.Errorf("%w: INFO server without a hexadecimal run_id", ErrBadReply)
		}
		rest = rest[i+len("run_id:"):]
		n := 0
		for n < len(rest) && isHex(rest[n]) {
			n++
		}
		if n > 0 {
			return rest[:n], nil
		}
	}
}

func isHex(c byte) bool { return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F' }

// WriteMarker applies m for rule, in one script: a Create applies only if
// the store's current run id is m.RunID and m's version is above the held
// marker's; a renewal (Create false) only over a held marker of m.Inc with a
// version at most m's. Either sets the default units and the lease (the
// store's clock when applied, until that plus m.Lease, but no later than
// the store's clock read just before the write was sent plus m.Lease: a
// write Redis runs late, starved or paused after reading it, cannot end its
// lease later than one applied at once; the ledger takes a write not in
// effect StoreTimeout after it was issued as never in effect, and ctx's
// deadline bounds the read of that clock). A marker left by another server
// run (restored from a snapshot) counts as no marker. It returns the marker
// version the store holds afterwards (zero: none). On a Cluster it writes
// every slot's copy (see the package doc, "Redis Cluster"), each capped on
// its master's clock likewise, and returns the lowest version a copy holds.
func (s *Store) WriteMarker(ctx context.Context, rule string, m Marker) (Version, error) {
	if err := validateMarker(rule, m); err != nil {
		return Version{}, err
	}
	now, err := s.nowArg()
	if err != nil {
		return Version{}, err
	}
	if s.cluster != nil {
		return s.writeMarkerCluster(ctx, rule, m, now)
	}
	keys := []string{MarkerKey(rule)}
	create := createArg(m)
	args := []any{m.Inc, m.Seq, m.Units, m.Lease.Milliseconds(), create, m.RunID, now}
	if now == "" {
		// The latest lease end: the server's clock now, before the write
		// is sent, plus the lease (the script's cap, as a Cluster copy's).
		tm, err := s.client.Time(ctx).Result()
		if err != nil {
			return Version{}, fmt.Errorf("redisstore: write marker of %q: the server's clock: %w", rule, err)
		}
		if markerAnchored != nil {
			markerAnchored()
		}
		args = append(args, tm.UnixMilli()+m.Lease.Milliseconds())
	}
	v, err := s.evalShas(ctx, s.marker, 1, func(int) []string { return keys }, func(int) []any { return args })[0].Result()
	if err != nil {
		return Version{}, fmt.Errorf("redisstore: write marker of %q: %w", rule, err)
	}
	return parseVersion(v)
}

// markerAnchored, if set (tests), runs in WriteMarker between the read of
// the server's clock and the write.
var markerAnchored func()

// createArg is the marker script's create argument: 0 a renewal, 1 a
// Create, 2 a boot Create (Marker.Boot).
func createArg(m Marker) int {
	switch {
	case m.Create && m.Boot:
		return 2
	case m.Create:
		return 1
	}
	return 0
}

// validateShares checks the arguments of WriteShares (Store and Model).
func validateShares(rule string, recs []ShareRecord) error {
	if rule == "" {
		return fmt.Errorf("%w: rule is empty", ErrInvalidShare)
	}
	for i, r := range recs {
		if err := validateRecord(i, r); err != nil {
			return err
		}
	}
	return sameAlgorithm(recs)
}

// WriteShares applies each record, one script call per record, pipelined.
// A record applies if its version is at least the key's stored one (equal:
// applied again); it settles the bucket at the rate and capacity it last
// enforced, stores the record, then enforces what Check would (the record's
// units if the rule's marker is in force for the record's incarnation, else
// the floor) and clamps the tokens to the new capacity. A Release record
// gets the bucket's TTL (at least rec.TTL); any other the bucket's TTL, at
// least rec.Hold, or, with no Hold, makes the key persistent. It returns per record the version the key holds afterwards;
// on an error for any record it returns the error and no versions.
func (s *Store) WriteShares(ctx context.Context, rule string, recs []ShareRecord) ([]Version, error) {
	if err := validateShares(rule, recs); err != nil || len(recs) == 0 {
		return nil, err
	}
	if recs[0].isWindow() {
		return versionsOf(s.WriteWindowShares(ctx, rule, recs))
	}
	now, err := s.nowArg()
	if err != nil {
		return nil, err
	}
	return writeRecords(ctx, s, s.shares, rule, recs, parseVersion, func(r ShareRecord, rel int) []any {
		return []any{r.Inc, r.Seq, r.Units, rel, r.Capacity, r.Rate, r.Total, r.Floor, r.TTL.Milliseconds(), now, s.slackMs, r.Hold.Milliseconds()}
	})
}

// writeRecords runs script sc once per record (the record's key and the
// marker copy of its slot), pipelined, and parses each answer; on an error
// for any record it returns the error and no answers. args gives a record's
// script arguments, with rel its Release flag as 0 or 1.
func writeRecords[T any](ctx context.Context, s *Store, sc *redis.Script, rule string, recs []ShareRecord, parse func(any) (T, error), args func(r ShareRecord, rel int) []any) ([]T, error) {
	cmds := s.evalShas(ctx, sc, len(recs), func(i int) []string { return []string{recs[i].Key, s.markerKeyFor(rule, recs[i].Key)} },
		func(i int) []any {
			rel := 0
			if recs[i].Release {
				rel = 1
			}
			return args(recs[i], rel)
		})
	out := make([]T, len(recs))
	for i, c := range cmds {
		v, err := c.Result()
		if err != nil {
			return nil, fmt.Errorf("redisstore: write share of %q: %w", recs[i].Key, err)
		}
		if out[i], err = parse(v); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func parseVersion(v any) (Version, error) {
	a, ok := v.([]any)
	if !ok || len(a) != 2 {
		return Version{}, fmt.Errorf("%w: %T", ErrBadReply, v)
	}
	inc, ok1 := a[0].(int64)
	seq, ok2 := a[1].(int64)
	if !ok1 || !ok2 || inc < 0 || seq < 0 {
		return Version{}, fmt.Errorf("%w: %v", ErrBadReply, a)
	}
	return Version{uint64(inc), uint64(seq)}, nil
}

func (r ShareRecord) versionOf() Version { return Version{r.Inc, r.Seq} }

// infoUnsupported reports whether err is the server's answer that INFO
// server is not supported (miniredis: "section (server) is not supported"),
// as opposed to a failure to get an answer.
func infoUnsupported(err error) bool {
	var rerr redis.Error
	return errors.As(err, &rerr) && strings.Contains(rerr.Error(), "not supported")
}
