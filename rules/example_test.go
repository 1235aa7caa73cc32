package rules_test

import (
	"fmt"

	"github.com/apportion/apportion/rules"
)

func ExampleParseRules() {
	rs, err := rules.ParseRules([]byte(`
- id: orders-free
  match: {resource: "POST /orders", tier: free}
  algorithm: token_bucket
  capacity: 20
  refill_per_second: 10
  scope: global
  regions: {us-east: 2, eu-west: 1, ap-south: 1}
  min_share: 0.1
- id: orders-hourly
  match: {resource: "POST /orders"}
  algorithm: sliding_window
  limit: 1000
  window: 1h
`))
	if err != nil {
		fmt.Println(err)
		return
	}
	share, _ := rs[0].StaticShare("us-east")
	fmt.Println(len(rs), rs[0].Scope, share, rs[1].Window)

	_, err = rules.ParseRules([]byte("- id: bad\n  algorithm: token_bucket\n  capacity: -5\n  refill_per_second: 1\n"))
	fmt.Println(err)
	// Output:
	// 2 global 0.5 1h
	// rules: rule "bad" (item 1): capacity: must be at least 1, got -5 (negative)
}

func ExampleIndex_Match() {
	rs, _ := rules.ParseRules([]byte(`[
	  {"id": "orders-free", "match": {"resource": "POST /orders", "tier": "free"},
	   "algorithm": "token_bucket", "capacity": 20, "refill_per_second": 10},
	  {"id": "per-ip", "match": {"ip": "*"}, "key": ["ip"],
	   "algorithm": "fixed_window", "limit": 100, "window": "1s"}]`))
	ix, _ := rules.NewIndex(rs)
	attrs := map[string]string{"tier": "free", "ip": "10.0.0.1"}
	for _, r := range ix.Match("POST /orders", attrs) {
		parts, _ := r.KeyValues("user:42", "POST /orders", attrs)
		fmt.Println(r.ID, parts)
	}
	// Output:
	// orders-free [user:42]
	// per-ip [10.0.0.1]
}
