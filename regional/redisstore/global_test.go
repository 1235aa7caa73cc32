package redisstore

import (
	"errors"
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
)

// The global rule of the contract cases: 1000 tokens of capacity and 1000
// tokens/s, in 1000 units (1 unit = 1 token and 1 token/s), floor 100.
const (
	gRule  = "global"
	gCap   = 1_000_000
	gRate  = 1_000_000
	gUnits = 1000
	gFloor = 100
)

func globalBucket(rule, key string) Bucket {
	return Bucket{Key: key, Algorithm: rules.TokenBucket, Capacity: gCap, Rate: gRate,
		Global: &Global{Rule: rule, Units: gUnits, Floor: gFloor}}
}

func record(rule, key string, inc, seq uint64, units int64) ShareRecord {
	return ShareRecord{Key: key, Inc: inc, Seq: seq, Units: units, Capacity: gCap, Rate: gRate, Total: gUnits, Floor: gFloor, TTL: time.Minute}
}

// limitOf checks one token of the key at nowMs and returns its enforced
// capacity in tokens (= units here) and the tokens left.
func limitOf(t *testing.T, im impl, rule string, nowMs int64, key string) (limit, remaining int64) {
	t.Helper()
	_, res := im.check(t, nowMs, 1, globalBucket(rule, key))
	return res[0].Limit, res[0].Remaining
}

func wantLimit(t *testing.T, im impl, rule string, nowMs int64, key string, want int64) {
	t.Helper()
	if got, _ := limitOf(t, im, rule, nowMs, key); got != want {
		t.Fatalf("%s at +%dms enforces %d units, want %d", key, nowMs-t0, got, want)
	}
}

func create(im impl, inc, seq uint64, units int64, lease time.Duration) Marker {
	return Marker{Inc: inc, Seq: seq, Units: units, Lease: lease, Create: true}
}

