package envoy_test

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
)

// The tests in this file send descriptors that envoyproxy/ratelimit
// accepts but that do not fit the enforcer's limits as they are (a part
// over 1024 bytes, a client key over 256, more than 64 attributes): each is
// answered and limited on its own, and never fails the call, which would
// let Envoy (failure_mode_deny: false) pass the request unlimited, the
// other descriptors' limits included.

// hashedForm is the documented form of an over-long part: "sha256:" and
// the hex SHA-256 of it.
func hashedForm(s string) string {
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// withEntries is a descriptor of remote_address=ip, path=path and then
// e<i>=v entries up to n entries in all.
func withEntries(ip, path string, n int) *ratelimitv3.RateLimitDescriptor {
	d := desc("remote_address", ip, "path", path)
	for i := len(d.Entries); i < n; i++ {
		d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: fmt.Sprintf("e%d", i), Value: "v"})
	}
	return d
}

// answer is env.ask with a failure message that fits a screen: these
// requests are large.
func (e *env) answer(t *testing.T, in *rlsv3.RateLimitRequest) *rlsv3.RateLimitResponse {
	t.Helper()
	resp, err := e.call(in)
	if err != nil {
		t.Fatalf("ShouldRateLimit: %.300v", err)
	}
	if len(resp.GetStatuses()) != len(in.GetDescriptors()) {
		t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), len(in.GetDescriptors()))
	}
	return resp
}

func slidingLog(id string, match map[string]string, key ...string) rules.Rule {
	return rules.Rule{ID: id, Match: match, Key: key, Algorithm: rules.SlidingLog, Limit: 1, Window: rules.Duration(time.Hour)}
}

