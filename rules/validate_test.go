package rules

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
)

func tokenRule() Rule {
	return Rule{ID: "orders-free", Match: map[string]string{"resource": "POST /orders", "tier": "free"},
		Algorithm: TokenBucket, Capacity: 20, RefillPerSecond: 10}
}

func windowRule() Rule {
	return Rule{ID: "hourly", Algorithm: SlidingWindow, Limit: 1000, Window: Duration(time.Hour)}
}

func globalRule() Rule {
	r := tokenRule()
	r.Scope = Global
	r.Regions = map[string]float64{"us-east": 2, "eu-west": 1, "ap-south": 1}
	r.MinShare = 0.1
	return r
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name  string
		base  func() Rule
		edit  func(*Rule)
		field string // "" means valid
		msg   string // substring of the message
	}{
		{name: "token bucket ok", base: tokenRule, edit: func(*Rule) {}},
		{name: "leaky bucket ok", base: tokenRule, edit: func(r *Rule) { r.Algorithm = LeakyBucket }},
		{name: "window ok", base: windowRule, edit: func(*Rule) {}},
		{name: "fixed window ok", base: windowRule, edit: func(r *Rule) { r.Algorithm = FixedWindow }},
		{name: "sliding log ok", base: windowRule, edit: func(r *Rule) { r.Algorithm = SlidingLog }},
		{name: "global ok", base: globalRule, edit: func(*Rule) {}},
		{name: "global min share 0 ok", base: globalRule, edit: func(r *Rule) { r.MinShare = 0 }},
		{name: "global min share 1 ok", base: globalRule, edit: func(r *Rule) { r.MinShare = 1 }},
		{name: "match any ok", base: tokenRule, edit: func(r *Rule) { r.Match["api_key"] = "*" }},
		{name: "key parts ok", base: tokenRule, edit: func(r *Rule) { r.Key = []string{"client_key", "resource", "ip"} }},
		{name: "closed ok", base: tokenRule, edit: func(r *Rule) { r.FailureMode = FailClosed }},
		{name: "local ok", base: tokenRule, edit: func(r *Rule) { r.FailureMode = FailLocal }},
		{name: "split one is off", base: tokenRule, edit: func(r *Rule) { r.Split = 1 }},
		{name: "max capacity ok", base: tokenRule, edit: func(r *Rule) { r.Capacity = MaxCapacity }},
		{name: "window 1ms ok", base: windowRule, edit: func(r *Rule) { r.Window = Duration(time.Millisecond) }},

		{name: "id missing", base: tokenRule, edit: func(r *Rule) { r.ID = "" }, field: "id", msg: "required"},
		{name: "id bad char", base: tokenRule, edit: func(r *Rule) { r.ID = "a/b" }, field: "id", msg: "'/'"},
		{name: "id too long", base: tokenRule, edit: func(r *Rule) { r.ID = strings.Repeat("a", 129) }, field: "id", msg: "129"},
		{name: "id dots", base: tokenRule, edit: func(r *Rule) { r.ID = ".." }, field: "id", msg: "path"},
		{name: "algorithm missing", base: tokenRule, edit: func(r *Rule) { r.Algorithm = "" }, field: "algorithm", msg: "required"},
		{name: "algorithm unknown", base: tokenRule, edit: func(r *Rule) { r.Algorithm = "gcra" }, field: "algorithm", msg: `"token_bucket", "sliding_window"`},
		{name: "capacity missing", base: tokenRule, edit: func(r *Rule) { r.Capacity = 0 }, field: "capacity", msg: "required"},
		{name: "capacity negative", base: tokenRule, edit: func(r *Rule) { r.Capacity = -5 }, field: "capacity", msg: "negative"},
		{name: "capacity too big", base: tokenRule, edit: func(r *Rule) { r.Capacity = MaxCapacity + 1 }, field: "capacity", msg: "at most"},
		{name: "refill zero", base: tokenRule, edit: func(r *Rule) { r.RefillPerSecond = 0 }, field: "refill_per_second", msg: "above 0"},
		{name: "refill negative", base: tokenRule, edit: func(r *Rule) { r.RefillPerSecond = -1 }, field: "refill_per_second", msg: "above 0"},
		{name: "refill NaN", base: tokenRule, edit: func(r *Rule) { r.RefillPerSecond = math.NaN() }, field: "refill_per_second", msg: "finite"},
		{name: "refill Inf", base: tokenRule, edit: func(r *Rule) { r.RefillPerSecond = math.Inf(1) }, field: "refill_per_second", msg: "finite"},
		{name: "refill too big", base: tokenRule, edit: func(r *Rule) { r.RefillPerSecond = 2e9 }, field: "refill_per_second", msg: "at most"},
		{name: "bucket with limit", base: tokenRule, edit: func(r *Rule) { r.Limit = 5 }, field: "limit", msg: "not used"},
		{name: "bucket with window", base: tokenRule, edit: func(r *Rule) { r.Window = Duration(time.Second) }, field: "window", msg: "not used"},
		{name: "limit missing", base: windowRule, edit: func(r *Rule) { r.Limit = 0 }, field: "limit", msg: "required"},
		{name: "limit negative", base: windowRule, edit: func(r *Rule) { r.Limit = -1 }, field: "limit", msg: "negative"},
		{name: "window missing", base: windowRule, edit: func(r *Rule) { r.Window = 0 }, field: "window", msg: "required"},
		{name: "window negative", base: windowRule, edit: func(r *Rule) { r.Window = Duration(-time.Second) }, field: "window", msg: "at least 1ms"},
		{name: "window sub-ms", base: windowRule, edit: func(r *Rule) { r.Window = Duration(1500 * time.Microsecond) }, field: "window", msg: "whole number"},
		{name: "window too long", base: windowRule, edit: func(r *Rule) { r.Window = Duration(400 * 24 * time.Hour) }, field: "window", msg: "at most"},
		{name: "window with capacity", base: windowRule, edit: func(r *Rule) { r.Capacity = 3 }, field: "capacity", msg: "not used"},
		{name: "window with refill", base: windowRule, edit: func(r *Rule) { r.RefillPerSecond = 3 }, field: "refill_per_second", msg: "not used"},
		{name: "key empty part", base: tokenRule, edit: func(r *Rule) { r.Key = []string{"client_key", ""} }, field: "key[1]", msg: "empty"},
		{name: "key bad part", base: tokenRule, edit: func(r *Rule) { r.Key = []string{"a b"} }, field: "key[0]", msg: "' '"},
		{name: "key duplicate", base: tokenRule, edit: func(r *Rule) { r.Key = []string{"client_key", "client_key"} }, field: "key[1]", msg: "twice"},
		{name: "match empty value", base: tokenRule, edit: func(r *Rule) { r.Match["tier"] = "" }, field: "match.tier", msg: "empty"},
		{name: "match pattern", base: tokenRule, edit: func(r *Rule) { r.Match["resource"] = "GET /a*" }, field: "match.resource", msg: "patterns"},
		{name: "match bad key", base: tokenRule, edit: func(r *Rule) { r.Match["a b"] = "x" }, field: "match.a b", msg: "attribute name"},
		{name: "match client key", base: tokenRule, edit: func(r *Rule) { r.Match["client_key"] = "x" }, field: "match.client_key", msg: "cannot match"},
		{name: "scope unknown", base: tokenRule, edit: func(r *Rule) { r.Scope = "planet" }, field: "scope", msg: "planet"},
		{name: "global no regions", base: globalRule, edit: func(r *Rule) { r.Regions = nil }, field: "regions", msg: "at least one"},
		{name: "global zero weight", base: globalRule, edit: func(r *Rule) { r.Regions["us-east"] = 0 }, field: "regions.us-east", msg: "above 0"},
		{name: "global negative weight", base: globalRule, edit: func(r *Rule) { r.Regions["eu-west"] = -1 }, field: "regions.eu-west", msg: "above 0"},
		{name: "global NaN weight", base: globalRule, edit: func(r *Rule) { r.Regions["eu-west"] = math.NaN() }, field: "regions.eu-west", msg: "finite"},
		{name: "global Inf weight", base: globalRule, edit: func(r *Rule) { r.Regions["eu-west"] = math.Inf(1) }, field: "regions.eu-west", msg: "finite"},
		{name: "global weight whose sum overflows", base: globalRule, edit: func(r *Rule) { r.Regions["eu-west"], r.Regions["us-east"] = 1e308, 1e308 }, field: "regions.eu-west", msg: "at most 1e+09"},
		{name: "global bad region name", base: globalRule, edit: func(r *Rule) { r.Regions["us east"] = 1 }, field: "regions.us east", msg: "region name"},
		{name: "global min share above 1", base: globalRule, edit: func(r *Rule) { r.MinShare = 1.5 }, field: "min_share", msg: "between 0 and 1"},
		{name: "global min share negative", base: globalRule, edit: func(r *Rule) { r.MinShare = -0.1 }, field: "min_share", msg: "between 0 and 1"},
		{name: "regional with regions", base: tokenRule, edit: func(r *Rule) { r.Regions = map[string]float64{"us-east": 1} }, field: "regions", msg: "only a global rule"},
		{name: "regional with min share", base: tokenRule, edit: func(r *Rule) { r.MinShare = 0.5 }, field: "min_share", msg: "only a global rule"},
		{name: "capacity 1e9 beyond the store", base: tokenRule, edit: func(r *Rule) { r.Capacity = 1_000_000_000 }, field: "capacity", msg: "2^38 thousandths"},
		{name: "refill below a thousandth", base: tokenRule, edit: func(r *Rule) { r.RefillPerSecond = 0.0004 }, field: "refill_per_second", msg: "at least 0.001"},
		{name: "refill a thousandth ok", base: tokenRule, edit: func(r *Rule) { r.RefillPerSecond = 0.001 }},
		{name: "limit x window beyond the store", base: windowRule, edit: func(r *Rule) { r.Limit = 1 << 30; r.Window = Duration(366 * 24 * time.Hour) }, field: "limit", msg: "2^52"},
		{name: "limit 2^40 per second ok", base: windowRule, edit: func(r *Rule) { r.Limit = MaxLimit; r.Window = Duration(time.Second) }},
		{name: "global token bucket share is the store's", base: globalRule, edit: func(r *Rule) {
			r.RefillPerSecond = 0.002
			r.Regions = map[string]float64{"us-east": 1, "eu-west": 1000}
		}},
		{name: "global share of refill rounds to 0", base: globalRule, edit: func(r *Rule) {
			r.Algorithm = LeakyBucket
			r.RefillPerSecond = 0.002
			r.Regions = map[string]float64{"us-east": 1, "eu-west": 1000}
		}, field: "refill_per_second", msg: "region us-east"},
		{name: "global share of a sliding log's limit rounds to 0", base: windowRule, edit: func(r *Rule) {
			r.Algorithm = SlidingLog
			r.Limit = 2
			r.Scope = Global
			r.Regions = map[string]float64{"us-east": 1, "eu-west": 1, "ap-south": 1}
		}, field: "limit", msg: "region ap-south"},
		{name: "global sliding window share is the store's", base: windowRule, edit: func(r *Rule) {
			r.Limit = 2
			r.Scope = Global
			r.Regions = map[string]float64{"us-east": 1, "eu-west": 1, "ap-south": 1}
		}},
		{name: "global daily fixed window ok", base: windowRule, edit: func(r *Rule) {
			r.Algorithm, r.Limit, r.Window = FixedWindow, 100, Duration(24*time.Hour)
			r.Scope = Global
			r.Regions = map[string]float64{"us-east": 1, "eu-west": 1, "ap-south": 1}
		}},
		{name: "priority low ok", base: tokenRule, edit: func(r *Rule) { r.Priority = PriorityLow }},
		{name: "priority unknown", base: tokenRule, edit: func(r *Rule) { r.Priority = "urgent" }, field: "priority", msg: "urgent"},
		{name: "failure mode unknown", base: tokenRule, edit: func(r *Rule) { r.FailureMode = "maybe" }, field: "failure_mode", msg: "maybe"},
		{name: "local batch ok", base: tokenRule, edit: func(r *Rule) { r.LocalBatch = 10 }},
		{name: "local batch above capacity", base: tokenRule, edit: func(r *Rule) { r.LocalBatch = 21 }, field: "local_batch", msg: "above capacity"},
		{name: "local batch negative", base: tokenRule, edit: func(r *Rule) { r.LocalBatch = -1 }, field: "local_batch", msg: "at least 2"},
		{name: "local batch of a window", base: windowRule, edit: func(r *Rule) { r.LocalBatch = 10 }, field: "local_batch", msg: "only a token_bucket"},
		{name: "split ok", base: tokenRule, edit: func(r *Rule) { r.Split = 4 }},
		{name: "split too many", base: tokenRule, edit: func(r *Rule) { r.Split = 65 }, field: "split", msg: "between 2 and 64"},
		{name: "split of a window", base: windowRule, edit: func(r *Rule) { r.Split = 4 }, field: "split", msg: "only a token_bucket"},
		{name: "split of a global rule", base: globalRule, edit: func(r *Rule) { r.Split = 4 }, field: "split", msg: "global"},
		{name: "split with local batch", base: tokenRule, edit: func(r *Rule) { r.Split = 4; r.LocalBatch = 5 }, field: "split", msg: "local_batch"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := tt.base()
			tt.edit(&r)
			r.Normalize()
			err := r.Validate()
			if tt.field == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			var fe *FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("Validate = %v, want a *FieldError", err)
			}
			if fe.Field != tt.field || !strings.Contains(fe.Msg, tt.msg) {
				t.Fatalf("Validate = %q (field %q), want field %q and message containing %q", err, fe.Field, tt.field, tt.msg)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("errors.Is(%v, ErrInvalid) = false", err)
			}
		})
	}
}

