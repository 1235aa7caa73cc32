package redisstore

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// The store on an embedded miniredis (what rlstack uses when redis-server is
// not installed): miniredis runs the scripts in gopher-lua, which has no
// struct library (the scripts then pack state in plain Lua), and answers
// that INFO server is not supported (the run id is then EmbeddedRunID).
//
// Both contract suites run in full, twice: with the store's clock
// (WithClock, as the redis-server runs do) and with miniredis's own clock
// (no WithClock: the scripts read TIME, which miniredis answers from
// SetTime; ClockTTL makes TTLs follow that clock, as rlstack should with the
// wall clock, since miniredis does not otherwise expire keys). What
// miniredis cannot do is left to the redis-server tests: MEMORY USAGE
// (miniredis estimates Go memory, not Redis's, so TestMemoryUsage's bounds
// mean nothing there) and real restarts (Restart keeps the data and the run
// id is fixed, so the restart steps of TestScriptFlush and
// TestDifferentialGlobal have no counterpart; an embedded server's data
// dies with its process).

// newMiniEnv starts a miniredis and a Store on it; with the fake clock
// unless serverTime is set (then mr's clock is the caller's to set).
func newMiniEnv(tb testing.TB, serverTime bool, opts ...Option) (*env, *miniredis.Miniredis) {
	tb.Helper()
	mr := miniredis.RunT(tb)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	tb.Cleanup(func() { client.Close() })
	e := &env{client: client, clock: &fakeClock{}}
	if serverTime {
		mr.SetTime(time.UnixMilli(t0))
		mr.ClockTTL(true)
	} else {
		opts = append([]Option{WithClock(e.clock.now)}, opts...)
	}
	s, err := New(client, opts...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { s.Close() })
	e.store = s
	return e, mr
}

// miniTimeImpl runs the store on miniredis's TIME: each call first sets
// miniredis's clock to the step's time.
type miniTimeImpl struct {
	redisImpl
	mr *miniredis.Miniredis
}

func (mi miniTimeImpl) check(tb testing.TB, nowMs, cost int64, buckets ...Bucket) (bool, []Result) {
	tb.Helper()
	mi.mr.SetTime(time.UnixMilli(nowMs))
	return mi.redisImpl.check(tb, nowMs, cost, buckets...)
}

func (mi miniTimeImpl) marker(tb testing.TB, nowMs int64, rule string, m Marker) Version {
	tb.Helper()
	mi.mr.SetTime(time.UnixMilli(nowMs))
	return mi.redisImpl.marker(tb, nowMs, rule, m)
}

func (mi miniTimeImpl) shares(tb testing.TB, nowMs int64, rule string, recs ...ShareRecord) []Version {
	tb.Helper()
	mi.mr.SetTime(time.UnixMilli(nowMs))
	return mi.redisImpl.shares(tb, nowMs, rule, recs...)
}

func forEachMiniImpl(t *testing.T, f func(t *testing.T, im impl)) {
	t.Run("miniredis/WithClock", func(t *testing.T) {
		e, _ := newMiniEnv(t, false)
		f(t, redisImpl{e})
	})
	t.Run("miniredis/TIME", func(t *testing.T) {
		e, mr := newMiniEnv(t, true)
		f(t, miniTimeImpl{redisImpl{e}, mr})
	})
}

func TestContractMiniredis(t *testing.T) {
	forEachMiniImpl(t, func(t *testing.T, im impl) {
		for i, tc := range contractCases {
			t.Run(tc.name, func(t *testing.T) {
				key := func(s string) string { return Key("case"+string(rune('a'+i)), s) }
				tc.run(t, im, key)
			})
		}
	})
}

func TestGlobalContractMiniredis(t *testing.T) {
	forEachMiniImpl(t, func(t *testing.T, im impl) {
		for i, tc := range globalCases {
			t.Run(tc.name, func(t *testing.T) {
				rule := fmt.Sprintf("global-%d", i)
				key := func(s string) string { return Key(s, rule) }
				tc.run(t, im, key, rule)
			})
		}
	})
}