// TestOverLongDescriptorIsLimited sends, in one call, a client's per-IP
// descriptor and a descriptor that once failed the whole call: both are
// answered and limited, the second call of each is over limit.
func TestOverLongDescriptorIsLimited(t *testing.T) {
	e := newEnv(t, []rules.Rule{
		// The per-IP limit: the descriptor without a path (its resource is the domain).
		slidingLog("per-ip", map[string]string{"resource": "edge2"}, "client_key"),
		// A limit per client and resource on every descriptor with a path.
		slidingLog("per-path", map[string]string{"domain": "edge2", "path": "*"}, "client_key", "resource"),
	})
	long := strings.Repeat("a", 1100)
	tests := []struct {
		name string
		ip   string
		big  func(ip string) *ratelimitv3.RateLimitDescriptor
	}{
		{"the report: a 1127-byte path", "198.51.100.9", func(ip string) *ratelimitv3.RateLimitDescriptor {
			return desc("remote_address", ip, "path", "/index.html?q="+long)
		}},
		{"a 1019-byte path: a 1025-byte resource", "198.51.100.10", func(ip string) *ratelimitv3.RateLimitDescriptor {
			return desc("remote_address", ip, "path", "/"+strings.Repeat("p", 1018))
		}},
		{"a 1018-byte path: a 1024-byte resource", "198.51.100.17", func(ip string) *ratelimitv3.RateLimitDescriptor {
			return desc("remote_address", ip, "path", "/"+strings.Repeat("p", 1017))
		}},
		{"a 1024-byte path", "198.51.100.11", func(ip string) *ratelimitv3.RateLimitDescriptor {
			return desc("remote_address", ip, "path", "/"+strings.Repeat("p", 1023))
		}},
		{"a 1100-byte resource entry", "198.51.100.12", func(ip string) *ratelimitv3.RateLimitDescriptor {
			return desc("remote_address", ip, "path", "/r", "resource", long)
		}},
		{"a 1100-byte entry key", "198.51.100.13", func(ip string) *ratelimitv3.RateLimitDescriptor {
			return desc("remote_address", ip, "path", "/k", long, "v")
		}},
		{"a 1024-byte entry key", "198.51.100.14", func(ip string) *ratelimitv3.RateLimitDescriptor {
			return desc("remote_address", ip, "path", "/k", long[:1024], "v")
		}},
		{"a 1100-byte value", "198.51.100.15", func(ip string) *ratelimitv3.RateLimitDescriptor {
			return desc("remote_address", ip, "path", "/v", "tier", long)
		}},
		{"a 300-byte client key", "198.51.100.16", func(ip string) *ratelimitv3.RateLimitDescriptor {
			return desc("remote_address", ip+strings.Repeat("x", 300), "path", "/c")
		}},
		{"62 entries (64 attributes)", "198.51.100.62", func(ip string) *ratelimitv3.RateLimitDescriptor { return withEntries(ip, "/many", 62) }},
		{"63 entries", "198.51.100.63", func(ip string) *ratelimitv3.RateLimitDescriptor { return withEntries(ip, "/many", 63) }},
		{"64 entries", "198.51.100.64", func(ip string) *ratelimitv3.RateLimitDescriptor { return withEntries(ip, "/many", 64) }},
		{"65 entries", "198.51.100.65", func(ip string) *ratelimitv3.RateLimitDescriptor { return withEntries(ip, "/many", 65) }},
		{"1000 entries", "198.51.100.100", func(ip string) *ratelimitv3.RateLimitDescriptor { return withEntries(ip, "/many", 1000) }},
		{"all at once: 100 entries, long keys, values and path", "198.51.100.200", func(ip string) *ratelimitv3.RateLimitDescriptor {
			d := withEntries(ip, "/all?q="+long, 100)
			d.Entries = append(d.Entries, desc(long, long, long+"b", long).Entries...)
			return d
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := &rlsv3.RateLimitRequest{Domain: "edge2", Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("remote_address", tc.ip), tc.big(tc.ip)}}
			resp := e.answer(t, req)
			for i, rule := range []string{"per-ip", "per-path"} {
				if st := resp.Statuses[i]; st.Code != ok || st.GetCurrentLimit().GetName() != rule {
					t.Errorf("first call, descriptor %d: %v, want OK under %s", i, st, rule)
				}
			}
			resp = e.answer(t, req)
			if resp.OverallCode != overLimit {
				t.Errorf("second call: %v, want OVER_LIMIT", resp.OverallCode)
			}
			for i, rule := range []string{"per-ip", "per-path"} {
				if st := resp.Statuses[i]; st.Code != overLimit || st.GetCurrentLimit().GetName() != rule {
					t.Errorf("second call, descriptor %d: %v, want OVER_LIMIT under %s", i, st, rule)
				}
			}
		})
	}
	t.Run("a long domain", func(t *testing.T) {
		// The domain is the resource (hashed) and the domain attribute
		// (hashed): a rule on another attribute still applies.
		e := newEnv(t, []rules.Rule{slidingLog("gold", map[string]string{"tier": "gold"}, "client_key")})
		req := &rlsv3.RateLimitRequest{Domain: long, Descriptors: []*ratelimitv3.RateLimitDescriptor{
			desc("remote_address", "198.51.100.9", "tier", "gold"), desc("remote_address", "198.51.100.9", "path", "/")}}
		if resp := e.answer(t, req); resp.OverallCode != ok || resp.Statuses[0].GetCurrentLimit().GetName() != "gold" {
			t.Errorf("first call: %v, want OK under gold", resp)
		}
		if resp := e.answer(t, req); resp.OverallCode != overLimit || resp.Statuses[0].Code != overLimit || resp.Statuses[1].Code != ok {
			t.Errorf("second call: %v, want descriptor 0 OVER_LIMIT, 1 OK (no rule)", resp)
		}
	})
}

