package envoy_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/regional/envoy"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/envoyconfig"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The tests in this file run envoyproxy/ratelimit's own configurations
// (rules/envoyconfig/testdata/envoyproxy) through the import and this
// service, and expect the answers envoyproxy/ratelimit's integration tests
// and end-to-end scripts expect.

func imported(t testing.TB, files ...string) []rules.Rule {
	t.Helper()
	var out []rules.Rule
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join("..", "..", "rules", "envoyconfig", "testdata", "envoyproxy", f))
		if err != nil {
			t.Fatal(err)
		}
		rs, err := envoyconfig.Convert(b, envoyconfig.IgnoreMetadata()) // example.yaml has metadata for Envoy's routing
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		out = append(out, rs...)
	}
	return out
}

// inOneWindow waits, when less than margin is left of the current minute,
// for the next one: the imported rules are fixed windows aligned to the
// epoch, and a test's requests must not straddle a window's end.
func inOneWindow(t testing.TB, margin time.Duration) {
	t.Helper()
	now := time.Now()
	if left := time.Minute - now.Sub(now.Truncate(time.Minute)); left < margin {
		time.Sleep(left + 50*time.Millisecond)
	}
}

func request(domain string, ds ...*ratelimitv3.RateLimitDescriptor) *rlsv3.RateLimitRequest {
	return &rlsv3.RateLimitRequest{Domain: domain, Descriptors: ds, HitsAddend: 1}
}

// wantStatus checks one descriptor status against envoyproxy/ratelimit's
// expectation (its newDescriptorStatus): code, requests_per_unit, unit and
// limit_remaining, and a duration_until_reset within the unit.
func wantStatus(t *testing.T, what string, st *rlsv3.RateLimitResponse_DescriptorStatus, code rlsv3.RateLimitResponse_Code,
	rpu uint32, unit rlsv3.RateLimitResponse_RateLimit_Unit, remaining uint32) {
	t.Helper()
	cl := st.GetCurrentLimit()
	if st.GetCode() != code || cl.GetRequestsPerUnit() != rpu || cl.GetUnit() != unit || st.GetLimitRemaining() != remaining {
		t.Errorf("%s: %v %d/%v remaining %d, want %v %d/%v remaining %d", what, st.GetCode(), cl.GetRequestsPerUnit(), cl.GetUnit(),
			st.GetLimitRemaining(), code, rpu, unit, remaining)
	}
	secs := map[rlsv3.RateLimitResponse_RateLimit_Unit]float64{rlsv3.RateLimitResponse_RateLimit_SECOND: 1,
		rlsv3.RateLimitResponse_RateLimit_MINUTE: 60, rlsv3.RateLimitResponse_RateLimit_HOUR: 3600, rlsv3.RateLimitResponse_RateLimit_DAY: 86400}[unit]
	if d := st.GetDurationUntilReset().AsDuration().Seconds(); d <= 0 || d > secs {
		t.Errorf("%s: duration_until_reset %vs, want in (0, %v]", what, d, secs)
	}
}

// TestEnvoyproxyIntegration follows envoyproxy/ratelimit's integration test
// (test/integration/integration_test.go, testBasicBaseConfig) on its
// configurations basic.yaml and another.yaml.
func TestEnvoyproxyIntegration(t *testing.T) {
	e := newEnv(t, imported(t, "integration_basic.yaml", "integration_another.yaml"))
	inOneWindow(t, 10*time.Second)
	const (
		second = rlsv3.RateLimitResponse_RateLimit_SECOND
		minute = rlsv3.RateLimitResponse_RateLimit_MINUTE
		hour   = rlsv3.RateLimitResponse_RateLimit_HOUR
		day    = rlsv3.RateLimitResponse_RateLimit_DAY
	)
	// A domain without configuration: OK, no limit.
	resp := e.ask(t, request("foo", desc("hello", "world")))
	if resp.OverallCode != ok || resp.Statuses[0].Code != ok || resp.Statuses[0].CurrentLimit != nil || resp.Statuses[0].LimitRemaining != 0 {
		t.Errorf("foo hello=world: %v, want OK without a limit", resp)
	}
	// key1=foo: 50/SECOND, 49 left; current_limit names the rule.
	resp = e.ask(t, request("basic", desc("key1", "foo")))
	wantStatus(t, "basic key1=foo", resp.Statuses[0], ok, 50, second, 49)
	if n := resp.Statuses[0].GetCurrentLimit().GetName(); n != "basic.key1" {
		t.Errorf("current_limit.name %q, want the rule id basic.key1", n)
	}
	// A random key2 value, 25 times against 20/MINUTE.
	v := fmt.Sprint(rand.Int())
	for i := range 25 {
		resp := e.ask(t, request("another", desc("key2", v)))
		code, remaining := ok, uint32(20-(i+1))
		if i >= 20 {
			code, remaining = overLimit, 0
		}
		if resp.OverallCode != code {
			t.Errorf("key2 #%d: overall %v, want %v", i+1, resp.OverallCode, code)
		}
		wantStatus(t, fmt.Sprintf("key2 #%d", i+1), resp.Statuses[0], code, 20, minute, remaining)
	}
	// Two keys in one request: key2 (20/MINUTE) keeps counting while key3
	// (10/HOUR) is over limit, as envoyproxy/ratelimit's default does.
	v = fmt.Sprint(rand.Int())
	for i := range 15 {
		resp := e.ask(t, request("another", desc("key2", v), desc("key3", v)))
		code, remaining2 := ok, uint32(10-(i+1))
		if i >= 10 {
			code, remaining2 = overLimit, 0
		}
		if resp.OverallCode != code {
			t.Errorf("key2+key3 #%d: overall %v, want %v", i+1, resp.OverallCode, code)
		}
		wantStatus(t, fmt.Sprintf("key2+key3 #%d: key2", i+1), resp.Statuses[0], ok, 20, minute, uint32(20-(i+1)))
		wantStatus(t, fmt.Sprintf("key2+key3 #%d: key3", i+1), resp.Statuses[1], code, 10, hour, remaining2)
	}
	// key4: 20/DAY.
	resp = e.ask(t, request("another", desc("key4", "durTest")))
	wantStatus(t, "key4", resp.Statuses[0], ok, 20, day, 19)
}

