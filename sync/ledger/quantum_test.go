package ledger

import (
	"testing"
	"time"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
)

// TestQuantumAdmitsAToken: a region that holds exactly one Quantum of a
// limit of 1 to WholeTokensUpTo tokens admits a request of one token, as
// the store enforces it (the store's reference model: a global token
// bucket and a global fixed window under a marker of that many units), and
// units/Quantum regions can each hold one. With units/capacity rounded
// down, a capacity that does not divide the units (3 of 1,000,000) left a
// region 0.999 of a token: in a 3/s scenario over four regions (burst 3,
// even demand) the ledger admitted 18% of the ideal, 47% rounded up.
func TestQuantumAdmitsAToken(t *testing.T) {
	const units = allocation.DefaultUnits
	g := redisstore.Global{Rule: "r", Units: units}
	// admits reports whether a region holding u units (its marker's
	// default) admits one request of b in a fresh store.
	admits := func(u int64, b redisstore.Bucket) bool {
		t.Helper()
		m := redisstore.NewModel(0)
		if _, err := m.WriteMarker(0, "r", redisstore.Marker{Inc: 1, Seq: 1, Units: u, Lease: time.Minute, Create: true, RunID: m.RunID()}); err != nil {
			t.Fatal(err)
		}
		ok, _, err := m.Check(1, 1, []redisstore.Bucket{b})
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	for c := int64(1); c <= WholeTokensUpTo; c++ {
		q := QuantumOf(units, float64(c))
		if q <= 0 || q > units {
			t.Fatalf("capacity %d: Quantum %d outside (0, %d]", c, q, units)
		}
		// Rounded up, one token fewer than the capacity may be held whole
		// when the capacity does not divide the units, none when it does.
		if holders, want := units/q, c-min(units%c, 1); holders < want {
			t.Errorf("capacity %d: %d regions can hold a whole token, want %d", c, holders, want)
		}
		for _, b := range []redisstore.Bucket{
			{Key: "tb", Algorithm: rules.TokenBucket, Capacity: c * 1000, Rate: c * 1000, Global: &g},
			{Key: "fw", Algorithm: rules.FixedWindow, Limit: c, Window: time.Minute, Global: &g},
		} {
			if !admits(q, b) {
				t.Errorf("capacity %d, %s: one Quantum (%d units) admits no request", c, b.Algorithm, q)
			}
		}
	}
	// The rounding it replaces: at 3, a region of 333,333 units admits nothing.
	if admits(units/3, redisstore.Bucket{Key: "tb", Algorithm: rules.TokenBucket, Capacity: 3000, Rate: 3000, Global: &g}) {
		t.Errorf("%d units of a capacity of 3 admitted a token: the store rounds up, and this test no longer shows the case", units/3)
	}
}
