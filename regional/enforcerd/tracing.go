package enforcerd

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/apportion/apportion/internal/hashform"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
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
	attrDomain     = "apportion.envoy.domain"
	attrDescs      = "apportion.envoy.descriptors"
)

// maxAttrBytes bounds a span attribute's value: a value a client chose (a
// resource, a client key, an Envoy domain) is put in a span as the check
// maps it, kept when it is valid UTF-8 of at most maxAttrBytes and not of
// the hashed form, else "sha256:" and its hex SHA-256 (internal/hashform,
// the rule the Envoy service applies to an over-long domain). gRPC takes
// messages of up to 4 MB: unbounded, one call's attribute could hold
// megabytes, kept in memory until exported (the batch queue holds 2048
// spans) and making the batch it is in too large for the collector.
const maxAttrBytes = 1024

// spanLimits are a second line of defence for the span attributes the SDK
// records, ours and otelgrpc's: no value longer than maxAttrBytes (the SDK
// truncates it), at most 32 attributes, events and links per span.
func spanLimits() sdktrace.SpanLimits {
	return sdktrace.SpanLimits{
		AttributeValueLengthLimit:   maxAttrBytes,
		AttributeCountLimit:         32,
		EventCountLimit:             32,
		LinkCountLimit:              32,
		AttributePerEventCountLimit: 32,
		AttributePerLinkCountLimit:  32,
	}
}

// clientValue is s, a value a client chose, as a span attribute: the
// check's mapping of it (maxAttrBytes).
func clientValue(k, s string) attribute.KeyValue {
	return attribute.String(k, hashform.Fit(s, maxAttrBytes))
}

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
	return sdktrace.NewTracerProvider(append(t.providerOptions(region),
		sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(time.Second)))...), nil
}

// providerOptions are the tracer provider's options but its exporter: the
// resource, the sampler (a caller's sampled traceparent is traced whatever
// the ratio) and spanLimits.
func (t *tracingFlags) providerOptions(region string) []sdktrace.TracerProviderOption {
	res := resource.NewSchemaless(attribute.String("service.name", "ratelimitd"), attribute.String(attrRegion, region))
	return []sdktrace.TracerProviderOption{
		sdktrace.WithResource(res),
		sdktrace.WithSpanLimits(spanLimits()),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(t.ratio))),
	}
}

// tracedMethods are the traced gRPC methods: the check calls (every method
// of the two services), not health checks or reflection.
var tracedMethods = func() map[string]bool {
	m := map[string]bool{}
	for _, sd := range []*grpc.ServiceDesc{&ratelimitv1.RateLimiter_ServiceDesc, &envoyrl.RateLimitService_ServiceDesc} {
		for _, md := range sd.Methods {
			m["/"+sd.ServiceName+"/"+md.MethodName] = true
		}
		for _, st := range sd.Streams {
			m["/"+sd.ServiceName+"/"+st.StreamName] = true
		}
	}
	return m
}()

// tracedMethod reports whether a gRPC method is traced: one of
// tracedMethods exactly. The method name is the client's (the span's name
// and rpc.method): an unknown method, whatever its length, is not traced.
func tracedMethod(fullMethod string) bool {
	return tracedMethods[fullMethod]
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
				span.SetAttributes(attribute.String(attrDecision, d), clientValue(attrDomain, in.GetDomain()),
					attribute.Int(attrDescs, len(in.GetDescriptors())))
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
	kv := []attribute.KeyValue{clientValue(attrResource, in.GetResource()), attribute.Int64(attrCost, cost)}
	if clientKeys {
		kv = append(kv, clientValue(attrClientKey, in.GetClientKey()))
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
