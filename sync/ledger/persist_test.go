package ledger

import (
	"encoding/json"
	"fmt"
	"math/rand"
	"reflect"
	"testing"
)

// TestRegistryStateRoundTrip drives a registry with random starts and
// contributions; after every step its state goes through JSON into a
// restored registry, and both must answer every later call identically.
func TestRegistryStateRoundTrip(t *testing.T) {
	cfg := DefaultConfig()
	spec := []RegionSpec{{"a", 1}, {"b", 2}, {"c", 1}}
	names := []string{"a", "b", "c"}
	for seed := int64(0); seed < 50; seed++ {
		rng := rand.New(rand.NewSource(seed))
		orig, err := NewRegistry(cfg, spec)
		if err != nil {
			t.Fatal(err)
		}
		cur := map[string]uint64{}
		for step := 0; step < 40; step++ {
			b, err := json.Marshal(orig.State())
			if err != nil {
				t.Fatal(err)
			}
			var st RegistryState
			if err := json.Unmarshal(b, &st); err != nil {
				t.Fatal(err)
			}
			rest, err := RestoreRegistry(cfg, spec, st)
			if err != nil {
				t.Fatalf("seed %d step %d: restore: %v", seed, step, err)
			}
			if !reflect.DeepEqual(rest.Records(), orig.Records()) {
				t.Fatalf("seed %d step %d: records differ after restore", seed, step)
			}
			switch n := names[rng.Intn(3)]; {
			case cur[n] > 1 && rng.Intn(6) == 0:
				by := Incarnation{n, cur[n]}
				e1, e2 := orig.Close(by), rest.Close(by)
				if fmt.Sprint(e1) != fmt.Sprint(e2) || !reflect.DeepEqual(orig.Records(), rest.Records()) {
					t.Fatalf("seed %d step %d: Close differs: %v / %v", seed, step, e1, e2)
				}
			case rng.Intn(4) == 0 || cur[n] == 0:
				s1, e1 := orig.Start(n)
				s2, e2 := rest.Start(n)
				if !reflect.DeepEqual(s1, s2) || fmt.Sprint(e1) != fmt.Sprint(e2) {
					t.Fatalf("seed %d step %d: Start differs: %v %v / %v %v", seed, step, s1, e1, s2, e2)
				}
				cur[n] = s1.Inc
			default:
				of := names[rng.Intn(3)]
				if of == n || cur[of] == 0 {
					continue
				}
				c := Contribution{Of: Incarnation{of, uint64(rng.Intn(int(cur[of]))) + 1}, From: Incarnation{n, cur[n]}}
				if rng.Intn(2) == 0 {
					c.Q = []KeyUnits{{"k", rng.Int63n(200) - 100}}
				}
				r1, e1 := orig.Contribute(c)
				r2, e2 := rest.Contribute(c)
				if !reflect.DeepEqual(r1, r2) || fmt.Sprint(e1) != fmt.Sprint(e2) {
					t.Fatalf("seed %d step %d: Contribute differs:\n%+v %v\n%+v %v", seed, step, r1, e1, r2, e2)
				}
			}
			orig = rest // continue from the restored copy
		}
	}
}

func TestRestoreRegistryRejectsBadState(t *testing.T) {
	cfg := DefaultConfig()
	spec := []RegionSpec{{"a", 1}, {"b", 1}}
	for name, st := range map[string]RegistryState{
		"unknown region":          {Clock: 1, Lives: []LifeState{{Region: "x", Inc: 1, Start: 1}}},
		"start after clock":       {Clock: 1, Lives: []LifeState{{Region: "a", Inc: 1, Start: 2}}},
		"complete without record": {Clock: 1, Records: []RecordState{{Of: Incarnation{"a", 1}, Complete: true}}},
		"foreign contribution": {Clock: 1, Records: []RecordState{{Of: Incarnation{"a", 1},
			Contributions: []Contribution{{Of: Incarnation{"b", 1}, From: Incarnation{"a", 1}}}}}},
		"life below the watermark":       {Clock: 1, Done: []Incarnation{{"a", 2}}, Lives: []LifeState{{Region: "a", Inc: 2, Start: 1}}},
		"watermark of an unknown region": {Clock: 1, Done: []Incarnation{{"x", 2}}},
		"payment to an unknown region":   {Clock: 1, Paid: []AccountState{{Of: Incarnation{"x", 1}, Base: 5}}},
		"kept twice":                     {Clock: 1, Kept: []AccountState{{Of: Incarnation{"a", 1}}, {Of: Incarnation{"a", 1}}}},
	} {
		if _, err := RestoreRegistry(cfg, spec, st); err == nil {
			t.Errorf("%s: restored", name)
		}
	}
}
