package regional

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
)

// A global rule that does not list this region (a wrong --region, or a
// region not yet in the rule's split) admits nothing here, whatever its
// failure_mode: its whole limit belongs to the regions it lists, and
// admitting would put this region's traffic on top of it. Until 6
// December 2026 such a rule was skipped, so every check it matched was
// admitted (an explorer's fourth region, 60/s each: 154-162/s in all
// against a global 100/s). The check is answered without the store (no
// key written, no usage reported), a regional rule matched with it is not
// consumed, a shadow rule not listing the region changes nothing, and the
// rule is counted in apportion_rules_unlisted, not apportion_rules_loaded.
func TestGlobalRuleNotListingTheRegion(t *testing.T) {
	g := tokenBucket("g", 100, 100)
	g.Scope, g.FailureMode = rules.Global, rules.FailOpen
	g.Regions = map[string]float64{"eu-west": 1, "ap-south": 1}
	g.MinShare = 0.1
	g.Match = map[string]string{"resource": "GET /g"}
	sh := g
	sh.ID, sh.Shadow, sh.Match = "g-shadow", true, map[string]string{"resource": "GET /r"}
	reg := tokenBucket("r", 3, 0.001)
	reg.Match = map[string]string{"resource": "GET /g"}
	reg2 := tokenBucket("r2", 3, 0.001)
	reg2.Match = map[string]string{"resource": "GET /r"}
	var usage atomic.Int64
	e := newEnv(t, []rules.Rule{g, sh, reg, reg2}, func(c *Config) {
		c.Usage = func(rule, key string, admitted, rejected int64) { usage.Add(1) }
	})
	for i := range 5 {
		resp := e.check(t, "k", "GET /g", 1)
		if resp.Allowed || resp.FailOpen || resp.RuleId != "g" || resp.Limit != 0 || resp.RetryAfterMs != -1 {
			t.Fatalf("check %d of a global rule not listing us-east: %+v, want rejected by g, limit 0, retry -1, not fail-open", i, resp)
		}
	}
	ctx := context.Background()
	for _, id := range []string{"g", "r"} {
		if n := e.rc.Exists(ctx, redisstore.Key("k", id)).Val(); n != 0 {
			t.Errorf("key of rule %s written: the check must not reach the store", id)
		}
	}
	if n := usage.Load(); n != 0 {
		t.Errorf("%d usage reports for a rule with no share here, want 0", n)
	}
	// The shadow rule not listing the region: r2 decides, as if alone.
	for i := range 4 {
		if resp := e.check(t, "k", "GET /r", 1); resp.Allowed != (i < 3) || resp.RuleId != "r2" {
			t.Fatalf("check %d of GET /r: %+v, want r2's bucket of 3 to decide", i, resp)
		}
	}
	if v := gaugeValue(t, e.registry, MetricRulesUnlisted, nil); v != 2 {
		t.Errorf("%s = %v, want 2", MetricRulesUnlisted, v)
	}
	if v := gaugeValue(t, e.registry, MetricRulesLoaded, nil); v != 2 {
		t.Errorf("%s = %v, want 2 (r and r2)", MetricRulesLoaded, v)
	}
}