func TestValidateUnknownAlgorithmIsSentinel(t *testing.T) {
	r := tokenRule()
	r.Algorithm = "gcra"
	err := r.Validate()
	if !errors.Is(err, ErrUnknownAlgorithm) || !errors.Is(err, ErrInvalid) {
		t.Fatalf("err = %v; want both ErrUnknownAlgorithm and ErrInvalid", err)
	}
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Field != "algorithm" {
		t.Fatalf("err = %v; want a *FieldError naming algorithm", err)
	}
	if want := `rules: rule "orders-free": algorithm: unknown algorithm "gcra"`; !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("message %q, want prefix %q", err, want)
	}
}

func TestValidateWithoutNormalize(t *testing.T) {
	r := Rule{ID: "a", Algorithm: TokenBucket, Capacity: 1, RefillPerSecond: 1}
	if err := r.Validate(); err != nil {
		t.Fatalf("Validate of a rule with empty defaults: %v", err)
	}
	if r.Key != nil || r.Scope != "" {
		t.Fatalf("Validate modified the rule: %+v", r)
	}
}

func TestNormalize(t *testing.T) {
	r := Rule{ID: "a", Match: map[string]string{}, Regions: map[string]float64{}, Split: 1}
	r.Normalize()
	if len(r.Key) != 1 || r.Key[0] != "client_key" || r.Scope != Regional || r.FailureMode != FailOpen ||
		r.Match != nil || r.Regions != nil || r.Split != 0 {
		t.Fatalf("Normalize gave %+v", r)
	}
}

