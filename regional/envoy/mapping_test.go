package envoy

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/envoyconfig"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestCurrentLimit(t *testing.T) {
	const (
		second = rlsv3.RateLimitResponse_RateLimit_SECOND
		minute = rlsv3.RateLimitResponse_RateLimit_MINUTE
		hour   = rlsv3.RateLimitResponse_RateLimit_HOUR
		day    = rlsv3.RateLimitResponse_RateLimit_DAY
		week   = rlsv3.RateLimitResponse_RateLimit_WEEK
		month  = rlsv3.RateLimitResponse_RateLimit_MONTH
		year   = rlsv3.RateLimitResponse_RateLimit_YEAR
	)
	tests := []struct {
		name   string
		limit  int64
		period time.Duration
		n      uint32
		unit   rlsv3.RateLimitResponse_RateLimit_Unit
	}{
		{"fixed window 100 per minute (exact)", 100, time.Minute, 100, minute},
		{"fixed window 10 per second (exact)", 10, time.Second, 10, second},
		{"window 1000 per day (exact)", 1000, 24 * time.Hour, 1000, day},
		{"window 20 per week (exact)", 20, 7 * 24 * time.Hour, 20, week},
		{"window 5 per 30 days (exact month)", 5, 30 * 24 * time.Hour, 5, month},
		{"window 100 per 10s: per minute", 100, 10 * time.Second, 100, minute},
		{"token bucket 3, refill 1/s (3s): 3/MINUTE, never below limit_remaining", 3, 3 * time.Second, 3, minute},
		{"token bucket 20, refill 10/s (2s)", 20, 2 * time.Second, 20, minute},
		{"token bucket 5, refill 5/s (1s)", 5, time.Second, 5, second},
		{"token bucket 1000, refill 1/s (1000s)", 1000, 1000 * time.Second, 1000, hour},
		{"window 1 per 366 days: per year", 1, 366 * 24 * time.Hour, 1, year},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := currentLimit("r", tc.limit, tc.period.Milliseconds())
			if got.GetName() != "r" || got.GetRequestsPerUnit() != tc.n || got.GetUnit() != tc.unit {
				t.Fatalf("currentLimit(%d per %v) = %d/%v, want %d/%v", tc.limit, tc.period, got.GetRequestsPerUnit(), got.GetUnit(), tc.n, tc.unit)
			}
		})
	}
	if got := currentLimit("r", 0, 1000); got != nil {
		t.Errorf("limit 0: %v, want nil", got)
	}
	if got := currentLimit("r", 5, 0); got != nil {
		t.Errorf("period 0: %v, want nil", got)
	}
}

func TestMapped(t *testing.T) {
	long := strings.Repeat("a", maxFieldBytes+1)
	tests := []struct {
		name, in string
		max      int
		hashed   bool
	}{
		{"short", "/index.html", maxFieldBytes, false},
		{"empty", "", maxFieldBytes, false},
		{"at the limit", strings.Repeat("a", maxFieldBytes), maxFieldBytes, false},
		{"one byte over", long, maxFieldBytes, true},
		{"client key at its limit", strings.Repeat("k", regional.MaxClientKeyBytes), regional.MaxClientKeyBytes, false},
		{"client key over its limit", strings.Repeat("k", regional.MaxClientKeyBytes+1), regional.MaxClientKeyBytes, true},
		{"a hashed form is hashed again", hashedForm(long), maxFieldBytes, true},
		{"prefix alone", "sha256:", maxFieldBytes, false},
		{"prefix and a short digest", "sha256:abc", maxFieldBytes, false},
		{"prefix and upper-case hex", strings.ToUpper(hashedForm(long)[7:]), maxFieldBytes, false},
		{"prefix and 64 non-hex", "sha256:" + strings.Repeat("g", 64), maxFieldBytes, false},
		{"invalid UTF-8", "u\xff", maxFieldBytes, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := mapped(tc.in, tc.max)
			if tc.hashed {
				if got != hashedForm(tc.in) || !isHashedForm(got) {
					t.Fatalf("mapped(%.40q) = %q, want its hashed form", tc.in, got)
				}
			} else if got != tc.in {
				t.Fatalf("mapped(%.40q) = %q, want it unchanged", tc.in, got)
			}
			if len(got) > tc.max || !utf8.ValidString(got) {
				t.Fatalf("mapped(%.40q) = %q: not within %d bytes of valid UTF-8", tc.in, got, tc.max)
			}
		})
	}
}