// TestOverLongPartsKeepTheirOwnBuckets: two long values that differ get
// two buckets, and a client that sends the hashed form of a long value
// does not share its bucket nor match a rule written for it.
func TestOverLongPartsKeepTheirOwnBuckets(t *testing.T) {
	longPath := "/index.html?q=" + strings.Repeat("a", 1100)
	longKey := strings.Repeat("k", 300)
	longTier := strings.Repeat("t", 1100)
	e := newEnv(t, []rules.Rule{
		slidingLog("per-path", map[string]string{"domain": "edge2", "path": "*"}, "client_key", "resource"),
		// Rules written for the documented hashed forms.
		slidingLog("long-resource", map[string]string{"resource": hashedForm("edge2 " + longPath)}, "client_key"),
		slidingLog("long-tier", map[string]string{"tier": hashedForm(longTier)}, "client_key"),
		slidingLog("per-key", map[string]string{"resource": "keys"}, "client_key"),
	})
	call := func(name string, want rlsv3.RateLimitResponse_Code, rule string, d *ratelimitv3.RateLimitDescriptor) {
		t.Helper()
		resp := e.answer(t, &rlsv3.RateLimitRequest{Domain: "edge2", Descriptors: []*ratelimitv3.RateLimitDescriptor{d}})
		if st := resp.Statuses[0]; st.Code != want || st.GetCurrentLimit().GetName() != rule {
			t.Errorf("%s: %v, want %v under %q", name, st, want, rule)
		}
	}
	// The resource: a rule on its hashed form applies; the second call is over.
	call("long path", ok, "long-resource", desc("remote_address", "10.0.0.1", "path", longPath))
	call("long path again", overLimit, "long-resource", desc("remote_address", "10.0.0.1", "path", longPath))
	// Another long path (one byte differs): its own bucket.
	call("another long path", ok, "per-path", desc("remote_address", "10.0.0.1", "path", longPath[:len(longPath)-1]+"b"))
	// The hashed form sent as a resource is not the long resource.
	call("hashed form sent as the resource", ok, "", desc("remote_address", "10.0.0.1", "resource", hashedForm("edge2 "+longPath)))
	call("hashed form sent as the resource, again", ok, "", desc("remote_address", "10.0.0.1", "resource", hashedForm("edge2 "+longPath)))
	// An attribute value: likewise.
	call("long tier", ok, "long-tier", desc("remote_address", "10.0.0.2", "tier", longTier))
	call("long tier again", overLimit, "long-tier", desc("remote_address", "10.0.0.2", "tier", longTier))
	call("hashed form sent as the tier", ok, "", desc("remote_address", "10.0.0.2", "tier", hashedForm(longTier)))
	// A client key: the hashed form of a long one is another client.
	call("long api key", ok, "per-key", desc("api_key", longKey, "resource", "keys"))
	call("long api key again", overLimit, "per-key", desc("api_key", longKey, "resource", "keys"))
	call("hashed form sent as the api key", ok, "per-key", desc("api_key", hashedForm(longKey), "resource", "keys"))
	call("another long api key", ok, "per-key", desc("api_key", longKey[1:]+"x", "resource", "keys"))
}

// TestTooManyAttributes: a descriptor whose entries are more attributes
// than one check takes is checked with those its matching rules read, rule
// by rule in id order; a rule that does not fit beside the others is not
// applied, and a descriptor to which no rule can be applied is OK without
// current_limit, as one no rule matches. The call never fails, and the
// client's per-IP descriptor in it is limited.
func TestTooManyAttributes(t *testing.T) {
	keys := func(prefix string, n int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprintf("%s%02d", prefix, i)] = "*"
		}
		return m
	}
	with := func(ip string, prefixes ...string) *ratelimitv3.RateLimitDescriptor {
		d := desc("remote_address", ip, "path", "/big")
		for _, p := range prefixes {
			for i := range 65 {
				d.Entries = append(d.Entries, desc(fmt.Sprintf("%s%02d", p, i), "v").Entries...)
			}
		}
		return d
	}
	e := newEnv(t, []rules.Rule{
		slidingLog("per-ip", map[string]string{"resource": "fit"}, "client_key"),
		slidingLog("a-wide", keys("a", 65), "client_key"), // more match keys than a check takes attributes
		slidingLog("b-half", keys("b", 40), "client_key"),
		slidingLog("c-half", keys("c", 40), "client_key"),
	})
	tests := []struct {
		name   string
		ip     string
		big    *ratelimitv3.RateLimitDescriptor
		rule   string // the rule that limits big; "": none can
		second rlsv3.RateLimitResponse_Code
	}{
		{"only a rule reading 65 attributes matches: OK, no limit", "10.1.0.1", with("10.1.0.1", "a"), "", ok},
		{"two rules reading 80: the first by id applies", "10.1.0.2", with("10.1.0.2", "b", "c"), "b-half", overLimit},
		{"one rule reading 40 among 67 entries", "10.1.0.3", with("10.1.0.3", "c"), "c-half", overLimit},
		{"a, b and c: b-half applies", "10.1.0.4", with("10.1.0.4", "a", "b", "c"), "b-half", overLimit},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := &rlsv3.RateLimitRequest{Domain: "fit", Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("remote_address", tc.ip), tc.big}}
			for n, want := range []rlsv3.RateLimitResponse_Code{ok, tc.second} {
				resp := e.answer(t, req)
				if st := resp.Statuses[1]; st.Code != want || st.GetCurrentLimit().GetName() != tc.rule {
					t.Errorf("call %d: big descriptor %v, want %v under %q", n+1, st, want, tc.rule)
				}
				if st := resp.Statuses[0]; st.Code != []rlsv3.RateLimitResponse_Code{ok, overLimit}[n] || st.GetCurrentLimit().GetName() != "per-ip" {
					t.Errorf("call %d: per-IP descriptor %v, want it limited by per-ip", n+1, st)
				}
			}
		})
	}
}
