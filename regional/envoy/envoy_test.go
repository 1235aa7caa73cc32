package envoy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/enforcerd"
	"github.com/apportion/apportion/regional/envoy"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

const (
	ok        = rlsv3.RateLimitResponse_OK
	overLimit = rlsv3.RateLimitResponse_OVER_LIMIT
)

// env is one enforcer over a real redis-server, with the Envoy service on
// the enforcer's own gRPC server on loopback.
type env struct {
	redis  *testutil.Redis
	client rlsv3.RateLimitServiceClient
	enf    *regional.Enforcer
	addr   string // the gRPC server: ratelimit.v1 and Envoy's service
}

func newEnv(t testing.TB, rs []rules.Rule, opts ...envoy.Option) *env {
	t.Helper()
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	r := testutil.StartRedis(t)
	rc := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{r.Addr}, DialTimeout: 200 * time.Millisecond,
		ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond, MaxRetries: -1})
	t.Cleanup(func() { rc.Close() })
	st, err := redisstore.New(rc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	cfg := regional.DefaultConfig()
	cfg.Region = "us-east"
	// Generous: the CI machine is small and shared, and a first call pays
	// for the connection and the script load. Outage tests set their own.
	cfg.Timeout = time.Second
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelError}))
	enf, err := regional.New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	for i := range rs {
		rs[i].Normalize()
		if err := rs[i].Validate(); err != nil {
			t.Fatal(err)
		}
	}
	if err := enf.SetRules(rs); err != nil {
		t.Fatal(err)
	}
	gs, _ := regional.NewGRPCServer(enf)
	envoy.Register(gs, enf, opts...)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(l)
	t.Cleanup(gs.Stop)
	return &env{redis: r, client: dial(t, l.Addr().String()), enf: enf, addr: l.Addr().String()}
}

func dial(t testing.TB, addr string) rlsv3.RateLimitServiceClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return rlsv3.NewRateLimitServiceClient(conn)
}

// desc builds a descriptor from key, value pairs.
func desc(kv ...string) *ratelimitv3.RateLimitDescriptor {
	d := &ratelimitv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

func (e *env) ask(t *testing.T, in *rlsv3.RateLimitRequest) *rlsv3.RateLimitResponse {
	t.Helper()
	resp, err := e.call(in)
	if err != nil {
		t.Fatalf("ShouldRateLimit(%v): %v", in, err)
	}
	if len(resp.GetStatuses()) != len(in.GetDescriptors()) {
		t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), len(in.GetDescriptors()))
	}
	return resp
}

func (e *env) call(in *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return e.client.ShouldRateLimit(ctx, in)
}

func tokenBucket(id, resource string, capacity int64, refill float64) rules.Rule {
	return rules.Rule{ID: id, Match: map[string]string{"resource": resource}, Algorithm: rules.TokenBucket,
		Capacity: capacity, RefillPerSecond: refill}
}

func TestTokenBucketAllowedThenOverLimit(t *testing.T) {
	// Capacity 5, refill 0.5/s: the period (refill from empty) is 10s, so
	// current_limit is the capacity per the shortest unit that holds the
	// period: 5/MINUTE (limit_remaining never above it).
	e := newEnv(t, []rules.Rule{tokenBucket("orders", "edge /orders", 5, 0.5)})
	req := &rlsv3.RateLimitRequest{Domain: "edge",
		Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("remote_address", "10.0.0.1", "path", "/orders")}}
	for i := range 5 {
		resp := e.ask(t, req)
		st := resp.Statuses[0]
		if resp.OverallCode != ok || st.Code != ok {
			t.Fatalf("request %d: %v, want OK", i+1, resp)
		}
		if st.LimitRemaining != uint32(4-i) {
			t.Errorf("request %d: limit_remaining %d, want %d", i+1, st.LimitRemaining, 4-i)
		}
		cl := st.GetCurrentLimit()
		if cl.GetName() != "orders" || cl.GetRequestsPerUnit() != 5 || cl.GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE {
			t.Errorf("request %d: current_limit %v, want orders 5/MINUTE", i+1, cl)
		}
		if st.LimitRemaining > cl.GetRequestsPerUnit() {
			t.Errorf("request %d: limit_remaining %d above requests_per_unit %d", i+1, st.LimitRemaining, cl.GetRequestsPerUnit())
		}
		if d := st.GetDurationUntilReset().AsDuration(); d <= 0 || d > 10*time.Second {
			t.Errorf("request %d: duration_until_reset %v, want in (0, 10s]", i+1, d)
		}
	}
	resp := e.ask(t, req)
	st := resp.Statuses[0]
	if resp.OverallCode != overLimit || st.Code != overLimit || st.LimitRemaining != 0 {
		t.Fatalf("6th request: %v, want OVER_LIMIT with 0 remaining", resp)
	}
	// Over limit, the duration is the time until one token is back: ~2s.
	if d := st.GetDurationUntilReset().AsDuration(); d < time.Second || d > 2*time.Second {
		t.Errorf("over limit: duration_until_reset %v, want about 2s", d)
	}
	if len(resp.GetResponseHeadersToAdd()) != 0 {
		t.Errorf("headers %v without WithResponseHeaders", resp.GetResponseHeadersToAdd())
	}
	// Another client has its own bucket.
	other := &rlsv3.RateLimitRequest{Domain: "edge",
		Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("remote_address", "10.0.0.2", "path", "/orders")}}
	if resp := e.ask(t, other); resp.OverallCode != ok {
		t.Errorf("other client: %v, want OK", resp)
	}
	// A resource no rule matches is OK with no current limit.
	none := &rlsv3.RateLimitRequest{Domain: "edge",
		Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("remote_address", "10.0.0.1", "path", "/search")}}
	if resp := e.ask(t, none); resp.OverallCode != ok || resp.Statuses[0].CurrentLimit != nil {
		t.Errorf("unmatched resource: %v, want OK without current_limit", resp)
	}
}

