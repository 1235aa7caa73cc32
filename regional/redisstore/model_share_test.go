package redisstore

import (
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
)

// TestModelEnforced: Enforced gives the units Check enforces (one token of
// capacity per unit here, so Check's Limit is the units) without a marker, with the marker's default, with a
// record, with a record of another incarnation, and after the lease.
func TestModelEnforced(t *testing.T) {
	const units, floor = 1000, 100
	g := Global{Rule: "r", Units: units, Floor: floor}
	m := NewModel(0)
	check := func(ms int64, key string, want int64, what string) {
		t.Helper()
		if got := m.Enforced(ms, key, g); got != want {
			t.Errorf("%s: Enforced = %d, want %d", what, got, want)
		}
		_, res, err := m.Check(ms, 1, []Bucket{{Key: key, Algorithm: rules.TokenBucket, Capacity: units * 1000, Rate: units * 1000, Global: &g}})
		if err != nil {
			t.Fatal(err)
		}
		if res[0].Limit != want {
			t.Errorf("%s: Check enforces %d units, Enforced said %d", what, res[0].Limit, want)
		}
	}
	check(0, "k1", floor, "no marker")
	if _, err := m.WriteMarker(0, "r", Marker{Inc: 2, Seq: 1, Units: 400, Lease: time.Second, Create: true, RunID: m.RunID()}); err != nil {
		t.Fatal(err)
	}
	check(10, "k1", 400, "marker default")
	rec := ShareRecord{Key: "k2", Inc: 2, Seq: 2, Units: 700, Capacity: units * 1000, Rate: units * 1000, Total: units, Floor: floor}
	if _, err := m.WriteShares(20, "r", []ShareRecord{rec}); err != nil {
		t.Fatal(err)
	}
	check(30, "k2", 700, "record")
	rec.Key, rec.Inc = "k3", 1
	if _, err := m.WriteShares(40, "r", []ShareRecord{rec}); err != nil {
		t.Fatal(err)
	}
	check(50, "k3", floor, "record of another incarnation")
	check(1000, "k2", floor, "lease over")
}
