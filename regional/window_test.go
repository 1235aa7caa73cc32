package regional

import (
	"context"
	"testing"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
)

// A global fixed window (a daily quota) is sent to the store as a global
// bucket: the region's floor share of the day's limit without an agent
// marker, the marker's units once there is one.
func TestGlobalWindowFloorThenAgentShare(t *testing.T) {
	g := rules.Rule{ID: "daily", Algorithm: rules.FixedWindow, Limit: 100, Window: rules.Duration(24 * time.Hour),
		Scope: rules.Global, Regions: map[string]float64{"us-east": 2, "eu-west": 1, "ap-south": 1}, MinShare: 0.1}
	e := newEnv(t, []rules.Rule{g}, nil)
	count := func(key string, n int) (allowed int, limit int64) {
		for i := 0; i < n; i++ {
			r := e.check(t, key, "GET /", 1)
			if r.Allowed {
				allowed++
			}
			limit = r.Limit
		}
		return allowed, limit
	}
	// Floor of us-east: 10% of the limit x weight 2/4 = 5 of the day's 100.
	if a, l := count("a", 8); a != 5 || l != 5 {
		t.Fatalf("without an agent marker: %d of 8 allowed (limit %d), want the floor of 5", a, l)
	}
	ctx := context.Background()
	run, err := e.store.RunID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.WriteMarker(ctx, g.ID, redisstore.Marker{Inc: 1, Seq: 1, Units: 500000, Lease: time.Minute, Create: true, RunID: run}); err != nil {
		t.Fatal(err)
	}
	if a, l := count("b", 60); a != 50 || l != 50 {
		t.Fatalf("with the agent's marker: %d of 60 allowed (limit %d), want 50", a, l)
	}
}
