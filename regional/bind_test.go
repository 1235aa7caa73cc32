package regional

import (
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
)

// A rejection that waiting cannot help (retry_after_ms -1) binds over one
// that a wait would pass: before, -1 ranked as the shortest wait, so the
// answer named the other rule and told the client to retry in 3 s, and
// the retry was rejected by the first for good (an explorer's report).
func TestBindNeverOverAWait(t *testing.T) {
	a := tokenBucket("multi-a", 10, 1)
	a.Match = map[string]string{"resource": "multi"}
	b := rules.Rule{ID: "multi-b", Algorithm: rules.FixedWindow, Limit: 3, Window: rules.Duration(10 * time.Second),
		Match: map[string]string{"resource": "multi", "tier": "free"}}
	e := newEnv(t, []rules.Rule{a, b}, nil)
	if r := e.check(t, "k", "multi", 8); !r.Allowed {
		t.Fatalf("first check: %+v", r)
	}
	r := e.checkAttrs(t, "k", "multi", 5, map[string]string{"tier": "free"})
	if r.Allowed || r.RuleId != "multi-b" || r.RetryAfterMs != -1 {
		t.Fatalf("cost 5 against a window of 3 (never) and a bucket 3 s short (a wait): %+v, want multi-b binding with retry_after_ms -1", r)
	}
}

// split on a standalone Redis picks a sub-bucket whatever else matched: a
// shadow rule matching too no longer held the key to sub-bucket 0 (1/k of
// its limit: 2 of a capacity of 8 in an explorer's burst).
func TestSplitWithAShadowRule(t *testing.T) {
	hot := tokenBucket("hot", 8, 0.004)
	hot.Split = 4
	sh := tokenBucket("watch", 1000, 1000)
	sh.Shadow = true
	e := newEnv(t, []rules.Rule{hot, sh}, nil)
	admitted := 0
	for range 40 {
		if e.check(t, "tenant", "GET /", 1).Allowed {
			admitted++
		}
	}
	if admitted <= 2 || admitted > 8 {
		t.Fatalf("40 checks of a split-4 bucket of 8 with a shadow rule matching too: %d admitted, want 3..8 (2: held to one sub-bucket)", admitted)
	}
}