// example is a client of envoyproxy/ratelimit's example Envoy (its
// examples/envoy/proxy.yaml): a route's rate_limits, each a list of
// request headers that become one descriptor when all are present.
type example struct {
	t *testing.T
	e *env
}

var routes = map[string][][]string{
	"/twoheader":  {{"foo", "bar"}, {"foo", "baz"}},
	"/fourheader": {{"foo", "bar"}, {"source_cluster", "destination_cluster"}},
	"/fiveheader": {{"foo", "bar"}, {"source_cluster", "destination_cluster"}, {"category"}},
	"/unspec":     {{"unspec"}},
	"/header":     {{"foo"}},
}

// get sends the request Envoy would send for route and headers (key=value
// pairs), and reports whether Envoy would let it through.
func (x example) get(route string, kv ...string) (bool, *rlsv3.RateLimitResponse) {
	x.t.Helper()
	h := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		h[kv[i]] = kv[i+1]
	}
	req := &rlsv3.RateLimitRequest{Domain: "rl", HitsAddend: 1}
actions:
	for _, keys := range routes[route] {
		d := &ratelimitv3.RateLimitDescriptor{}
		for _, k := range keys {
			v, ok := h[k]
			if !ok {
				continue actions // Envoy skips a descriptor whose header is missing
			}
			d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: k, Value: v})
		}
		req.Descriptors = append(req.Descriptors, d)
	}
	resp := x.e.ask(x.t, req)
	return resp.OverallCode == ok, resp
}

// expect checks a sequence of calls to one route: true for let through.
func (x example) expect(what, route string, want []bool, kv ...string) {
	x.t.Helper()
	for i, w := range want {
		if got, resp := x.get(route, kv...); got != w {
			x.t.Errorf("%s, call %d: let through %v, want %v (%v)", what, i+1, got, w, resp)
		}
	}
}

