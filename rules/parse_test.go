package rules

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

const exampleRule = `{ "id": "orders-free",
  "match": { "resource": "POST /orders", "tier": "free" },
  "key": ["client_key"],
  "algorithm": "token_bucket", "capacity": 20, "refill_per_second": 10,
  "scope": "global",
  "regions": { "us-east": 2, "eu-west": 1, "ap-south": 1 },
  "min_share": 0.1,
  "failure_mode": "open",
  "shadow": false }`

func TestParseRuleExample(t *testing.T) {
	r, err := ParseRule([]byte(exampleRule))
	if err != nil {
		t.Fatal(err)
	}
	want := Rule{ID: "orders-free", Match: map[string]string{"resource": "POST /orders", "tier": "free"},
		Key: []string{"client_key"}, Algorithm: TokenBucket, Capacity: 20, RefillPerSecond: 10,
		Scope: Global, Regions: map[string]float64{"us-east": 2, "eu-west": 1, "ap-south": 1},
		MinShare: 0.1, FailureMode: FailOpen}
	if !reflect.DeepEqual(r, want) {
		t.Fatalf("got %+v\nwant %+v", r, want)
	}
}

func TestParseRuleErrors(t *testing.T) {
	tests := []struct {
		name  string
		doc   string
		field string // "" for a document-level error that is not a FieldError
		msg   string
	}{
		{"unknown field", `{"id":"a","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"burst":3}`, "burst", "unknown field"},
		{"wrong case", `{"id":"a","algorithm":"token_bucket","Capacity":1,"refill_per_second":1}`, "Capacity", `did you mean "capacity"`},
		{"repeated field", `{"id":"a","algorithm":"token_bucket","capacity":1,"capacity":1000,"refill_per_second":1}`, "capacity", "more than once"},
		{"repeated match key", `{"id":"a","match":{"tier":"free","tier":"pro"},"algorithm":"token_bucket","capacity":1,"refill_per_second":1}`, "match.tier", "more than once"},
		{"match number", `{"id":"a","match":{"tier":1},"algorithm":"token_bucket","capacity":1,"refill_per_second":1}`, "match.tier", "string"},
		{"match bool", `{"id":"a","match":{"tier":true},"algorithm":"token_bucket","capacity":1,"refill_per_second":1}`, "match.tier", "quote"},
		{"match list", `{"id":"a","match":["tier"],"algorithm":"token_bucket","capacity":1,"refill_per_second":1}`, "match", "object"},
		{"region string weight", `{"id":"a","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"scope":"global","regions":{"us-east":"2"}}`, "regions.us-east", "number"},
		{"capacity string", `{"id":"a","algorithm":"token_bucket","capacity":"20","refill_per_second":1}`, "capacity", "integer"},
		{"capacity fraction", `{"id":"a","algorithm":"token_bucket","capacity":1.5,"refill_per_second":1}`, "capacity", "integer"},
		{"capacity overflow", `{"id":"a","algorithm":"token_bucket","capacity":99999999999999999999,"refill_per_second":1}`, "capacity", "integer"},
		{"capacity negative", `{"id":"a","algorithm":"token_bucket","capacity":-5,"refill_per_second":1}`, "capacity", "negative"},
		{"refill overflow", `{"id":"a","algorithm":"token_bucket","capacity":5,"refill_per_second":1e400}`, "refill_per_second", "must be a finite number, got 1e400 (out of range)"},
		{"refill zero", `{"id":"a","algorithm":"token_bucket","capacity":5,"refill_per_second":0}`, "refill_per_second", "above 0"},
		{"key string", `{"id":"a","key":"client_key","algorithm":"token_bucket","capacity":1,"refill_per_second":1}`, "key", "list of strings"},
		{"window abc", `{"id":"a","algorithm":"fixed_window","limit":5,"window":"abc"}`, "window", `"abc" is not a duration`},
		{"window number", `{"id":"a","algorithm":"fixed_window","limit":5,"window":60}`, "window", "duration string"},
		{"limit exponent", `{"id":"a","algorithm":"fixed_window","limit":1e3,"window":"1s"}`, "limit", "written as digits (1000, not 1e3 or 1000.0), got 1e3"},
		{"window zero", `{"id":"a","algorithm":"fixed_window","limit":5,"window":"0s"}`, "window", "must be above 0"},
		{"unknown algorithm", `{"id":"a","algorithm":"gcra","capacity":1,"refill_per_second":1}`, "algorithm", "token_bucket"},
		{"not an object", `["a"]`, "", "must be a JSON object"},
		{"local batch", `{"id":"a","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"local_batch":10}`, "local_batch", "above capacity"},
		{"invalid JSON", "{\"id\":\"a\",\n \"algorithm\": token_bucket}", "", "invalid JSON at line 2, column 16 (byte offset 26)"},
		{"truncated JSON", `{"id":"a"`, "", "unexpected end of input"},
		{"trailing data", `{"id":"a","algorithm":"token_bucket","capacity":1,"refill_per_second":1} {}`, "", "data after the end of the document at line 1, column 74 (byte offset 73)"},
		{"empty", "  ", "", "empty document"},
		{"too large", `{"id":"a","shadow":false` + strings.Repeat(" ", MaxRuleSize) + `}`, "", "over the 65536-byte (64 KiB) limit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseRule([]byte(tt.doc))
			if err == nil {
				t.Fatal("ParseRule accepted the document")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("errors.Is(%v, ErrInvalid) = false", err)
			}
			if !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("error %q does not contain %q", err, tt.msg)
			}
			var fe *FieldError
			if tt.field != "" {
				if !errors.As(err, &fe) || fe.Field != tt.field {
					t.Errorf("error %q (%T): want a *FieldError naming %q", err, err, tt.field)
				}
			}
		})
	}
}