func TestSecondDescriptorOverLimit(t *testing.T) {
	e := newEnv(t, []rules.Rule{tokenBucket("wide", "api /a", 100, 1), tokenBucket("narrow", "api /b", 1, 0.001)})
	req := &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*ratelimitv3.RateLimitDescriptor{
		desc("client_key", "user:1", "path", "/a"),
		desc("client_key", "user:1", "path", "/b"),
	}}
	if resp := e.ask(t, req); resp.OverallCode != ok || resp.Statuses[0].Code != ok || resp.Statuses[1].Code != ok {
		t.Fatalf("first request: %v, want OK twice", resp)
	}
	resp := e.ask(t, req)
	if resp.OverallCode != overLimit {
		t.Fatalf("second request: overall %v, want OVER_LIMIT", resp.OverallCode)
	}
	first, second := resp.Statuses[0], resp.Statuses[1]
	if first.Code != ok || first.GetCurrentLimit().GetName() != "wide" {
		t.Errorf("descriptor 0: %v, want OK under rule wide", first)
	}
	if second.Code != overLimit || second.GetCurrentLimit().GetName() != "narrow" || second.LimitRemaining != 0 {
		t.Errorf("descriptor 1: %v, want OVER_LIMIT under rule narrow with 0 remaining", second)
	}
	// Not atomic across descriptors (documented): descriptor 0 consumed.
	if first.LimitRemaining != 98 {
		t.Errorf("descriptor 0: limit_remaining %d, want 98 (consumed although the request is over limit)", first.LimitRemaining)
	}
}

func TestHitsAddend(t *testing.T) {
	e := newEnv(t, []rules.Rule{tokenBucket("tokens", "llm", 10, 0.001)})
	d := desc("user_id", "u1", "resource", "llm")
	resp := e.ask(t, &rlsv3.RateLimitRequest{Descriptors: []*ratelimitv3.RateLimitDescriptor{d}, HitsAddend: 4})
	if resp.OverallCode != ok || resp.Statuses[0].LimitRemaining != 6 {
		t.Fatalf("hits_addend 4: %v, want OK with 6 remaining", resp)
	}
	// The descriptor's hits_addend overrides the request's.
	d5 := desc("user_id", "u1", "resource", "llm")
	d5.HitsAddend = wrapperspb.UInt64(5)
	resp = e.ask(t, &rlsv3.RateLimitRequest{Descriptors: []*ratelimitv3.RateLimitDescriptor{d5}, HitsAddend: 100})
	if resp.OverallCode != ok || resp.Statuses[0].LimitRemaining != 1 {
		t.Fatalf("descriptor hits_addend 5: %v, want OK with 1 remaining", resp)
	}
	// A rejected request consumes nothing: 2 > 1 is over, then 0 (= 1) passes.
	resp = e.ask(t, &rlsv3.RateLimitRequest{Descriptors: []*ratelimitv3.RateLimitDescriptor{d}, HitsAddend: 2})
	if resp.OverallCode != overLimit || resp.Statuses[0].LimitRemaining != 1 {
		t.Fatalf("hits_addend 2 of 1 left: %v, want OVER_LIMIT with 1 remaining", resp)
	}
	resp = e.ask(t, &rlsv3.RateLimitRequest{Descriptors: []*ratelimitv3.RateLimitDescriptor{d}})
	if resp.OverallCode != ok || resp.Statuses[0].LimitRemaining != 0 {
		t.Fatalf("hits_addend 0: %v, want OK with 0 remaining", resp)
	}
	// A refund (is_negative_hits) is answered OK and consumes nothing.
	refund := desc("user_id", "u1", "resource", "llm")
	refund.HitsAddend, refund.IsNegativeHits = wrapperspb.UInt64(3), true
	resp = e.ask(t, &rlsv3.RateLimitRequest{Descriptors: []*ratelimitv3.RateLimitDescriptor{refund}})
	if resp.OverallCode != ok || resp.Statuses[0].Code != ok || resp.Statuses[0].CurrentLimit != nil {
		t.Fatalf("refund: %v, want a bare OK", resp)
	}
	if resp := e.ask(t, &rlsv3.RateLimitRequest{Descriptors: []*ratelimitv3.RateLimitDescriptor{d}}); resp.OverallCode != overLimit {
		t.Fatalf("after the refund: %v, want OVER_LIMIT (nothing refunded)", resp)
	}
}