var globalCases = []struct {
	name string
	run  func(t *testing.T, im impl, key func(string) string, rule string)
}{
	{"no marker: floor", func(t *testing.T, im impl, key func(string) string, rule string) {
		wantLimit(t, im, rule, t0, key("a"), gFloor)
		im.shares(t, t0, rule, record(rule, key("b"), 1, 1, 600))
		wantLimit(t, im, rule, t0, key("b"), gFloor)
	}},
	{"valid marker, no record: marker units; a new bucket starts full", func(t *testing.T, im impl, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, 10*time.Second)
		m.RunID = im.runID(t)
		if v := im.marker(t, t0, rule, m); v != (Version{1, 1}) {
			t.Fatalf("create: store holds %v", v)
		}
		if l, rem := limitOf(t, im, rule, t0, key("a")); l != 300 || rem != 299 {
			t.Fatalf("limit %d remaining %d, want 300, 299", l, rem)
		}
	}},
	{"record of the marker's incarnation: record units; of another: floor", func(t *testing.T, im impl, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, t0, rule, m)
		if v := im.shares(t, t0, rule, record(rule, key("a"), 1, 2, 600)); v[0] != (Version{1, 2}) {
			t.Fatalf("record: store holds %v", v)
		}
		wantLimit(t, im, rule, t0, key("a"), 600)
		// a new incarnation's marker floors every record of the old one at once
		m = create(im, 2, 1, 300, time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, t0+10, rule, m)
		wantLimit(t, im, rule, t0+10, key("a"), gFloor)
		wantLimit(t, im, rule, t0+10, key("other"), 300)
		im.shares(t, t0+20, rule, record(rule, key("a"), 2, 2, 700))
		wantLimit(t, im, rule, t0+20, key("a"), 700)
	}},
	{"lease lapsed: floor; a renewal restores", func(t *testing.T, im impl, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, 10*time.Second)
		m.RunID = im.runID(t)
		im.marker(t, t0, rule, m)
		im.shares(t, t0, rule, record(rule, key("r"), 1, 2, 600))
		wantLimit(t, im, rule, t0+9_999, key("a"), 300)
		wantLimit(t, im, rule, t0+9_999, key("r"), 600)
		wantLimit(t, im, rule, t0+10_000, key("a"), gFloor)
		wantLimit(t, im, rule, t0+10_000, key("r"), gFloor)
		if v := im.marker(t, t0+11_000, rule, Marker{Inc: 1, Seq: 3, Units: 300, Lease: 10 * time.Second}); v != (Version{1, 3}) {
			t.Fatalf("renewal: store holds %v", v)
		}
		wantLimit(t, im, rule, t0+11_000, key("r"), 600)
		// a clock step back before the marker was applied voids it too
		wantLimit(t, im, rule, t0+10_999, key("r"), gFloor)
	}},
	{"lower first: a giver from 600 to 400 units with 550 banked is clamped to 400", func(t *testing.T, im impl, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, t0, rule, m)
		k := key("a")
		im.shares(t, t0, rule, record(rule, k, 1, 1, 600))
		if ok, res := im.check(t, t0, 50, globalBucket(rule, k)); !ok || res[0].Remaining != 550 {
			t.Fatalf("take 50: %v %+v", ok, res)
		}
		im.shares(t, t0, rule, record(rule, k, 1, 2, 400))
		if l, rem := limitOf(t, im, rule, t0, k); l != 400 || rem != 399 {
			t.Fatalf("after lowering: limit %d remaining %d, want 400, 399", l, rem)
		}
	}},
	{"settle at the old rate across a raise", func(t *testing.T, im impl, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, t0, rule, m)
		k := key("a")
		im.shares(t, t0, rule, record(rule, k, 1, 1, 100))
		if ok, _ := im.check(t, t0, 100, globalBucket(rule, k)); !ok {
			t.Fatal("drain rejected")
		}
		// 500ms at 100/s = 50 tokens, then 600/s from now on
		im.shares(t, t0+500, rule, record(rule, k, 1, 2, 600))
		if l, rem := limitOf(t, im, rule, t0+500, k); l != 600 || rem != 49 {
			t.Fatalf("after the raise: limit %d remaining %d, want 600, 49", l, rem)
		}
		if _, rem := limitOf(t, im, rule, t0+600, k); rem != 49+60-1 {
			t.Fatalf("100ms at the new rate: remaining %d, want 108", rem)
		}
		// the same through Check alone: the marker's default rises by renewal
		k2 := key("b")
		if ok, _ := im.check(t, t0+600, 300, globalBucket(rule, k2)); !ok {
			t.Fatal("drain rejected")
		}
		im.marker(t, t0+1_000, rule, Marker{Inc: 1, Seq: 2, Units: 900, Lease: time.Minute})
		if l, rem := limitOf(t, im, rule, t0+1_100, k2); l != 900 || rem != 150-1 {
			t.Fatalf("after a default raise: limit %d remaining %d, want 900, 149 (500ms at 300/s)", l, rem)
		}
	}},
	{"boot fill: a first incarnation's first marker fills a key built at the floor, once; no other raise does", func(t *testing.T, im impl, key func(string) string, rule string) {
		a, b := key("a"), key("b")
		// before any marker: the floor (100), 30 taken from a; b has a record of 200 written first
		if ok, res := im.check(t, t0, 30, globalBucket(rule, a)); !ok || res[0].Remaining != 70 {
			t.Fatalf("take 30 at the floor: %v %+v", ok, res)
		}
		im.shares(t, t0, rule, record(rule, b, 1, 1, 200))
		m := create(im, 1, 2, 300, time.Minute)
		m.RunID, m.Boot = im.runID(t), true
		im.marker(t, t0, rule, m)
		// a: 70 + (300 - 100) filled, 1 taken; b: 100 + (200 - 100), 1 taken
		if l, rem := limitOf(t, im, rule, t0, a); l != 300 || rem != 269 {
			t.Fatalf("boot fill: limit %d remaining %d, want 300, 269", l, rem)
		}
		if l, rem := limitOf(t, im, rule, t0, b); l != 200 || rem != 199 {
			t.Fatalf("boot fill with a record: limit %d remaining %d, want 200, 199", l, rem)
		}
		// once: a lowering to the floor (a gift), drained, then a raise adds no token
		im.shares(t, t0, rule, record(rule, a, 1, 3, gFloor))
		if ok, _ := im.check(t, t0, gFloor, globalBucket(rule, a)); !ok {
			t.Fatal("drain rejected")
		}
		im.shares(t, t0, rule, record(rule, a, 1, 4, 600))
		if l, rem := limitOf(t, im, rule, t0, a); l != 600 || rem != 0 {
			t.Fatalf("a raise after the boot: limit %d remaining %d, want 600, 0", l, rem)
		}
	}},
	{"boot fill: none for a later incarnation, a Create not flagged Boot, a Create after a lapse or a changed default", func(t *testing.T, im impl, key func(string) string, rule string) {
		drained := func(k string, nowMs int64) {
			t.Helper()
			if ok, _ := im.check(t, nowMs, gFloor, globalBucket(rule, k)); !ok {
				t.Fatal("drain rejected")
			}
		}
		// a later incarnation's first marker
		drained(key("a"), t0)
		m := create(im, 2, 1, 300, 10*time.Second)
		m.RunID = im.runID(t)
		im.marker(t, t0, rule, m)
		if l, rem := limitOf(t, im, rule, t0, key("a")); l != 300 || rem != 0 {
			t.Fatalf("later incarnation: limit %d remaining %d, want 300, 0", l, rem)
		}
		// a first incarnation's Create that its writer does not call a boot
		// (it saw the store reset: an empty Redis looks like a first boot)
		r1 := rule + "-reset"
		d := Key("d", r1)
		if ok, _ := im.check(t, t0, gFloor, globalBucket(r1, d)); !ok {
			t.Fatal("drain rejected")
		}
		m = create(im, 1, 1, 300, 10*time.Second)
		m.RunID = im.runID(t)
		im.marker(t, t0, r1, m)
		if l, rem := limitOf(t, im, r1, t0, d); l != 300 || rem != 0 {
			t.Fatalf("create after a store reset: limit %d remaining %d, want 300, 0", l, rem)
		}
		// a first incarnation's Create over its own lapsed marker
		r2 := rule + "-lapse"
		m = create(im, 1, 1, 300, 10*time.Second)
		m.RunID, m.Boot = im.runID(t), true
		im.marker(t, t0, r2, m)
		b := Key("b", r2)
		if ok, _ := im.check(t, t0+11_000, gFloor, globalBucket(r2, b)); !ok {
			t.Fatal("drain rejected")
		}
		m.Seq = 2
		im.marker(t, t0+11_000, r2, m)
		if l, rem := limitOf(t, im, r2, t0+11_000, b); l != 300 || rem != 0 {
			t.Fatalf("create after a lapse: limit %d remaining %d, want 300, 0", l, rem)
		}
		// a renewal that changes the default ends the boot
		r3 := rule + "-units"
		c := Key("c", r3)
		if ok, _ := im.check(t, t0, gFloor, globalBucket(r3, c)); !ok {
			t.Fatal("drain rejected")
		}
		m = create(im, 1, 1, 300, time.Minute)
		m.RunID, m.Boot = im.runID(t), true
		im.marker(t, t0, r3, m)
		im.marker(t, t0, r3, Marker{Inc: 1, Seq: 2, Units: 400, Lease: time.Minute})
		if l, rem := limitOf(t, im, r3, t0, c); l != 400 || rem != 0 {
			t.Fatalf("changed default: limit %d remaining %d, want 400, 0", l, rem)
		}
	}},
	{"create with a stale run id is refused; versions only move forward", func(t *testing.T, im impl, key func(string) string, rule string) {
		m := create(im, 1, 5, 300, time.Minute)
		m.RunID = "0123456789abcdef0123456789abcdef01234567"
		if v := im.marker(t, t0, rule, m); v != (Version{}) {
			t.Fatalf("stale create: store holds %v", v)
		}
		wantLimit(t, im, rule, t0, key("a"), gFloor)
		m.RunID = im.runID(t)
		if v := im.marker(t, t0, rule, m); v != (Version{1, 5}) {
			t.Fatalf("create: store holds %v", v)
		}
		m.Seq, m.Units = 4, 900
		if v := im.marker(t, t0, rule, m); v != (Version{1, 5}) {
			t.Fatalf("older create: store holds %v", v)
		}
		m.Seq = 5
		if v := im.marker(t, t0, rule, m); v != (Version{1, 5}) {
			t.Fatalf("equal create: store holds %v", v)
		}
		wantLimit(t, im, rule, t0, key("b"), 300)
	}},
	{"renewal of another incarnation or an older version is refused", func(t *testing.T, im impl, key func(string) string, rule string) {
		if v := im.marker(t, t0, rule, Marker{Inc: 1, Seq: 1, Units: 300, Lease: time.Minute}); v != (Version{}) {
			t.Fatalf("renewal without a marker: store holds %v", v)
		}
		m := create(im, 1, 2, 300, time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, t0, rule, m)
		for _, r := range []Marker{{Inc: 2, Seq: 3, Units: 900, Lease: time.Hour}, {Inc: 1, Seq: 1, Units: 900, Lease: time.Hour}} {
			if v := im.marker(t, t0, rule, r); v != (Version{1, 2}) {
				t.Fatalf("renewal %+v: store holds %v", r, v)
			}
		}
		wantLimit(t, im, rule, t0, key("a"), 300)
		if v := im.marker(t, t0, rule, Marker{Inc: 1, Seq: 2, Units: 500, Lease: time.Minute}); v != (Version{1, 2}) {
			t.Fatalf("equal renewal: store holds %v", v)
		}
		wantLimit(t, im, rule, t0, key("b"), 500)
	}},
	{"record versions: lower refused, equal re-applied", func(t *testing.T, im impl, key func(string) string, rule string) {
		m := create(im, 2, 1, 300, time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, t0, rule, m)
		k := key("a")
		got := im.shares(t, t0, rule, record(rule, k, 2, 5, 600), record(rule, k, 2, 4, 700), record(rule, k, 1, 9, 800))
		if want := []Version{{2, 5}, {2, 5}, {2, 5}}; got[0] != want[0] || got[1] != want[1] || got[2] != want[2] {
			t.Fatalf("versions %v, want %v", got, want)
		}
		wantLimit(t, im, rule, t0, k, 600)
		if v := im.shares(t, t0, rule, record(rule, k, 2, 5, 600)); v[0] != (Version{2, 5}) {
			t.Fatalf("re-apply: %v", v)
		}
		wantLimit(t, im, rule, t0, k, 600)
	}},
	{"a Release record gets a TTL, any other is persistent", func(t *testing.T, im impl, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, t0, rule, m)
		k := key("a")
		im.shares(t, t0, rule, record(rule, k, 1, 1, 600))
		if !im.persistent(t, t0, k) {
			t.Fatal("coordinated record has a TTL")
		}
		im.check(t, t0+10, 1, globalBucket(rule, k))
		if !im.persistent(t, t0+10, k) {
			t.Fatal("Check gave a coordinated record a TTL")
		}
		rel := record(rule, k, 1, 2, 300)
		rel.Release = true
		im.shares(t, t0+20, rule, rel)
		if im.persistent(t, t0+20, k) {
			t.Fatal("Release record is persistent")
		}
		wantLimit(t, im, rule, t0+30, k, 300)
		if im.persistent(t, t0+30, k) {
			t.Fatal("Check made a Release record persistent")
		}
		// a key without a record has the bucket's TTL
		im.check(t, t0, 1, globalBucket(rule, key("b")))
		if im.persistent(t, t0, key("b")) {
			t.Fatal("key without a record is persistent")
		}
	}},
	{"a held record with a Hold gets it as TTL; Check keeps it, a re-write renews it", func(t *testing.T, im impl, key func(string) string, rule string) {
		m := create(im, 1, 1, 300, time.Minute)
		m.RunID = im.runID(t)
		im.marker(t, t0, rule, m)
		k := key("a")
		held := record(rule, k, 1, 1, 600)
		held.Hold = time.Hour
		wantHold := func(nowMs int64, what string) {
			t.Helper()
			// Redis counts the TTL down on its own clock, not the test's
			if d := im.pttl(t, nowMs, k); d > time.Hour.Milliseconds() || d < time.Hour.Milliseconds()-5_000 {
				t.Fatalf("%s: PTTL %d ms, want the Hold (1h)", what, d)
			}
		}
		im.shares(t, t0, rule, held)
		wantHold(t0, "held record")
		im.check(t, t0+10, 1, globalBucket(rule, k))
		if d := im.pttl(t, t0+10, k); d < 0 || d > time.Hour.Milliseconds() {
			t.Fatalf("Check changed the Hold: PTTL %d", d)
		}
		wantLimit(t, im, rule, t0+20, k, 600)
		held.Hold = 2 * time.Hour
		im.shares(t, t0+30, rule, held) // the same version again: a renewal
		if d := im.pttl(t, t0+30, k); d <= time.Hour.Milliseconds() {
			t.Fatalf("re-write did not renew the Hold: PTTL %d ms", d)
		}
		// a Hold below the bucket's own TTL gives the bucket's
		short := record(rule, key("b"), 1, 2, 600)
		short.Hold = time.Millisecond
		im.shares(t, t0, rule, short)
		if d := im.pttl(t, t0, key("b")); d < 1000 {
			t.Fatalf("Hold below the bucket's TTL: PTTL %d ms, want at least 1s", d)
		}
		if im.persistent(t, t0, key("b")) {
			t.Fatal("held record with a Hold is persistent")
		}
	}},
}