// TestEnvoyproxyReplaces follows envoyproxy/ratelimit's end-to-end script
// integration-test/scripts/replaces.sh on its example configuration.
func TestEnvoyproxyReplaces(t *testing.T) {
	x := example{t, newEnv(t, imported(t, "examples_example.yaml"), envoy.WithResponseHeaders(true))}
	inOneWindow(t, 10*time.Second)
	// replaces raises a limit: (foo, bar=banned) is 0/min, named banned_limit;
	// (source_cluster=proxy, destination_cluster=override) replaces it, 2/min.
	x.expect("banned", "/twoheader", []bool{false}, "foo", "bkthomps", "bar", "banned")
	x.expect("banned with mock", "/fourheader", []bool{false}, "foo", "bkthomps", "bar", "banned", "source_cluster", "proxy", "destination_cluster", "mock")
	x.expect("banned replaced by override", "/fourheader", []bool{true, true, false}, "foo", "bkthomps", "bar", "banned", "source_cluster", "proxy", "destination_cluster", "override")
	// replaces does not change the replaced limit: (foo, bar=bkthomps) is
	// 1/min, named bkthomps; (proxy, destination_cluster=bkthomps) replaces it, 2/min.
	x.expect("bkthomps replaced", "/fourheader", []bool{true, true, false}, "foo", "my_foo", "bar", "bkthomps", "source_cluster", "proxy", "destination_cluster", "bkthomps")
	x.expect("bkthomps not replaced", "/fourheader", []bool{true, false}, "foo", "my_foo", "bar", "bkthomps", "source_cluster", "proxy", "destination_cluster", "not_bkthomps")
	x.expect("bkthomps replaced again", "/fourheader", []bool{false}, "foo", "my_foo", "bar", "bkthomps", "source_cluster", "proxy", "destination_cluster", "bkthomps")
	// One limit replaces several: (category=account) replaces bkthomps and fake_name, 4/min.
	five := []string{"foo", "my_foo", "bar", "bkthomps", "source_cluster", "proxy", "destination_cluster", "fake", "category", "account"}
	x.expect("category replaces two", "/fiveheader", []bool{true, true, true, true, false}, five...)
	x.expect("bkthomps alone", "/twoheader", []bool{true, false}, "foo", "foo_2", "bar", "bkthomps")
	x.expect("fake_name alone", "/fourheader", []bool{true, true, false}, "foo", "foo_3", "bar", "bar_3", "source_cluster", "proxy", "destination_cluster", "fake")
	x.expect("category exhausted", "/fiveheader", []bool{false}, five...)

	// The banned limit's answer: 0/MINUTE, and waiting cannot help, so no
	// retry-after, and a body saying why.
	_, resp := x.get("/twoheader", "foo", "z", "bar", "banned")
	st := resp.Statuses[0]
	if st.Code != overLimit || st.GetCurrentLimit().GetRequestsPerUnit() != 0 || st.GetCurrentLimit().GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE {
		t.Errorf("banned: %v, want OVER_LIMIT with 0/MINUTE", st)
	}
	if h := headers(resp); h["retry-after"] != "" || h["x-ratelimit-limit"] != "0" || !strings.Contains(string(resp.RawBody), "waiting cannot help") {
		t.Errorf("banned: headers %v body %q, want limit 0, no retry-after, a body saying waiting cannot help", h, resp.RawBody)
	}
}

// TestEnvoyproxyScripts follows envoyproxy/ratelimit's other end-to-end
// scripts on its example configuration: trigger-ratelimit.sh,
// trigger-shadow-mode-key.sh, value-included-in-stats-key-when-unspecified.sh,
// quota.sh and simple-get.sh, and its unlimited descriptors.
func TestEnvoyproxyScripts(t *testing.T) {
	x := example{t, newEnv(t, imported(t, "examples_example.yaml"), envoy.WithResponseHeaders(true))}
	inOneWindow(t, 10*time.Second)
	x.expect("simple get", "/twoheader", []bool{true}, "foo", "test", "baz", "shady")
	// (foo, baz=not-so-shady): 3/min.
	x.expect("trigger rate limit", "/twoheader", []bool{true, true, true, false, false}, "foo", "pelle", "baz", "not-so-shady")
	// (foo, baz=shady): 3/min in shadow mode: never limits, and as the only
	// match, it puts no limit headers on the response.
	for i := range 6 {
		through, resp := x.get("/twoheader", "foo", "pelle", "baz", "shady")
		if !through || len(resp.ResponseHeadersToAdd) != 0 || resp.Statuses[0].CurrentLimit != nil {
			t.Errorf("shadow, call %d: %v, want OK without headers or current_limit", i+1, resp)
		}
	}
	// (unspec): 2/min, one counter per value.
	x.expect("unspec", "/unspec", []bool{true, true, false}, "unspec", "unspecified_value")
	x.expect("unspec, another value", "/unspec", []bool{true}, "unspec", "another_value")
	// (foo) alone: 2/min; (foo, bay): unlimited; (qux): unlimited.
	x.expect("foo alone", "/header", []bool{true, true, false}, "foo", "alone")
	for i := range 5 {
		resp := x.e.ask(t, request("rl", desc("foo", "f", "bay", "b"), desc("qux", "q")))
		for j, st := range resp.Statuses {
			if st.Code != ok || st.LimitRemaining != math.MaxUint32 || st.CurrentLimit != nil {
				t.Errorf("unlimited, call %d, descriptor %d: %v, want OK with limit_remaining 4294967295", i+1, j, st)
			}
		}
	}
	// quota.sh: (service=service_1) 1/min and (service=service_2) 2/min in
	// quota mode: the request is over limit only when both are.
	quota := request("rl", desc("service", "service_1"), desc("service", "service_2"))
	for i, want := range []rlsv3.RateLimitResponse_Code{ok, ok, overLimit} {
		resp := x.e.ask(t, quota)
		if resp.OverallCode != want {
			t.Errorf("quota, call %d: %v, want %v", i+1, resp, want)
		}
		if i == 1 && (resp.Statuses[0].Code != overLimit || resp.Statuses[1].Code != ok) {
			t.Errorf("quota, call 2: statuses %v, want service_1 over limit and service_2 OK", resp.Statuses)
		}
		if h := headers(resp); i == 1 && (h["retry-after"] != "" || h["x-ratelimit-remaining"] != "0") {
			t.Errorf("quota, call 2 (let through): headers %v, want service_2's, without retry-after", h)
		}
	}
	// (foo, baz=other): the key-only baz under foo, 1/second.
	_, resp := x.get("/twoheader", "foo", "f", "baz", "other")
	wantStatus(t, "foo+baz=other", resp.Statuses[0], ok, 1, rlsv3.RateLimitResponse_RateLimit_SECOND, 0)
}