func TestParseRuleErrorNamesRuleID(t *testing.T) {
	_, err := ParseRule([]byte(`{"id":"orders","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"burst":3}`))
	if want := `rules: rule "orders": burst: unknown field`; err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("err = %v, want prefix %q", err, want)
	}
}

func TestMarshalRuleRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		rule Rule
		want string
	}{
		{"window", Rule{ID: "w", Algorithm: FixedWindow, Limit: 5, Window: Duration(time.Minute)},
			`{"id":"w","key":["client_key"],"algorithm":"fixed_window","limit":5,"window":"1m","scope":"regional","failure_mode":"open"}`},
		{"global", globalRule(),
			`{"id":"orders-free","match":{"resource":"POST /orders","tier":"free"},"key":["client_key"],"algorithm":"token_bucket","capacity":20,"refill_per_second":10,"scope":"global","regions":{"ap-south":1,"eu-west":1,"us-east":2},"min_share":0.1,"failure_mode":"open"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := MarshalRule(tt.rule)
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != tt.want {
				t.Fatalf("MarshalRule =\n%s\nwant\n%s", b, tt.want)
			}
			back, err := ParseRule(b)
			if err != nil {
				t.Fatal(err)
			}
			norm := tt.rule.Clone()
			norm.Normalize()
			if !reflect.DeepEqual(back, norm) {
				t.Fatalf("round trip gave %+v, want %+v", back, norm)
			}
		})
	}
	if _, err := MarshalRule(Rule{ID: "bad"}); err == nil {
		t.Fatal("MarshalRule accepted an invalid rule")
	}
}

const yamlRules = `# rules for the test
- id: orders-free
  match: {resource: "POST /orders", tier: free}
  algorithm: token_bucket
  capacity: 20
  refill_per_second: 10
  scope: global
  regions: {us-east: 2, eu-west: 1}
  min_share: 0.1
- id: hourly
  algorithm: sliding_window
  limit: 1000
  window: 1h
`

func TestParseRules(t *testing.T) {
	jsonRules := `[` + exampleRule + `, {"id":"hourly","algorithm":"sliding_window","limit":1000,"window":"1h"}]`
	tests := []struct {
		name string
		doc  string
		ids  []string
	}{
		{"json list", jsonRules, []string{"orders-free", "hourly"}},
		{"json wrapped", `{"rules":` + jsonRules + `}`, []string{"orders-free", "hourly"}},
		{"yaml list", yamlRules, []string{"orders-free", "hourly"}},
		{"yaml wrapped", "rules:\n" + indent(yamlRules), []string{"orders-free", "hourly"}},
		{"yaml with document start", "---\n" + yamlRules, []string{"orders-free", "hourly"}},
		{"empty json list", `[]`, []string{}},
		{"empty yaml list", `rules: []`, []string{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rs, err := ParseRules([]byte(tt.doc))
			if err != nil {
				t.Fatal(err)
			}
			ids := []string{}
			for _, r := range rs {
				ids = append(ids, r.ID)
			}
			if !reflect.DeepEqual(ids, tt.ids) {
				t.Fatalf("ids %q, want %q", ids, tt.ids)
			}
		})
	}
}

func TestParseRulesYAMLEqualsJSON(t *testing.T) {
	y, err := ParseRules([]byte(yamlRules))
	if err != nil {
		t.Fatal(err)
	}
	j, err := ParseRules([]byte(`[
	{"id":"orders-free","match":{"resource":"POST /orders","tier":"free"},"algorithm":"token_bucket","capacity":20,
	 "refill_per_second":10,"scope":"global","regions":{"us-east":2,"eu-west":1},"min_share":0.1},
	{"id":"hourly","algorithm":"sliding_window","limit":1000,"window":"1h"}]`))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(y, j) {
		t.Fatalf("YAML gave %+v\nJSON gave %+v", y, j)
	}
}

func indent(s string) string {
	return "  " + strings.ReplaceAll(strings.TrimSuffix(s, "\n"), "\n", "\n  ") + "\n"
}

func TestParseRulesErrors(t *testing.T) {
	ok := `{"id":"a","algorithm":"token_bucket","capacity":1,"refill_per_second":1}`
	tests := []struct {
		name  string
		doc   string
		item  int
		id    string
		field string
		msg   string
	}{
		{"duplicate id", `[` + ok + `,` + ok + `]`, 2, "a", "id", "duplicate id, also used by item 1"},
		{"bad second rule", `[` + ok + `,{"id":"b","algorithm":"token_bucket","capacity":-1,"refill_per_second":1}]`, 2, "b", "capacity", "negative"},
		{"unknown field names id", `[` + ok + `,{"id":"b","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"x":1}]`, 2, "b", "x", "unknown field"},
		{"yaml unknown algorithm", "- id: a\n  algorithm: gcra\n  capacity: 1\n  refill_per_second: 1\n", 1, "a", "algorithm", "unknown algorithm"},
		{"yaml window abc", "- id: w\n  algorithm: fixed_window\n  limit: 5\n  window: abc\n", 1, "w", "window", `"abc" is not a duration`},
		{"yaml unquoted yes", "- id: w\n  match: {tier: yes}\n  algorithm: fixed_window\n  limit: 5\n  window: 1s\n", 1, "w", "match.tier", "quote"},
		{"yaml wrong case", "- id: w\n  Algorithm: fixed_window\n  limit: 5\n  window: 1s\n", 1, "w", "Algorithm", "did you mean"},
		{"item not object", `[` + ok + `, 3]`, 2, "", "", "must be a JSON object"},
		{"single rule", ok, 0, "", "", "expected a list"},
		{"unknown top-level", `{"rules":[], "version": 2}`, 0, "", "version", "unknown field"},
		{"rules not list", `{"rules": {}}`, 0, "", "rules", "must be a list"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseRules([]byte(tt.doc))
			var fe *FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("ParseRules = %v, want a *FieldError", err)
			}
			if fe.Item != tt.item || fe.RuleID != tt.id || fe.Field != tt.field || !strings.Contains(fe.Msg, tt.msg) {
				t.Fatalf("ParseRules = %q: item %d id %q field %q; want item %d id %q field %q, message with %q",
					err, fe.Item, fe.RuleID, fe.Field, tt.item, tt.id, tt.field, tt.msg)
			}
		})
	}
}

func TestParseRulesDocumentErrors(t *testing.T) {
	tests := []struct {
		name string
		doc  string
		msg  string
	}{
		{"empty", "\n  \n", "empty rules document"},
		{"bad json", `[{"id":"a",}]`, "invalid JSON at line 1, column 12"},
		{"bad yaml", "- id: a\n  algorithm: [\n", "invalid YAML"},
		{"yaml repeated key", "- id: a\n  id: b\n", "invalid YAML"},
		{"several yaml documents", yamlRules + "---\n" + yamlRules, "several YAML documents"},
		{"rule too large", `[{"id":"a","shadow":false` + strings.Repeat(" ", MaxRuleSize) + `}]`, "over the 65536-byte (64 KiB) limit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseRules([]byte(tt.doc))
			if err == nil || !strings.Contains(err.Error(), tt.msg) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseRules = %v, want an ErrInvalid containing %q", err, tt.msg)
			}
		})
	}
}