// TestMiniredisState: the plain-Lua packing stores exactly the layout of
// the package doc (read back with the differential test's decoder), the
// marker included, and a script reload after SCRIPT FLUSH works there too.
func TestMiniredisState(t *testing.T) {
	e, _ := newMiniEnv(t, false)
	ctx := ctxT(t)
	now := int64(1)<<47 + 12345 // high bytes in use
	e.clock.ms.Store(now)
	b := globalBucket(gRule, Key("u", gRule))
	if v, err := e.store.WriteMarker(ctx, gRule, Marker{Inc: 3, Seq: 1<<40 - 1, Units: 700, Lease: time.Minute, Create: true, RunID: EmbeddedRunID}); err != nil || v != (Version{3, 1<<40 - 1}) {
		t.Fatalf("create marker: %v %v", v, err)
	}
	if _, err := e.store.WriteShares(ctx, gRule, []ShareRecord{{Key: b.Key, Inc: 3, Seq: 1<<40 - 1, Units: 600, Release: true, Capacity: gCap, Rate: gRate, Total: gUnits, Floor: gFloor}}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if _, _, err := e.store.Check(ctx, 5, []Bucket{b}); err != nil {
			t.Fatal(err)
		}
		if err := e.client.ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	got := decodeState(t, b.Algorithm, e.client.Get(ctx, b.Key).Val())
	want := map[string]int64{"t": 590_000_000, "l": now, "e": 600, "i": 3, "s": 1<<40 - 1, "u": 600*2 + 1}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("state %v, want %v", got, want)
	}
	raw := e.client.Get(ctx, MarkerKey(gRule)).Val()
	if len(raw) != 30+len(EmbeddedRunID) || raw[30:] != EmbeddedRunID {
		t.Fatalf("marker %q: want 30 bytes and the run id %q", raw, EmbeddedRunID)
	}
	if loads := e.store.ScriptLoads(); loads != 4 {
		t.Fatalf("ScriptLoads %d, want 4 (three scripts, then check again after a flush)", loads)
	}
}

// TestRunIDEmbedded: a server that answers that INFO server is not
// supported has the run id EmbeddedRunID; any other error is an error.
func TestRunIDEmbedded(t *testing.T) {
	e, mr := newMiniEnv(t, false)
	ctx := ctxT(t)
	id, err := e.store.RunID(ctx)
	if err != nil || id != EmbeddedRunID {
		t.Fatalf("RunID = %q, %v; want %q", id, err, EmbeddedRunID)
	}
	mr.SetError("LOADING Redis is loading the dataset in memory")
	if id, err := e.store.RunID(ctx); err == nil {
		t.Fatalf("RunID = %q on a server error, want the error", id)
	}
	mr.SetError("")
	mr.Close()
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if id, err := e.store.RunID(short); err == nil {
		t.Fatalf("RunID = %q with the server gone, want the error", id)
	}
}

// TestPackMatchesStruct holds the plain-Lua packing to Redis's struct
// library byte for byte, in real Redis: random values of every width the
// layouts use (near 0, near the top of the width, anywhere), packed both
// ways and read back both ways.
func TestPackMatchesStruct(t *testing.T) {
	pure := strings.Replace(prelude, "rawget(_G, 'struct')", "nil", 1)
	if pure == prelude {
		t.Fatal("prelude no longer selects struct with rawget(_G, 'struct')")
	}
	// ARGV: pairs of width, value. Reply: plain-Lua bytes, struct bytes, the
	// struct bytes read back in plain Lua, then read back by struct.
	src := pure + `
local struct = rawget(_G, 'struct')
local n, vals, f = 0, {}, '<'
for k = 1, #ARGV, 2 do
  n = n + 1
  vals[n] = tonumber(ARGV[k + 1])
  f = f .. 'I' .. ARGV[k]
end
local ref = struct.pack(f, unpack(vals))
local out = {packle(f, unpack(vals)), ref}
local mine = {unpackle(f, ref)}
for k = 1, n do out[#out + 1] = mine[k] end
local back = {struct.unpack(f, ref)}
for k = 1, n do out[#out + 1] = back[k] end
if mine[n + 1] ~= back[n + 1] then return redis.error_reply('next position ' .. tostring(mine[n + 1]) .. ', struct ' .. tostring(back[n + 1])) end
return out
`
	e := newEnv(t, false)
	ctx := ctxT(t)
	r := rand.New(rand.NewPCG(5, 6))
	layouts := [][]int{{6, 6}, {6, 6, 4}, {6, 6, 6}, {6, 6, 6, 6}, {6, 6, 6, 6, 6}, {6, 6, 4, 3, 5, 4}, {6, 6, 3, 5, 4}, {6, 5, 5, 3, 5, 4}, {6, 6, 6, 3, 5, 4}, {6, 6, 6, 6, 3, 5, 4}}
	for i := 0; i < 500; i++ {
		ws := layouts[r.IntN(len(layouts))]
		var args []any
		var want []byte
		vals := make([]int64, len(ws))
		for k, w := range ws {
			top := int64(1) << (8 * w)
			switch r.IntN(3) {
			case 0:
				vals[k] = r.Int64N(300)
			case 1:
				vals[k] = top - 1 - r.Int64N(300)
			default:
				vals[k] = r.Int64N(top)
			}
			args = append(args, w, vals[k])
			for j := 0; j < w; j++ {
				want = append(want, byte(vals[k]>>(8*j)))
			}
		}
		v, err := e.client.Eval(ctx, src, nil, args...).Slice()
		if err != nil {
			t.Fatal(err)
		}
		if v[0] != string(want) || v[1] != string(want) {
			t.Fatalf("widths %v values %v: plain Lua %x, struct %x, want %x", ws, vals, v[0], v[1], want)
		}
		for k := range ws {
			if v[2+k] != vals[k] || v[2+len(ws)+k] != vals[k] {
				t.Fatalf("widths %v values %v: read back %v", ws, vals, v[2:])
			}
		}
	}
}