// TestEnvoyproxyShareThreshold follows envoyproxy/ratelimit's integration
// test of share_threshold (testShareThreshold, share_threshold.yaml): the
// values a shared wildcard matches count in one bucket, the others each in
// their own.
func TestEnvoyproxyShareThreshold(t *testing.T) {
	e := newEnv(t, imported(t, "integration_share_threshold.yaml"))
	inOneWindow(t, 5*time.Second) // within one hour
	const hour = rlsv3.RateLimitResponse_RateLimit_HOUR
	for i := range 10 {
		resp := e.ask(t, request("share-threshold-test", desc("files", "files/a.pdf")))
		wantStatus(t, fmt.Sprintf("files/a.pdf #%d", i+1), resp.Statuses[0], ok, 10, hour, uint32(9-i))
	}
	resp := e.ask(t, request("share-threshold-test", desc("files", "files/b.csv")))
	if resp.OverallCode != overLimit {
		t.Errorf("files/b.csv: %v, want OVER_LIMIT (shares files/*)", resp.OverallCode)
	}
	wantStatus(t, "files/b.csv", resp.Statuses[0], overLimit, 10, hour, 0)
	for i := range 10 {
		resp := e.ask(t, request("share-threshold-test", desc("files_no_share", fmt.Sprintf("files_no_share/%d-%d", i, rand.Int()))))
		wantStatus(t, fmt.Sprintf("files_no_share #%d", i+1), resp.Statuses[0], ok, 10, hour, 9)
	}
}

// TestCostAboveMaximumWhereALimitApplies: a hits_addend above --max-cost
// makes a descriptor OVER_LIMIT only where a limit applies to it, as
// envoyproxy/ratelimit counts hits_addend only against the limits that
// apply: a shadow-mode limit, a replaced one and no limit at all are OK.
func TestCostAboveMaximumWhereALimitApplies(t *testing.T) {
	e := newEnv(t, imported(t, "examples_example.yaml"))
	inOneWindow(t, 10*time.Second)
	big := func(d *ratelimitv3.RateLimitDescriptor) *ratelimitv3.RateLimitDescriptor {
		d.HitsAddend = wrapperspb.UInt64(1500)
		return d
	}
	for _, tc := range []struct {
		name string
		req  *rlsv3.RateLimitRequest
		want []rlsv3.RateLimitResponse_Code
	}{
		{"shadow mode", request("rl", big(desc("foo", "a", "baz", "shady"))), []rlsv3.RateLimitResponse_Code{ok}},
		{"no limit", request("elsewhere", big(desc("a", "b"))), []rlsv3.RateLimitResponse_Code{ok}},
		{"replaced", request("rl", big(desc("foo", "b", "bar", "bkthomps")), desc("category", "account")), []rlsv3.RateLimitResponse_Code{ok, ok}},
		{"enforced", request("rl", big(desc("foo", "c", "baz", "not-so-shady"))), []rlsv3.RateLimitResponse_Code{overLimit}},
		{"replacing", request("rl", desc("foo", "d", "bar", "bkthomps"), big(desc("category", "account"))), []rlsv3.RateLimitResponse_Code{ok, overLimit}},
	} {
		resp := e.ask(t, tc.req)
		for i, want := range tc.want {
			if got := resp.Statuses[i].Code; got != want {
				t.Errorf("%s: descriptor %d is %v, want %v (%v)", tc.name, i, got, want, resp)
			}
		}
		if refused := strings.Contains(string(resp.RawBody), "is above the maximum of 1000"); refused != slices.Contains(tc.want, overLimit) {
			t.Errorf("%s: body %q, want the cost's refusal only where a descriptor is over limit", tc.name, resp.RawBody)
		}
	}
	// The refused cost took nothing: foo=c's 3/min are all there.
	for i := range 3 {
		if resp := e.ask(t, request("rl", desc("foo", "c", "baz", "not-so-shady"))); resp.OverallCode != ok {
			t.Fatalf("not-so-shady (3/min), call %d: %v, want OK", i+1, resp)
		}
	}
}
