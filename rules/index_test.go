package rules

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
)

func tb(id string, match map[string]string) Rule {
	return Rule{ID: id, Match: match, Algorithm: TokenBucket, Capacity: 10, RefillPerSecond: 1}
}

func TestIndexMatch(t *testing.T) {
	ix, err := NewIndex([]Rule{
		tb("z-all", nil),
		tb("orders", map[string]string{"resource": "POST /orders"}),
		tb("orders-free", map[string]string{"resource": "POST /orders", "tier": "free"}),
		tb("orders-free-2", map[string]string{"resource": "POST /orders", "tier": "free"}),
		tb("orders-any-tier", map[string]string{"resource": "POST /orders", "tier": "*"}),
		tb("any-resource", map[string]string{"resource": "*"}),
		tb("free", map[string]string{"tier": "free"}),
		tb("api-key", map[string]string{"api_key": "*", "tier": "pro"}),
	})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		resource string
		attrs    map[string]string
		want     string
	}{
		{"nothing but catch-all", "", nil, "z-all"},
		{"resource only", "POST /orders", nil, "any-resource orders z-all"},
		{"resource and tier", "POST /orders", map[string]string{"tier": "free"}, "any-resource free orders orders-any-tier orders-free orders-free-2 z-all"},
		{"other tier", "POST /orders", map[string]string{"tier": "pro"}, "any-resource orders orders-any-tier z-all"},
		{"empty tier is present", "POST /orders", map[string]string{"tier": ""}, "any-resource orders orders-any-tier z-all"},
		{"other resource", "GET /items", map[string]string{"tier": "free"}, "any-resource free z-all"},
		{"wildcard attr present", "", map[string]string{"tier": "pro", "api_key": "k1"}, "api-key z-all"},
		{"wildcard attr missing", "", map[string]string{"tier": "pro"}, "z-all"},
		{"case matters", "post /orders", nil, "any-resource z-all"},
		{"resource is not an attribute", "", map[string]string{"resource": "POST /orders"}, "z-all"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var ids []string
			for _, r := range ix.Match(tt.resource, tt.attrs) {
				ids = append(ids, r.ID)
			}
			if got := strings.Join(ids, " "); got != tt.want {
				t.Fatalf("Match = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestIndexBuild(t *testing.T) {
	t.Run("duplicate id", func(t *testing.T) {
		_, err := NewIndex([]Rule{tb("a", nil), tb("b", nil), tb("a", nil)})
		if err == nil || !strings.Contains(err.Error(), "duplicate id") {
			t.Fatalf("NewIndex = %v, want a duplicate id error", err)
		}
	})
	t.Run("invalid rule", func(t *testing.T) {
		_, err := NewIndex([]Rule{{ID: "a", Algorithm: TokenBucket}})
		if err == nil || !strings.Contains(err.Error(), "capacity") {
			t.Fatalf("NewIndex = %v, want a capacity error", err)
		}
	})
	t.Run("empty", func(t *testing.T) {
		ix, err := NewIndex(nil)
		if err != nil || ix.Len() != 0 || ix.Match("x", nil) != nil {
			t.Fatalf("empty index: %v", err)
		}
		var nilIx *Index
		if nilIx.Match("x", nil) != nil || nilIx.Len() != 0 {
			t.Fatal("nil index matched")
		}
	})
	t.Run("rules get len, isolated from input", func(t *testing.T) {
		in := []Rule{tb("b", map[string]string{"tier": "free"}), tb("a", nil)}
		ix, err := NewIndex(in)
		if err != nil {
			t.Fatal(err)
		}
		in[0].Match["tier"] = "pro" // must not affect the index
		if got := ix.Match("", map[string]string{"tier": "free"}); len(got) != 2 {
			t.Fatalf("Match after changing the input = %d rules, want 2", len(got))
		}
		if ix.Len() != 2 {
			t.Fatalf("Len = %d", ix.Len())
		}
		rs := ix.Rules()
		if rs[0].ID != "a" || rs[1].ID != "b" || rs[0].Scope != Regional {
			t.Fatalf("Rules = %+v, want normalized, in id order", rs)
		}
		rs[1].Match["tier"] = "pro" // a copy
		r, ok := ix.Get("b")
		if !ok || r.Match["tier"] != "free" {
			t.Fatalf("Get(b) = %+v, %v", r, ok)
		}
		if _, ok := ix.Get("c"); ok {
			t.Fatal("Get(c) found a rule")
		}
	})
}

// TestIndexMatchesBruteForce checks the index against a direct reading of the
// matching rule over many rules, shapes and requests.
func TestIndexMatchesBruteForce(t *testing.T) {
	rs := benchRules(600)
	ix, err := NewIndex(rs)
	if err != nil {
		t.Fatal(err)
	}
	all := ix.Rules()
	for i := range 300 {
		res := fmt.Sprintf("GET /r%d", i%50)
		attrs := map[string]string{"tier": []string{"free", "pro", "x"}[i%3]}
		if i%4 == 0 {
			attrs["api_key"] = "k"
		}
		if i%7 == 0 {
			delete(attrs, "tier")
		}
		sameAsBruteForce(t, ix, all, i, res, attrs)
	}
}

// sameAsBruteForce fails t unless ix.Match finds, in id order, exactly the
// rules of all that match request i.
func sameAsBruteForce(t *testing.T, ix *Index, all []Rule, i int, res string, attrs map[string]string) {
	t.Helper()
	var want []string
	for _, r := range all {
		if matches(r, res, attrs) {
			want = append(want, r.ID)
		}
	}
	var got []string
	for _, r := range ix.Match(res, attrs) {
		got = append(got, r.ID)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("request %d (%q %v): Match = %q, want %q", i, res, attrs, got, want)
	}
}

func matches(r Rule, resource string, attrs map[string]string) bool {
	for k, want := range r.Match {
		v, ok := attrs[k]
		if k == "resource" {
			v, ok = resource, resource != ""
		}
		if !ok || want != "*" && v != want {
			return false
		}
	}
	return true
}

// benchRules makes n rules over a fixed set of shapes, so that a lookup's
// cost depends on the shapes only.
func benchRules(n int) []Rule {
	rs := make([]Rule, 0, n)
	for i := range n {
		var m map[string]string
		res := fmt.Sprintf("GET /r%d", i/5)
		switch i % 5 {
		case 0:
			m = map[string]string{"resource": res}
		case 1:
			m = map[string]string{"resource": res, "tier": "free"}
		case 2:
			m = map[string]string{"resource": res, "tier": "pro"}
		case 3:
			m = map[string]string{"resource": res, "api_key": "*"}
		case 4:
			m = map[string]string{"tier": fmt.Sprintf("t%d", i)}
		}
		rs = append(rs, tb(fmt.Sprintf("rule-%06d", i), m))
	}
	return rs
}

func BenchmarkMatch(b *testing.B) {
	for _, n := range []int{10, 1000, 10000} {
		b.Run(fmt.Sprintf("rules=%d", n), func(b *testing.B) {
			ix, err := NewIndex(benchRules(n))
			if err != nil {
				b.Fatal(err)
			}
			attrs := map[string]string{"tier": "free", "api_key": "k", "ip": "10.0.0.1"}
			if got := len(ix.Match("GET /r1", attrs)); got != 3 {
				b.Fatalf("Match found %d rules, want 3", got)
			}
			b.ReportAllocs()
			for b.Loop() {
				ix.Match("GET /r1", attrs)
			}
		})
	}
}

// manyKeyRules makes n rules, most keyed on an attribute name of their
// own (a tenant's), with some over shared keys, wildcards, the resource
// and one with an empty match: more than manyKeys keys in all.
func manyKeyRules(n int) []Rule {
	rs := make([]Rule, 0, n)
	for i := range n {
		var m map[string]string
		switch i % 6 {
		case 0:
			m = map[string]string{fmt.Sprintf("attr_%d", i): "v"}
		case 1:
			m = map[string]string{"resource": fmt.Sprintf("GET /r%d", i%7), fmt.Sprintf("attr_%d", i-1): "*"}
		case 2:
			m = map[string]string{"tier": "free", fmt.Sprintf("attr_%d", i%12): "v"}
		case 3:
			m = map[string]string{"resource": "*", "tier": "*"}
		case 4:
			m = map[string]string{"tier": fmt.Sprintf("t%d", i%5)}
		case 5:
			m = map[string]string{"resource": fmt.Sprintf("GET /r%d", i%7)}
		}
		rs = append(rs, tb(fmt.Sprintf("rule-%06d", i), m))
	}
	rs = append(rs, tb("rule-all", map[string]string{}))
	return rs
}

// With more than manyKeys keys, Match reads only the shapes anchored at the
// request's keys; it finds exactly what matching every rule finds.
func TestIndexManyKeysMatchesBruteForce(t *testing.T) {
	rs := manyKeyRules(600)
	ix, err := NewIndex(rs)
	if err != nil {
		t.Fatal(err)
	}
	if ix.keyIdx == nil {
		t.Fatalf("%d keys, not anchored", len(ix.keys))
	}
	all := ix.Rules()
	for i := range 400 {
		res := fmt.Sprintf("GET /r%d", i%7)
		if i%9 == 0 {
			res = ""
		}
		attrs := map[string]string{fmt.Sprintf("attr_%d", (i*7)%600): "v", "tier": []string{"free", "t1", "t3"}[i%3]}
		if i%4 == 0 {
			attrs[fmt.Sprintf("attr_%d", (i*5)%600)] = "w"
		}
		if i%5 == 0 {
			attrs["resource"] = "GET /r1" // an attribute named resource: not the resource
		}
		if i%11 == 0 {
			delete(attrs, "tier")
		}
		sameAsBruteForce(t, ix, all, i, res, attrs)
	}
}

// BenchmarkMatchManyKeys: n rules each keyed on an attribute name of its
// own, and a request that matches none of them.
func BenchmarkMatchManyKeys(b *testing.B) {
	for _, n := range []int{1000, 5000} {
		b.Run(fmt.Sprintf("rules=%d", n), func(b *testing.B) {
			rs := make([]Rule, 0, n+1)
			for i := range n {
				rs = append(rs, tb(fmt.Sprintf("shape-%05d", i), map[string]string{"resource": "GET /s", fmt.Sprintf("attr_%d", i): "v"}))
			}
			rs = append(rs, tb("orders", map[string]string{"resource": "POST /orders", "tier": "free"}))
			ix, err := NewIndex(rs)
			if err != nil {
				b.Fatal(err)
			}
			attrs := map[string]string{"tier": "free", "api_key": "k"}
			if got := len(ix.Match("POST /orders", attrs)); got != 1 {
				b.Fatalf("Match found %d rules, want 1", got)
			}
			b.ReportAllocs()
			for b.Loop() {
				ix.Match("POST /orders", attrs)
			}
		})
	}
}