func TestAttributesAndOptions(t *testing.T) {
	free := rules.Rule{ID: "free-plan", Match: map[string]string{"resource": "api", "plan": "free"},
		Key: []string{"client_key", "plan"}, Algorithm: rules.SlidingLog, Limit: 1, Window: rules.Duration(time.Minute)} // exact: no minute boundary to cross
	e := newEnv(t, []rules.Rule{free}, envoy.WithClientKeyEntries("tenant"), envoy.WithResponseHeaders(true))
	req := func(plan string) *rlsv3.RateLimitRequest {
		// The domain alone is the resource: no resource entry.
		return &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("tenant", "acme", "plan", plan)}}
	}
	resp := e.ask(t, req("free"))
	cl := resp.Statuses[0].GetCurrentLimit()
	if resp.OverallCode != ok || cl.GetRequestsPerUnit() != 1 || cl.GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE {
		t.Fatalf("first: %v, want OK with 1/MINUTE", resp)
	}
	if h := headers(resp); h["x-ratelimit-limit"] != "1" || h["x-ratelimit-remaining"] != "0" || h["retry-after"] != "" {
		t.Errorf("first: headers %v", h)
	}
	resp = e.ask(t, req("free"))
	if resp.OverallCode != overLimit {
		t.Fatalf("second: %v, want OVER_LIMIT", resp)
	}
	if h := headers(resp); h["x-ratelimit-remaining"] != "0" || h["retry-after"] == "" || h["x-ratelimit-reset"] == "" {
		t.Errorf("second: headers %v, want remaining 0, reset and retry-after", h)
	}
	if resp := e.ask(t, req("paid")); resp.OverallCode != ok || resp.Statuses[0].CurrentLimit != nil || len(resp.ResponseHeadersToAdd) != 0 {
		t.Errorf("paid plan: %v, want a bare OK (no rule matches)", resp)
	}
	// With the client key list replaced, client_key no longer names the
	// client: the descriptor's identity does, and no rule matches it.
	if resp := e.ask(t, &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("client_key", "x")}}); resp.OverallCode != ok || resp.Statuses[0].CurrentLimit != nil {
		t.Errorf("client_key with WithClientKeyEntries(tenant): %v, want a bare OK", resp)
	}
}

func headers(resp *rlsv3.RateLimitResponse) map[string]string {
	h := map[string]string{}
	for _, hv := range resp.GetResponseHeadersToAdd() {
		h[hv.GetKey()] = hv.GetValue()
	}
	return h
}

func TestInvalidRequest(t *testing.T) {
	e := newEnv(t, []rules.Rule{tokenBucket("r", "x", 5, 1)})
	many := &rlsv3.RateLimitRequest{Domain: "d"}
	for range envoy.MaxDescriptors + 1 {
		many.Descriptors = append(many.Descriptors, desc("client_key", "u"))
	}
	tests := []struct {
		name string
		in   *rlsv3.RateLimitRequest
		want string // in the message
	}{
		{"no descriptors", &rlsv3.RateLimitRequest{Domain: "d"}, "descriptors: at least one"},
		{"too many descriptors", many, "descriptors: 65 descriptors, the maximum is 64"},
		{"hits_addend beyond any cost", &rlsv3.RateLimitRequest{Descriptors: []*ratelimitv3.RateLimitDescriptor{
			{Entries: desc("client_key", "u").Entries, HitsAddend: wrapperspb.UInt64(1 << 63)}}}, "descriptors[0].hits_addend: 9223372036854775808 is above the maximum"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.call(tc.in)
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), tc.want) {
				t.Fatalf("got %v, want InvalidArgument containing %q", err, tc.want)
			}
		})
	}
}

