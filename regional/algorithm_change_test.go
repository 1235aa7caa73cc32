package regional

import (
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
)

// ruleOf is a rule r of algorithm a admitting 5 per long period (a bucket of
// 5 refilling 1 per 1000 s, or 5 per hour), matching resource "GET /a".
func ruleOf(id string, a rules.Algorithm) rules.Rule {
	r := rules.Rule{ID: id, Match: map[string]string{"resource": "GET /a"}, Algorithm: a}
	switch a {
	case rules.TokenBucket, rules.LeakyBucket:
		r.Capacity, r.RefillPerSecond = 5, 0.001
	default:
		r.Limit, r.Window = 5, rules.Duration(time.Hour)
	}
	return r
}

// TestAlgorithmChangeStartsKeysAfresh: a live rule whose algorithm changes
// (every one of the 20 transitions) answers its keys from Redis, within the
// new algorithm's bound. Each algorithm keeps its own state layout, and the
// new script read the old key's state: refused as a bad state (15 of the 20
// transitions), every check of a key used before the change was answered
// by the failure policy, fail_open, until the key expired (an hour for a
// token bucket); misread (the others), it admitted at random. The change
// starts the rule's keys afresh: at most one bound more per key.
func TestAlgorithmChangeStartsKeysAfresh(t *testing.T) {
	all := []rules.Algorithm{rules.TokenBucket, rules.LeakyBucket, rules.FixedWindow, rules.SlidingWindow, rules.SlidingLog}
	e := newEnv(t, []rules.Rule{ruleOf("r", rules.TokenBucket)}, nil)
	for _, from := range all {
		for _, to := range all {
			if from == to {
				continue
			}
			key := fmt.Sprintf("%s-%s", from, to)
			set := func(a rules.Algorithm) {
				r := ruleOf("r", a)
				r.Normalize()
				if err := e.enf.SetRules([]rules.Rule{r}); err != nil {
					t.Fatal(err)
				}
			}
			set(from)
			for range 3 {
				e.check(t, key, "GET /a", 1)
			}
			set(to)
			allowed := 0
			for i := range 8 {
				resp := e.check(t, key, "GET /a", 1)
				if resp.FailOpen {
					t.Fatalf("%s to %s, check %d: answered by the failure policy (fail_open), want an answer from Redis", from, to, i+1)
				}
				if resp.Allowed {
					allowed++
				}
			}
			// Afresh: the new algorithm's whole bound (a leaky bucket
			// admits its capacity at once too), never more.
			if allowed != 5 {
				t.Errorf("%s to %s: %d of 8 admitted after the change, want 5 (a fresh key of the new algorithm)", from, to, allowed)
			}
		}
	}
}