// FuzzMapped: mapped is injective (two different strings never map to one
// field, so never share a bucket or a match value), and its answer is
// always within the limit.
func FuzzMapped(f *testing.F) {
	long := strings.Repeat("a", maxFieldBytes+1)
	f.Add("a", "b", uint16(maxFieldBytes))
	f.Add(long, hashedForm(long), uint16(maxFieldBytes))
	f.Add(strings.Repeat("k", 300), hashedForm(strings.Repeat("k", 300)), uint16(regional.MaxClientKeyBytes))
	f.Add("u\xff", hashedForm("u\xff"), uint16(maxFieldBytes))
	f.Fuzz(func(t *testing.T, a, b string, n uint16) {
		limit := max(int(n), len(hashedForm("")))
		ma, mb := mapped(a, limit), mapped(b, limit)
		if a != b && ma == mb {
			t.Fatalf("mapped(%q) = mapped(%q) = %q", a, b, ma)
		}
		if len(ma) > limit || !utf8.ValidString(ma) {
			t.Fatalf("mapped(%q) = %q: not within %d bytes of valid UTF-8", a, ma, limit)
		}
		if isHashedForm(ma) != (ma != a) {
			t.Fatalf("mapped(%q) = %q: a kept value has the hashed form, or a hashed one has not", a, ma)
		}
	})
}

// The identity keeps envoyconfig.Identity's form, which rules imported
// with rules/envoyconfig key their buckets by.
func TestIdentity(t *testing.T) {
	for _, path := range [][]envoyconfig.Entry{
		{{Key: "key1", Value: "foo"}},
		{{Key: "source_cluster", Value: "proxy"}, {Key: "destination_cluster", Value: "mock"}},
		{{Key: "sha256:" + strings.Repeat("0", 64), Value: "v"}},
		{{Key: "path", Value: strings.Repeat("p", 2000)}},
	} {
		if got, want := identity(path), envoyconfig.Identity(path, rules.MaxMatchValueLen); got != want {
			t.Errorf("identity(%.60v) = %.80q, want %.80q", path, got, want)
		}
	}
	if got := identity([]envoyconfig.Entry{{Key: "k", Value: "u\xff"}}); !isHashedForm(got) {
		t.Errorf("identity of invalid UTF-8: %q, want a hashed form", got)
	}
}

// TestEnforcerLimits checks that the limits this package maps descriptors
// into are the enforcer's: the largest request it takes passes, one byte
// or one attribute more is refused.
func TestEnforcerLimits(t *testing.T) {
	e := fuzzEnforcer(t)
	attrs := func(n int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprintf("a%d", i)] = "v"
		}
		return m
	}
	fits := []regional.Request{
		{ClientKey: strings.Repeat("k", regional.MaxClientKeyBytes), Resource: strings.Repeat("r", maxFieldBytes)},
		{ClientKey: "u", Attributes: attrs(maxAttributes)},
		{ClientKey: "u", Attributes: map[string]string{strings.Repeat("k", maxFieldBytes): strings.Repeat("v", maxFieldBytes)}},
		{ClientKey: hashedForm(""), Resource: hashedForm(""), Attributes: map[string]string{hashedForm("k"): hashedForm("v")}},
	}
	for i, req := range fits {
		if _, err := e.Check(context.Background(), req); err != nil {
			t.Errorf("request %d within the limits: %v", i, err)
		}
	}
	over := map[string]regional.Request{
		"client_key": {ClientKey: strings.Repeat("k", regional.MaxClientKeyBytes+1)},
		"resource":   {ClientKey: "u", Resource: strings.Repeat("r", maxFieldBytes+1)},
		"attributes": {ClientKey: "u", Attributes: attrs(maxAttributes + 1)},
		"key":        {ClientKey: "u", Attributes: map[string]string{strings.Repeat("k", maxFieldBytes+1): "v"}},
		"value":      {ClientKey: "u", Attributes: map[string]string{"k": strings.Repeat("v", maxFieldBytes+1)}},
	}
	for name, req := range over {
		if _, err := e.Check(context.Background(), req); !errors.Is(err, regional.ErrInvalidRequest) {
			t.Errorf("%s one over the limit: %v, want an invalid request", name, err)
		}
	}
}