func TestGlobalContract(t *testing.T) {
	forEachImpl(t, func(t *testing.T, im impl) {
		for i, tc := range globalCases {
			t.Run(tc.name, func(t *testing.T) {
				rule := fmt.Sprintf("global-%d", i)
				key := func(s string) string { return Key(s, rule) }
				tc.run(t, im, key, rule)
			})
		}
	})
}

func TestGlobalValidation(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	g := globalBucket(gRule, Key("u", "g"))
	bad := []Bucket{
		{Key: "k", Algorithm: rules.LeakyBucket, Capacity: 1, Rate: 1, Global: &Global{Rule: "g", Units: 1}},
		{Key: "k", Algorithm: rules.TokenBucket, Capacity: 1, Rate: 1, Global: &Global{Units: 1}},
		{Key: "k", Algorithm: rules.TokenBucket, Capacity: 1, Rate: 1, Global: &Global{Rule: "g", Units: 0}},
		{Key: "k", Algorithm: rules.TokenBucket, Capacity: 1, Rate: 1, Global: &Global{Rule: "g", Units: 10, Floor: 11}},
		{Key: "k", Algorithm: rules.TokenBucket, Capacity: 1, Rate: 1, Global: &Global{Rule: "g", Units: MaxUnits + 1}},
	}
	for i, b := range bad {
		if _, _, err := e.store.Check(ctx, 1, []Bucket{g, b}); !errors.Is(err, ErrInvalidBucket) {
			t.Errorf("bad[%d]: %v", i, err)
		}
	}
	badRecs := []ShareRecord{
		{Key: "", Total: 10, Capacity: 1, Rate: 1},
		{Key: "k", Total: 10, Units: 11, Capacity: 1, Rate: 1},
		{Key: "k", Total: 10, Floor: -1, Capacity: 1, Rate: 1},
		{Key: "k", Total: 10, Capacity: 0, Rate: 1},
		{Key: "k", Total: 10, Capacity: 1, Rate: 1, Inc: MaxInc + 1},
		{Key: "k", Total: 10, Capacity: 1, Rate: 1, Seq: MaxSeq + 1},
	}
	for i, r := range badRecs {
		if _, err := e.store.WriteShares(ctx, gRule, []ShareRecord{r}); !errors.Is(err, ErrInvalidShare) {
			t.Errorf("badRecs[%d]: %v", i, err)
		}
	}
	for i, m := range []Marker{{Units: -1}, {Lease: -time.Second}, {Lease: time.Microsecond}, {Create: true}, {Inc: MaxInc + 1}} {
		if _, err := e.store.WriteMarker(ctx, gRule, m); !errors.Is(err, ErrInvalidShare) {
			t.Errorf("bad marker[%d]: %v", i, err)
		}
	}
	if got := MarkerKey("a:b{c}"); got != "rl:marker:a%3Ab%7Bc%7D" {
		t.Errorf("MarkerKey = %q", got)
	}
}