// TestEveryDescriptorIsAnswered sends descriptors that envoyproxy/ratelimit
// accepts and that once failed the whole call here: none fails it now.
func TestEveryDescriptorIsAnswered(t *testing.T) {
	perIdentity := rules.Rule{ID: "per-identity", Match: map[string]string{"domain": "basic"}, Key: []string{"client_key"},
		Algorithm: rules.SlidingLog, Limit: 1, Window: rules.Duration(time.Hour)}
	e := newEnv(t, []rules.Rule{perIdentity})
	twice := func(name string, d *ratelimitv3.RateLimitDescriptor, wantSecond rlsv3.RateLimitResponse_Code) {
		t.Helper()
		req := &rlsv3.RateLimitRequest{Domain: "basic", Descriptors: []*ratelimitv3.RateLimitDescriptor{d}}
		if resp := e.ask(t, req); resp.OverallCode != ok {
			t.Errorf("%s, first: %v, want OK", name, resp)
		}
		if resp := e.ask(t, req); resp.OverallCode != wantSecond {
			t.Errorf("%s, second: %v, want %v", name, resp, wantSecond)
		}
	}
	// No client key entry: the descriptor's key/value path is the identity,
	// one bucket per path (key1=foo and key1=bar are two clients).
	twice("key1=foo", desc("key1", "foo"), overLimit)
	twice("key1=bar", desc("key1", "bar"), overLimit)
	twice("source_cluster/destination_cluster", desc("source_cluster", "proxy", "destination_cluster", "mock"), overLimit)
	twice("an empty client key value falls back to the path", desc("user_id", "", "path", "/a"), overLimit)
	twice("an empty entry key", desc("", "v"), overLimit)
	twice("an over-long client key is hashed", desc("api_key", strings.Repeat("k", 300)), overLimit)
	twice("an over-long value is hashed", desc("tier", strings.Repeat("t", 2000)), overLimit)
	// hello=world in a domain no rule names: OK, no limit (as
	// envoyproxy/ratelimit answers its integration test's first call).
	resp := e.ask(t, &rlsv3.RateLimitRequest{Domain: "foo", Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("hello", "world")}})
	if resp.OverallCode != ok || resp.Statuses[0].CurrentLimit != nil || resp.Statuses[0].LimitRemaining != 0 {
		t.Errorf("hello=world: %v, want OK with no current_limit", resp)
	}
	// A descriptor without entries: no limit can apply.
	if resp := e.ask(t, &rlsv3.RateLimitRequest{Domain: "basic", Descriptors: []*ratelimitv3.RateLimitDescriptor{{}}}); resp.OverallCode != ok {
		t.Errorf("no entries: %v, want OK", resp)
	}
	// A cost above the enforcer's maximum: that descriptor is over limit,
	// and the body says why; the call does not fail.
	big := desc("key1", "big")
	big.HitsAddend = wrapperspb.UInt64(5000)
	resp = e.ask(t, &rlsv3.RateLimitRequest{Domain: "basic", Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("key1", "small"), big}})
	if resp.OverallCode != overLimit || resp.Statuses[0].Code != ok || resp.Statuses[1].Code != overLimit ||
		!strings.Contains(string(resp.RawBody), "descriptors[1].hits_addend: 5000 is above the maximum of 1000") {
		t.Errorf("cost above the maximum: %v, want descriptor 1 OVER_LIMIT and a body naming hits_addend", resp)
	}
}