// TestFit: a check with more attributes than the enforcer takes keeps
// those that the rules matching it read, rule by rule in id order, and
// every rule that applied with all of them applies with those kept.
func TestFit(t *testing.T) {
	keys := func(prefix string, n int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprintf("%s%02d", prefix, i)] = rules.MatchAny
		}
		return m
	}
	imported := rules.Rule{ID: "edge.k", Match: map[string]string{"domain": "edge", envoyconfig.AttrNode: "k"},
		Key: []string{envoyconfig.AttrDescriptor}, Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second)}
	perPath := rules.Rule{ID: "per-path", Match: map[string]string{"domain": "edge", "path": "*"},
		Key: []string{"client_key", "resource"}, Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second)}
	byTier := rules.Rule{ID: "tier", Match: map[string]string{"path": "*"},
		Key: []string{"client_key", "tier"}, Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second)}
	wide := rules.Rule{ID: "a-wide", Match: keys("a", maxAttributes+1), Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second)}
	half1 := rules.Rule{ID: "b-half", Match: keys("b", 40), Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second)}
	half2 := rules.Rule{ID: "c-half", Match: keys("c", 40), Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second)}
	ix, err := rules.NewIndex([]rules.Rule{imported, perPath, byTier, wide, half1, half2})
	if err != nil {
		t.Fatal(err)
	}
	attrs := func(base map[string]string, prefixes ...string) map[string]string {
		m := map[string]string{}
		maps.Copy(m, base)
		for _, p := range prefixes {
			for k := range keys(p, maxAttributes+1) {
				m[k] = "v"
			}
		}
		return m
	}
	tests := []struct {
		name    string
		attrs   map[string]string
		applies []string // the rules that match the kept attributes
		kept    []string
	}{
		{"within the limit: unchanged", map[string]string{"domain": "edge", "path": "/a", "x": "y"}, []string{"per-path"}, []string{"domain", "path", "x"}},
		{"imported node", attrs(map[string]string{"domain": "edge", envoyconfig.AttrNode: "k", envoyconfig.AttrDescriptor: "k=v"}, "x"),
			[]string{"edge.k"}, []string{"domain", envoyconfig.AttrDescriptor, envoyconfig.AttrNode}},
		{"match keys and key parts", attrs(map[string]string{"domain": "edge", "path": "/a", "tier": "gold"}, "x"),
			[]string{"per-path", "tier"}, []string{"domain", "path", "tier"}},
		{"a key part missing: the rule has no bucket, nothing kept for it", attrs(map[string]string{"path": "/a"}, "x"),
			nil, nil},
		{"a rule reading more attributes than a check takes is not applied", attrs(map[string]string{"domain": "edge", "path": "/a"}, "a"),
			[]string{"per-path"}, []string{"domain", "path"}},
		{"the first rules by id that fit", attrs(nil, "b", "c"), []string{"b-half"}, slices.Sorted(maps.Keys(keys("b", 40)))},
		{"nothing fits: no attribute", attrs(nil, "a"), nil, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := &check{req: regional.Request{ClientKey: "u", Resource: "edge /a", Attributes: tc.attrs}}
			c.fit(ix)
			if got := slices.Sorted(maps.Keys(c.req.Attributes)); !slices.Equal(got, tc.kept) {
				t.Fatalf("kept %v, want %v", got, tc.kept)
			}
			for k, v := range c.req.Attributes {
				if tc.attrs[k] != v {
					t.Errorf("attribute %s: %q, want %q", k, v, tc.attrs[k])
				}
			}
			var applies []string
			for _, r := range ix.Match(c.req.Resource, c.req.Attributes) {
				if _, ok := r.KeyValues(c.req.ClientKey, c.req.Resource, c.req.Attributes); ok {
					applies = append(applies, r.ID)
				}
			}
			if !slices.Equal(applies, tc.applies) {
				t.Errorf("rules applying after fit: %v, want %v", applies, tc.applies)
			}
		})
	}
}

// A descriptor the enforcer refuses is answered alone: a cost above its
// maximum is OVER_LIMIT (the body says why), any other refusal (which the
// mapping keeps from happening) OK without current_limit, as a descriptor
// no rule matches; only an error that is not about the request fails the call.
func TestFinishAnswersARefusedDescriptorAlone(t *testing.T) {
	tests := []struct {
		name string
		err  error
		code rlsv3.RateLimitResponse_Code
	}{
		{"cost", &regional.RequestError{Field: "cost", Msg: "5000 is above the maximum of 1000"}, rlsv3.RateLimitResponse_OVER_LIMIT},
		{"resource", &regional.RequestError{Field: "resource", Msg: "is 1025 bytes, the maximum is 1024"}, rlsv3.RateLimitResponse_OK},
		{"attributes", &regional.RequestError{Field: "attributes", Msg: "has 65 entries, the maximum is 64"}, rlsv3.RateLimitResponse_OK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := &check{err: tc.err, costField: "descriptors[1].hits_addend"}
			if err := c.finish(); err != nil {
				t.Fatalf("finish: %v, want an answer for the descriptor", err)
			}
			if c.status.GetCode() != tc.code || c.status.GetCurrentLimit() != nil || c.answered() {
				t.Fatalf("status %v (answered %v), want a bare %v", c.status, c.answered(), tc.code)
			}
		})
	}
	c := &check{err: context.Canceled}
	if err := c.finish(); status.Code(err) != codes.Canceled {
		t.Fatalf("caller gone: %v, want Canceled", err)
	}
}