// TestLegacyGlobalLayout reads the global layouts written before e (24 and
// 36 bytes, holding the capacity and rate last enforced): a check settles
// at that rate, and writes the state back in the 28-byte layout.
func TestLegacyGlobalLayout(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	e.clock.ms.Store(t0)
	run, err := e.store.RunID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.WriteMarker(ctx, gRule, Marker{Inc: 1, Seq: 1, Units: 300, Lease: time.Minute, Create: true, RunID: run}); err != nil {
		t.Fatal(err)
	}
	le := func(x int64, n int) string {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(x >> (8 * i))
		}
		return string(b)
	}
	b := globalBucket(gRule, Key("legacy", gRule))
	// Empty at t0-1000, last enforcing 600 tokens of capacity at 1 token/s
	// (not the 600 tokens/s its record now gives): a second later it holds
	// one token, not a full bucket.
	raw := le(0, 6) + le(t0-1000, 6) + le(600_000, 6) + le(1000, 6) + le(1, 3) + le(5, 5) + le(600*2, 4)
	if err := e.client.Set(ctx, b.Key, raw, 0).Err(); err != nil {
		t.Fatal(err)
	}
	ok, res, err := e.store.Check(ctx, 1, []Bucket{b})
	if err != nil || !ok || res[0].Limit != 600 || res[0].Remaining != 0 {
		t.Fatalf("legacy 36-byte state: %v %+v %v, want allowed, limit 600, nothing left", ok, res, err)
	}
	got := decodeState(t, rules.TokenBucket, e.client.Get(ctx, b.Key).Val())
	if want := map[string]int64{"t": 0, "l": t0, "e": 600, "i": 1, "s": 5, "u": 1200}; !maps.Equal(got, want) {
		t.Fatalf("rewritten state %v, want %v", got, want)
	}
	// 24 bytes: no record, the marker's default 300.
	b = globalBucket(gRule, Key("legacy24", gRule))
	if err := e.client.Set(ctx, b.Key, le(0, 6)+le(t0-1000, 6)+le(300_000, 6)+le(1000, 6), 0).Err(); err != nil {
		t.Fatal(err)
	}
	if ok, res, err := e.store.Check(ctx, 1, []Bucket{b}); err != nil || !ok || res[0].Limit != 300 || res[0].Remaining != 0 {
		t.Fatalf("legacy 24-byte state: %v %+v %v", ok, res, err)
	}
}
