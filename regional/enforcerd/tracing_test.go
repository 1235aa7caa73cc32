package enforcerd

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/hashform"
	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/envoy"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	envoyrl "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
)

func tracedEnforcer(t *testing.T, opts ...grpc.ServerOption) *grpc.ClientConn {
	t.Helper()
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	r := testutil.StartRedis(t)
	rc := redis.NewClient(&redis.Options{Addr: r.Addr})
	t.Cleanup(func() { rc.Close() })
	st, err := redisstore.New(rc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	cfg := regional.DefaultConfig()
	cfg.Region, cfg.Timeout = "us-east", time.Second
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	enf, err := regional.New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	rs := []rules.Rule{{ID: "orders", Match: map[string]string{"resource": "POST /orders"}, Algorithm: rules.TokenBucket, Capacity: 1, RefillPerSecond: 0.01}}
	rs[0].Normalize()
	if err := enf.SetRules(rs); err != nil {
		t.Fatal(err)
	}
	gs, svc := regional.NewGRPCServer(enf, opts...)
	envoy.Register(gs, enf)
	svc.SetServing(true)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(l)
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	out := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		out[kv.Key] = kv.Value
	}
	return out
}

// TestTracing: one span per check call with the decision as attributes,
// continuing the caller's trace; no span for health checks; no client key
// in any attribute unless asked for.
func TestTracing(t *testing.T) {
	for _, withKeys := range []bool{false, true} {
		t.Run(map[bool]string{false: "default", true: "client keys"}[withKeys], func(t *testing.T) {
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
			t.Cleanup(func() { tp.Shutdown(context.Background()) })
			conn := tracedEnforcer(t, tracingServerOptions(tp, withKeys)...)
			rl := ratelimitv1.NewRateLimiterClient(conn)

			// The caller's trace: W3C traceparent in the metadata.
			parent := trace.SpanContextFromContext(trace.ContextWithSpanContext(context.Background(),
				trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5}, TraceFlags: trace.FlagsSampled})))
			ctx := metadata.AppendToOutgoingContext(context.Background(), "traceparent",
				"00-"+parent.TraceID().String()+"-"+parent.SpanID().String()+"-01")
			const key = "secret-user-7731"
			// A server span ends after its answer is sent, so the client
			// may have the answer first: each call waits for its span (the
			// spans then come in call order; once, CheckLimits' ended after
			// the next call's). The health check goes first: a span of it
			// would be the first.
			if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
				t.Fatal(err)
			}
			spansSoFar := 0
			ended := func() {
				t.Helper()
				spansSoFar++
				testutil.WaitFor(t, 5*time.Second, "the call's span", func() bool { return len(exp.GetSpans()) >= spansSoFar })
			}
			for range 2 {
				if _, err := rl.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: key, Resource: "POST /orders"}); err != nil {
					t.Fatal(err)
				}
				ended()
			}
			if _, err := rl.CheckLimits(ctx, &ratelimitv1.CheckLimitsRequest{Requests: []*ratelimitv1.CheckLimitRequest{
				{ClientKey: key, Resource: "POST /orders"}, {ClientKey: "other", Resource: "POST /orders"}, {ClientKey: "x", Resource: "GET /"}}}); err != nil {
				t.Fatal(err)
			}
			ended()
			if _, err := envoyrl.NewRateLimitServiceClient(conn).ShouldRateLimit(ctx, &envoyrl.RateLimitRequest{Domain: "edge",
				Descriptors: []*commonv3.RateLimitDescriptor{{Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "client_key", Value: key}}}}}); err != nil {
				t.Fatal(err)
			}
			ended()

			spans := exp.GetSpans().Snapshots()
			var names []string
			for _, s := range spans {
				names = append(names, s.Name())
			}
			want := []string{"ratelimit.v1.RateLimiter/CheckLimit", "ratelimit.v1.RateLimiter/CheckLimit",
				"ratelimit.v1.RateLimiter/CheckLimits", "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"}
			if strings.Join(names, ",") != strings.Join(want, ",") {
				t.Fatalf("spans %v, want %v (none for the health check)", names, want)
			}
			for i, s := range spans {
				if s.Parent().TraceID() != parent.TraceID() || s.Parent().SpanID() != parent.SpanID() || s.SpanKind() != trace.SpanKindServer {
					t.Errorf("span %d: parent %v kind %v, want the caller's span as parent", i, s.Parent(), s.SpanKind())
				}
				a := attrs(s)
				for k, v := range a {
					if strings.Contains(v.Emit(), key) != (withKeys && k == attrClientKey) {
						t.Errorf("span %d: attribute %s=%q (client keys in attributes: %v)", i, k, v.Emit(), withKeys)
					}
				}
			}
			for i, wantDecision := range []string{"allowed", "rejected"} {
				a := attrs(spans[i])
				if a[attrDecision].AsString() != wantDecision || a[attrRuleID].AsString() != "orders" || a[attrFailOpen].AsBool() ||
					a[attrMatched].AsInt64() != 1 || a[attrResource].AsString() != "POST /orders" || a[attrCost].AsInt64() != 1 {
					t.Errorf("CheckLimit span %d: %v, want decision %s by orders", i, a, wantDecision)
				}
				if withKeys && a[attrClientKey].AsString() != key {
					t.Errorf("CheckLimit span %d: no client key attribute: %v", i, a)
				}
			}
			if a := attrs(spans[2]); a[attrBatchSize].AsInt64() != 3 || a[attrBatchAllow].AsInt64() != 2 || a[attrBatchRej].AsInt64() != 1 {
				t.Errorf("CheckLimits span: %v, want 3 requests, 2 allowed, 1 rejected", a)
			}
			if a := attrs(spans[3]); a[attrDecision].AsString() != "allowed" || a["apportion.envoy.domain"].AsString() != "edge" {
				t.Errorf("ShouldRateLimit span: %v", a)
			}
		})
	}
}

