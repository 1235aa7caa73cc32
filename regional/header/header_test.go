package header

import (
	"net/http"
	"reflect"
	"strings"
	"testing"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
)

func TestFields(t *testing.T) {
	bucket := Rule{ID: "orders", Allowed: true, Limit: 3, Remaining: 2, ResetAfterMs: 1000, WindowMs: 3000}
	rejected := Rule{ID: "orders", Limit: 3, Remaining: 0, RetryAfterMs: 1200, ResetAfterMs: 3000, WindowMs: 3000}
	never := Rule{ID: "orders", Limit: 3, Remaining: 3, RetryAfterMs: -1, ResetAfterMs: 0, WindowMs: 3000}
	shadow := Rule{ID: "trial", Shadow: true, Limit: 1, Remaining: 0, RetryAfterMs: 500, ResetAfterMs: 900, WindowMs: 1000}
	tests := []struct {
		name       string
		a          Answer
		want       []Field
		wantStatus int
		wantReason string
	}{
		{"no rule matched", Answer{Allowed: true}, nil, 200, ""},
		{"allowed", Answer{Allowed: true, Binding: "orders", Rules: []Rule{bucket}}, []Field{
			{Limit, "3"}, {Remaining, "2"}, {Reset, "1"}, {Policy, `"orders";q=3;w=3`}, {RateLimit, `"orders";r=2;t=1`}}, 200, ""},
		{"rejected: Retry-After rounded up", Answer{Binding: "orders", Rules: []Rule{rejected}}, []Field{
			{Limit, "3"}, {Remaining, "0"}, {Reset, "3"}, {Policy, `"orders";q=3;w=3`}, {RateLimit, `"orders";r=0;t=3`}, {RetryAfter, "2"}},
			429, "too many requests"},
		{"cost above capacity: no Retry-After, 413", Answer{Cost: 5, Binding: "orders", Rules: []Rule{never}}, []Field{
			{Limit, "3"}, {Remaining, "3"}, {Reset, "0"}, {Policy, `"orders";q=3;w=3`}, {RateLimit, `"orders";r=3;t=0`}},
			413, `cost 5 is above the 3 tokens rule "orders" admits here at most`},
		{"share of rate zero: no Retry-After, 429 saying so", Answer{Cost: 1, Binding: "g", Rules: []Rule{{ID: "g", Limit: 5, RetryAfterMs: -1, ResetAfterMs: -1, WindowMs: 0}}},
			[]Field{{Limit, "5"}, {Remaining, "0"}, {Policy, `"g";q=5;w=1`}, {RateLimit, `"g";r=0`}}, 429, "waiting for its tokens cannot help"},
		{"no share in this region (a global rule not listing it): 429, no Retry-After", Answer{Cost: 1, Binding: "g", Rules: []Rule{{ID: "g", Limit: 0, RetryAfterMs: -1, ResetAfterMs: -1, WindowMs: 0}}},
			[]Field{{Limit, "0"}, {Remaining, "0"}, {Policy, `"g";q=0;w=1`}, {RateLimit, `"g";r=0`}}, 429, "admits nothing in this region"},
		{"never from a rule that is not the binding one", Answer{Cost: 5, Binding: "orders", Rules: []Rule{rejected, {ID: "small", Limit: 4, RetryAfterMs: -1}}},
			[]Field{{Limit, "3"}, {Remaining, "0"}, {Reset, "3"}, {Policy, `"orders";q=3;w=3`}, {RateLimit, `"orders";r=0;t=3`}},
			413, `rule "small"`},
		{"failure policy allows: no remaining or reset", Answer{Allowed: true, FailOpen: true, Binding: "orders", Rules: []Rule{{ID: "orders", Allowed: true, Limit: 3, WindowMs: 3000}}},
			[]Field{{Limit, "3"}, {Policy, `"orders";q=3;w=3`}}, 200, ""},
		{"failure policy rejects (closed): Retry-After", Answer{FailOpen: true, Binding: "orders", Rules: []Rule{{ID: "orders", Limit: 3, RetryAfterMs: 1000, WindowMs: 3000}}},
			[]Field{{Limit, "3"}, {Policy, `"orders";q=3;w=3`}, {RetryAfter, "1"}}, 429, "too many requests"},
		{"shadow-only match: no headers", Answer{Allowed: true, Binding: "trial", Rules: []Rule{shadow}}, nil, 200, ""},
		{"shadow rule never binds the headers", Answer{Allowed: true, Binding: "orders", Rules: []Rule{shadow, bucket}}, []Field{
			{Limit, "3"}, {Remaining, "2"}, {Reset, "1"}, {Policy, `"orders";q=3;w=3`}, {RateLimit, `"orders";r=2;t=1`}}, 200, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Fields(tc.a); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Fields = %v\nwant     %v", got, tc.want)
			}
			code, reason := Status(tc.a)
			if code != tc.wantStatus || !strings.Contains(reason, tc.wantReason) {
				t.Errorf("Status = %d %q, want %d containing %q", code, reason, tc.wantStatus, tc.wantReason)
			}
			h := http.Header{}
			Set(h, tc.a)
			if len(h) != len(tc.want) {
				t.Errorf("Set wrote %d headers, want %d: %v", len(h), len(tc.want), h)
			}
		})
	}
}

func TestFromProto(t *testing.T) {
	resp := &ratelimitv1.CheckLimitResponse{Allowed: false, RuleId: "r", Limit: 10, Remaining: 0, RetryAfterMs: 100, ResetAfterMs: 900, WindowMs: 1000,
		Statuses: []*ratelimitv1.RuleStatus{{RuleId: "r", Limit: 10, RetryAfterMs: 100, ResetAfterMs: 900, WindowMs: 1000}}}
	want := []Field{{Limit, "10"}, {Remaining, "0"}, {Reset, "1"}, {Policy, `"r";q=10;w=1`}, {RateLimit, `"r";r=0;t=1`}, {RetryAfter, "1"}}
	if got := Fields(FromProto(resp, 1)); !reflect.DeepEqual(got, want) {
		t.Errorf("with statuses: %v, want %v", got, want)
	}
	resp.Statuses = nil // a server that sends no statuses: the top-level fields stand for the binding rule
	if got := Fields(FromProto(resp, 1)); !reflect.DeepEqual(got, want) {
		t.Errorf("without statuses: %v, want %v", got, want)
	}
}