func TestStaticShare(t *testing.T) {
	g := globalRule()
	g.Normalize()
	tests := []struct {
		name   string
		rule   Rule
		region string
		want   float64
		ok     bool
	}{
		{"global heavy", g, "us-east", 0.5, true},
		{"global light", g, "eu-west", 0.25, true},
		{"global unlisted", g, "sa-east", 0, false},
		{"regional", tokenRule(), "anywhere", 1, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := tt.rule.StaticShare(tt.region)
			if got != tt.want || ok != tt.ok {
				t.Fatalf("StaticShare(%q) = %v, %v; want %v, %v", tt.region, got, ok, tt.want, tt.ok)
			}
		})
	}
}

func TestKeyValues(t *testing.T) {
	attrs := map[string]string{"tier": "free", "ip": "10.0.0.1"}
	tests := []struct {
		name string
		key  []string
		want []string
		ok   bool
	}{
		{"client key", []string{"client_key"}, []string{"user:42"}, true},
		{"all kinds in order", []string{"ip", "resource", "client_key"}, []string{"10.0.0.1", "POST /orders", "user:42"}, true},
		{"missing attribute", []string{"client_key", "api_key"}, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := Rule{Key: tt.key}
			got, ok := r.KeyValues("user:42", "POST /orders", attrs)
			if ok != tt.ok {
				t.Fatalf("ok = %v, want %v", ok, tt.ok)
			}
			if ok && strings.Join(got, "|") != strings.Join(tt.want, "|") {
				t.Fatalf("KeyValues = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestDurationString(t *testing.T) {
	for in, want := range map[time.Duration]string{
		time.Second: "1s", time.Minute: "1m", 90 * time.Minute: "90m", 24 * time.Hour: "24h",
		1500 * time.Millisecond: "1500ms", 0: "0s", 1500 * time.Microsecond: "1.5ms",
	} {
		if got := Duration(in).String(); got != want {
			t.Errorf("Duration(%v).String() = %q, want %q", in, got, want)
		}
	}
}

// TestCheckFloors: a coordinated global rule in which some region could
// never hold one whole token, however the rest is shared, is refused naming
// min_share, with a min_share that would pass; the others pass.
func TestCheckFloors(t *testing.T) {
	two := map[string]float64{"us-east": 1, "eu-west": 1}
	g := func(capacity int64, minShare float64, regions map[string]float64) Rule {
		r := tokenRule()
		r.Scope, r.Capacity, r.MinShare, r.Regions = Global, capacity, minShare, regions
		return r
	}
	window := func(limit int64, minShare float64) Rule {
		r := windowRule()
		r.Scope, r.Limit, r.MinShare, r.Regions = Global, limit, minShare, two
		return r
	}
	uneven := map[string]float64{"a": 100, "b": 1}
	for _, tc := range []struct {
		name string
		r    Rule
		want string // "" when it passes; else in the message
	}{
		{"capacity 1, min_share 0.1", g(1, 0.1, two), "at most 0.95 of a token of the capacity of 1"},
		{"capacity 1, min_share 0", g(1, 0, two), ""},
		{"capacity 1, one region", g(1, 0.5, map[string]float64{"us-east": 1}), ""},
		{"capacity 2, static split", g(2, 1, two), ""},
		{"the README's example", globalRule(), ""},
		{"a region of a tiny weight, static split", g(50, 1, uneven), "region b"},
		{"a region of a tiny weight, some floor", g(50, 0.5, uneven), ""},
		{"window of 1, min_share 0.2", window(1, 0.2), "limit of 1"},
		{"window of 10, min_share 0.2", window(10, 0.2), ""},
		{"regional", tokenRule(), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.r.Validate(); err != nil {
				t.Fatalf("Validate: %v (CheckFloors is for valid rules)", err)
			}
			err := tc.r.CheckFloors()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Field != "min_share" || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want a min_share FieldError with %q", err, tc.want)
			}
			t.Log(err)
		})
	}
	// The min_share the message offers passes.
	r := g(50, 1, uneven)
	err := r.CheckFloors()
	i := strings.Index(err.Error(), "below ")
	if i < 0 {
		t.Fatalf("no min_share offered: %v", err)
	}
	var below float64
	if _, serr := fmt.Sscanf(err.Error()[i:], "below %g", &below); serr != nil || below <= 0 {
		t.Fatalf("%v: %v", err, serr)
	}
	r.MinShare = below * 0.999
	if err := r.CheckFloors(); err != nil {
		t.Fatalf("min_share %v, just below what the message offered: %v", r.MinShare, err)
	}
	r.MinShare = math.Min(1, below*1.01)
	if err := r.CheckFloors(); err == nil {
		t.Fatalf("min_share %v, above what the message offered, passed", r.MinShare)
	}
}

// A name with a character outside [A-Za-z0-9_.-] is refused naming the
// character (the whole rune, not a byte of it) and its byte offset.
func TestNameErrorNamesTheRune(t *testing.T) {
	for _, tc := range []struct{ id, want string }{
		{"ordérs", `"ordérs" has character 'é' (U+00E9) at byte offset 3`},
		{"a b", `"a b" has character ' ' (U+0020) at byte offset 1`},
		{"日本", `"日本" has character '日' (U+65E5) at byte offset 0`},
		{"x\xffy", `"x\xffy" has the byte 0xff, which is not UTF-8, at byte offset 1`},
	} {
		r := Rule{ID: tc.id, Algorithm: TokenBucket, Capacity: 1, RefillPerSecond: 1}
		err := r.Validate()
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != "id" || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("id %q: %v, want an id error containing %s", tc.id, err, tc.want)
		}
	}
}