// collector is an OTLP/gRPC trace collector on loopback that keeps the
// names and attribute keys of the spans it receives.
type collector struct {
	collectortrace.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans map[string][]string // span name -> attribute keys
}

func (c *collector) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				var keys []string
				for _, a := range s.GetAttributes() {
					keys = append(keys, a.GetKey()+"="+a.GetValue().String())
				}
				c.spans[s.GetName()] = keys
			}
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

func (c *collector) get(name string) ([]string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.spans[name]
	return v, ok
}

// TestTracingFlag: ratelimitd --otlp-endpoint exports the check spans to
// an OTLP collector; they are flushed at shutdown at the latest.
func TestTracingFlag(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	col := &collector{spans: map[string][]string{}}
	cl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cs := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(cs, col)
	go cs.Serve(cl)
	t.Cleanup(cs.Stop)

	r := testutil.StartRedis(t)
	rulesFile := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(rulesFile, []byte("- id: orders\n  match: {resource: POST /orders}\n  algorithm: token_bucket\n  capacity: 5\n  refill_per_second: 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stdout, stderr := &testutil.SyncBuffer{}, &testutil.SyncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, []string{"--region", "us-east", "--redis-addr", r.Addr, "--rules", rulesFile,
			"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--timeout", "1s",
			"--otlp-endpoint", cl.Addr().String(), "--otlp-insecure"}, stdout, stderr)
	}()
	stopped := false
	defer func() {
		if !stopped {
			cancel()
			<-done
		}
	}()
	ready := regexp.MustCompile(`ready grpc=(\S+)`)
	var m []string
	testutil.WaitFor(t, 10*time.Second, "the ready line", func() bool {
		m = ready.FindStringSubmatch(stdout.String())
		return m != nil
	})
	conn, err := grpc.NewClient(m[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := ratelimitv1.NewRateLimiterClient(conn).CheckLimit(context.Background(),
		&ratelimitv1.CheckLimitRequest{ClientKey: "user:1", Resource: "POST /orders"}); err != nil {
		t.Fatal(err)
	}
	cancel()
	stopped = true
	if err := <-done; err != nil {
		t.Fatalf("Run: %v\n%s", err, stderr)
	}
	keys, ok := col.get("ratelimit.v1.RateLimiter/CheckLimit")
	if !ok {
		t.Fatalf("the collector received no CheckLimit span (got %v)\n%s", col.spans, stderr)
	}
	joined := strings.Join(keys, " ")
	if !strings.Contains(joined, attrRuleID) || !strings.Contains(joined, "orders") || !strings.Contains(joined, attrDecision) {
		t.Errorf("CheckLimit span attributes %v, want the rule id and decision", keys)
	}
}

func TestTracingFlagsDefaultOff(t *testing.T) {
	o, err := parseFlags([]string{"--region", "r", "--rules", "x.yaml"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if tp, err := o.tracing.start(context.Background(), "r"); tp != nil || err != nil {
		t.Errorf("tracing on by default: %v, %v", tp, err)
	}
	if o.tracing.clientKeys {
		t.Error("client keys in spans by default")
	}
	if _, err := parseFlags([]string{"--region", "r", "--rules", "x.yaml", "--trace-sample-ratio", "2"}, io.Discard); err == nil {
		t.Error("--trace-sample-ratio 2 accepted")
	}
}

// TestTracingBoundsClientValues: no span attribute or name holds more than
// maxAttrBytes of what a client sent, even with --trace-sample-ratio 0 and
// a caller's sampled traceparent (which is traced): an over-long Envoy
// domain is in its hashed form, as the check maps it; a call of an
// unknown method of a traced service (its name is the span's) is not
// traced; and the provider's span limits truncate any other attribute.
func TestTracingBoundsClientValues(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	fl := tracingFlags{ratio: 0}
	tp := sdktrace.NewTracerProvider(append(fl.providerOptions("us-east"), sdktrace.WithSyncer(exp))...)
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	conn := tracedEnforcer(t, append(tracingServerOptions(tp, true), grpc.MaxRecvMsgSize(8<<20))...)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "traceparent",
		"00-0102030405060708090a0b0c0d0e0f10-0102030405060708-01")
	huge := strings.Repeat("d", 1<<20)

	if _, err := envoyrl.NewRateLimitServiceClient(conn).ShouldRateLimit(ctx, &envoyrl.RateLimitRequest{Domain: huge,
		Descriptors: []*commonv3.RateLimitDescriptor{{Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "client_key", Value: huge}}}}}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "the ShouldRateLimit span", func() bool { return len(exp.GetSpans()) >= 1 })
	// An unknown method: Unimplemented, and no span.
	err := conn.Invoke(ctx, "/"+ratelimitv1.RateLimiter_ServiceDesc.ServiceName+"/"+huge[:1<<16],
		&ratelimitv1.CheckLimitRequest{ClientKey: "k", Resource: "POST /orders"}, &ratelimitv1.CheckLimitResponse{})
	if err == nil {
		t.Fatal("an unknown method answered")
	}
	// A CheckLimit whose span is traced after it (the spans end in order).
	if _, err := ratelimitv1.NewRateLimiterClient(conn).CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "k", Resource: "POST /orders"}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "the CheckLimit span", func() bool { return len(exp.GetSpans()) >= 2 })

	spans := exp.GetSpans().Snapshots()
	for _, s := range spans {
		if len(s.Name()) > maxAttrBytes {
			t.Errorf("a span named with %d bytes of the client's method name", len(s.Name()))
		}
		for _, kv := range s.Attributes() {
			if n := len(kv.Value.Emit()); n > maxAttrBytes {
				t.Errorf("span %.60s: attribute %s of %d bytes, want at most %d", s.Name(), kv.Key, n, maxAttrBytes)
			}
		}
	}
	if len(spans) != 2 {
		t.Fatalf("%d spans, want ShouldRateLimit's and CheckLimit's (none for the unknown method)", len(spans))
	}
	if got, want := attrs(spans[0])[attrDomain].AsString(), hashform.Hash(huge); got != want {
		t.Errorf("domain attribute %.80q, want the domain's hashed form %s", got, want)
	}

	// Any attribute: the span limits.
	sampled := trace.ContextWithRemoteSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled}))
	_, span := tp.Tracer("test").Start(sampled, "direct")
	span.SetAttributes(attribute.String("long", huge))
	for i := range 100 {
		span.SetAttributes(attribute.Int("n"+strings.Repeat("x", i), i))
	}
	span.End()
	spans = exp.GetSpans().Snapshots()
	last := spans[len(spans)-1]
	if a := attrs(last); len(a["long"].AsString()) != maxAttrBytes || len(last.Attributes()) > spanLimits().AttributeCountLimit {
		t.Errorf("a span with %d attributes, one of %d bytes: want at most %d, of at most %d bytes",
			len(last.Attributes()), len(a["long"].AsString()), spanLimits().AttributeCountLimit, maxAttrBytes)
	}
}
