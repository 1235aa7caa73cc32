package enforcerd

import (
	"context"
	"flag"
	"fmt"
	"strings"
	"time"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/envoy"
	envoyrl "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	noopmetric "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"
)

// Span attributes of a check. No attribute holds a client key unless
// --trace-client-keys is on: keys are often user ids or API keys, and trace
// backends are rarely access-controlled like logs.
const (
	attrDecision   = "apportion.decision"  // allowed, rejected, fail_allowed, fail_rejected, no_rule
	attrRuleID     = "apportion.rule_id"   // the binding rule
	attrFailOpen   = "apportion.fail_open" // answered by the failure policy
	attrMatched    = "apportion.rules_matched"
	attrResource   = "apportion.resource"
	attrCost       = "apportion.cost"
	attrClientKey  = "apportion.client_key" // only with --trace-client-keys
	attrBatchSize  = "apportion.batch.size"
	attrBatchAllow = "apportion.batch.allowed"
	attrBatchRej   = "apportion.batch.rejected"
	attrRegion     = "apportion.region"
)

// tracingFlags configure OpenTelemetry tracing of the check calls. Off
// unless --otlp-endpoint is set.
type tracingFlags struct {
	endpoint   string
	insecure   bool
	ratio      float64
	clientKeys bool
}

func (t *tracingFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&t.endpoint, "otlp-endpoint", "", "OTLP/gRPC collector HOST:PORT to export traces of CheckLimit, CheckLimits and ShouldRateLimit to (empty: tracing off)")
	fs.BoolVar(&t.insecure, "otlp-insecure", false, "send traces to the collector without TLS")
	fs.Float64Var(&t.ratio, "trace-sample-ratio", 1, "fraction of calls without a sampled parent span that are traced (a caller's sampling decision wins)")
	fs.BoolVar(&t.clientKeys, "trace-client-keys", false, "put client keys in span attributes (they are often user ids or API keys)")
}

func (t *tracingFlags) validate() error {
	if t.ratio < 0 || t.ratio > 1 {
		return fmt.Errorf("--trace-sample-ratio must be in [0,1], got %v", t.ratio)
	}
	return nil
}

// startTracing returns the tracer provider that exports to the collector,
// or nil when tracing is off. Its Shutdown flushes the spans still queued.
func (t *tracingFlags) start(ctx context.Context, region string) (*sdktrace.TracerProvider, error) {
	if t.endpoint == "" {
		return nil, nil
	}
	opts := []otlptracegrpc.Option{otlptracegrpc.WithEndpoint(t.endpoint)}
	if t.insecure {
		opts = append(opts, otlptracegrpc.WithInsecure())
	}
	exp, err := otlptracegrpc.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("otlp exporter: %w", err)
	}
	res := resource.NewSchemaless(attribute.String("service.name", "ratelimitd"), attribute.String(attrRegion, region))
	return sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(time.Second)),
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(t.ratio))),
	), nil
}

// tracedMethod reports whether a gRPC method is traced: the check calls,
// not health checks or reflection.
func tracedMethod(fullMethod string) bool {
	return strings.HasPrefix(fullMethod, "/"+ratelimitv1.RateLimiter_ServiceDesc.ServiceName+"/") ||
		strings.HasPrefix(fullMethod, "/"+envoy.ServiceName+"/")
}

// tracingServerOptions trace the check calls with tp: a span per call
// (otelgrpc, continuing a W3C traceparent sent by the caller) and the
// decision as its attributes.
func tracingServerOptions(tp trace.TracerProvider, clientKeys bool) []grpc.ServerOption {
	h := otelgrpc.NewServerHandler(
		otelgrpc.WithTracerProvider(tp),
		otelgrpc.WithMeterProvider(noopmetric.NewMeterProvider()),
		otelgrpc.WithPropagators(propagation.TraceContext{}),
		otelgrpc.WithFilter(func(info *stats.RPCTagInfo) bool { return tracedMethod(info.FullMethodName) }),
	)
	return []grpc.ServerOption{grpc.StatsHandler(h), grpc.ChainUnaryInterceptor(decisionAttributes(clientKeys))}
}

// decisionAttributes records a check's decision on the call's span.
func decisionAttributes(clientKeys bool) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		span := trace.SpanFromContext(ctx)
		if !span.IsRecording() || err != nil {
			return resp, err
		}
		switch in := req.(type) {
		case *ratelimitv1.CheckLimitRequest:
			if out, ok := resp.(*ratelimitv1.CheckLimitResponse); ok {
				span.SetAttributes(requestAttributes(in, clientKeys)...)
				span.SetAttributes(responseAttributes(out)...)
			}
		case *ratelimitv1.CheckLimitsRequest:
			if out, ok := resp.(*ratelimitv1.CheckLimitsResponse); ok {
				allowed := 0
				for _, r := range out.GetResponses() {
					if r.GetAllowed() {
						allowed++
					}
				}
				span.SetAttributes(attribute.Int(attrBatchSize, len(in.GetRequests())),
					attribute.Int(attrBatchAllow, allowed), attribute.Int(attrBatchRej, len(out.GetResponses())-allowed))
			}
		case *envoyrl.RateLimitRequest:
			if out, ok := resp.(*envoyrl.RateLimitResponse); ok {
				d := "allowed"
				if out.GetOverallCode() == envoyrl.RateLimitResponse_OVER_LIMIT {
					d = "rejected"
				}
				span.SetAttributes(attribute.String(attrDecision, d), attribute.String("apportion.envoy.domain", in.GetDomain()),
					attribute.Int("apportion.envoy.descriptors", len(in.GetDescriptors())))
			}
		}
		return resp, err
	}
}

func requestAttributes(in *ratelimitv1.CheckLimitRequest, clientKeys bool) []attribute.KeyValue {
	cost := in.GetCost()
	if cost == 0 {
		cost = 1
	}
	kv := []attribute.KeyValue{attribute.String(attrResource, in.GetResource()), attribute.Int64(attrCost, cost)}
	if clientKeys {
		kv = append(kv, attribute.String(attrClientKey, in.GetClientKey()))
	}
	return kv
}

func responseAttributes(out *ratelimitv1.CheckLimitResponse) []attribute.KeyValue {
	d := "no_rule"
	switch {
	case out.GetRuleId() == "" && out.GetAllowed():
	case out.GetFailOpen() && out.GetAllowed():
		d = "fail_allowed"
	case out.GetFailOpen():
		d = "fail_rejected"
	case out.GetAllowed():
		d = "allowed"
	default:
		d = "rejected"
	}
	return []attribute.KeyValue{attribute.String(attrDecision, d), attribute.String(attrRuleID, out.GetRuleId()),
		attribute.Bool(attrFailOpen, out.GetFailOpen()), attribute.Int(attrMatched, len(out.GetStatuses()))}
}

// shutdownTracing flushes and stops tp, waiting at most d.
func shutdownTracing(tp *sdktrace.TracerProvider, d time.Duration) error {
	if tp == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return tp.Shutdown(ctx)
}