func TestRedisStoppedFailsOpen(t *testing.T) {
	open := tokenBucket("open", "edge /a", 1, 0.001)
	closed := tokenBucket("closed", "edge /b", 1, 0.001)
	closed.FailureMode = rules.FailClosed
	e := newEnv(t, []rules.Rule{open, closed})
	reqA := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("generic_key", "g", "path", "/a")}}
	reqB := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("generic_key", "g", "path", "/b")}}
	e.ask(t, reqA)
	if resp := e.ask(t, reqA); resp.OverallCode != overLimit {
		t.Fatalf("before the outage: %v, want OVER_LIMIT", resp)
	}
	e.redis.Stop()
	for i := range 20 { // through the breaker's closed and open states
		if resp := e.ask(t, reqA); resp.OverallCode != ok || resp.Statuses[0].Code != ok {
			t.Fatalf("outage, check %d, failure_mode open: %v, want OK", i, resp)
		}
	}
	// failure_mode closed is the rule owner's choice, and stays a rejection.
	if resp := e.ask(t, reqB); resp.OverallCode != overLimit {
		t.Errorf("outage, failure_mode closed: %v, want OVER_LIMIT", resp)
	}
}

// TestDaemonServesEnvoy runs the ratelimitd daemon: --envoy (the default)
// serves the Envoy protocol on the gRPC port, --envoy=false does not.
func TestDaemonServesEnvoy(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	r := testutil.StartRedis(t)
	rulesFile := filepath.Join(t.TempDir(), "rules.json")
	if err := os.WriteFile(rulesFile, []byte(`[{"id":"edge","match":{"resource":"edge /x"},"algorithm":"sliding_log","limit":1,"window":"1h"}]`), 0o600); err != nil {
		t.Fatal(err)
	}
	ready := regexp.MustCompile(`ready grpc=(\S+)`)
	for _, on := range []bool{true, false} {
		t.Run(fmt.Sprintf("envoy=%v", on), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			var stdout testutil.SyncBuffer
			done := make(chan error, 1)
			go func() {
				done <- enforcerd.Run(ctx, []string{"--region", "us-east", "--redis-addr", r.Addr, "--rules", rulesFile,
					"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--log-level", "error", "--timeout", "2s", fmt.Sprintf("--envoy=%v", on)},
					&stdout, io.Discard)
			}()
			t.Cleanup(func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("Run: %v", err)
				}
			})
			testutil.WaitFor(t, 10*time.Second, "ratelimitd ready", func() bool { return ready.MatchString(stdout.String()) })
			e := &env{client: dial(t, ready.FindStringSubmatch(stdout.String())[1])}
			req := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{desc("remote_address", "1.2.3.4", "path", "/x")}}
			if !on {
				if _, err := e.call(req); status.Code(err) != codes.Unimplemented {
					t.Fatalf("--envoy=false: %v, want Unimplemented", err)
				}
				return
			}
			hc, err := grpc.NewClient(ready.FindStringSubmatch(stdout.String())[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			defer hc.Close()
			h, err := healthpb.NewHealthClient(hc).Check(context.Background(), &healthpb.HealthCheckRequest{Service: envoy.ServiceName})
			if err != nil || h.Status != healthpb.HealthCheckResponse_SERVING {
				t.Fatalf("health of %s: %v %v, want SERVING", envoy.ServiceName, h, err)
			}
			if resp := e.ask(t, req); resp.OverallCode != ok {
				t.Fatalf("first: %v, want OK", resp)
			}
			resp := e.ask(t, req)
			cl := resp.Statuses[0].GetCurrentLimit()
			if resp.OverallCode != overLimit || cl.GetRequestsPerUnit() != 1 || cl.GetUnit() != rlsv3.RateLimitResponse_RateLimit_HOUR {
				t.Fatalf("second: %v, want OVER_LIMIT with 1/HOUR", resp)
			}
		})
	}
}

// BenchmarkShouldRateLimit measures one ShouldRateLimit over loopback gRPC
// and a real redis-server, with 1 and 3 descriptors (checked concurrently).
func BenchmarkShouldRateLimit(b *testing.B) {
	e := newEnv(b, []rules.Rule{tokenBucket("a", "edge /a", 1<<30, 1<<20), tokenBucket("b", "edge /b", 1<<30, 1<<20),
		tokenBucket("c", "edge /c", 1<<30, 1<<20)})
	for _, n := range []int{1, 3} {
		b.Run(fmt.Sprintf("descriptors=%d", n), func(b *testing.B) {
			req := &rlsv3.RateLimitRequest{Domain: "edge"}
			for _, p := range []string{"/a", "/b", "/c"}[:n] {
				req.Descriptors = append(req.Descriptors, desc("remote_address", "10.0.0.1", "path", p))
			}
			ctx := context.Background()
			for b.Loop() {
				resp, err := e.client.ShouldRateLimit(ctx, req)
				if err != nil || resp.OverallCode != ok {
					b.Fatalf("%v %v", resp, err)
				}
			}
		})
	}
}
