package client

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/regional/header"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// InterceptorOption configures the server interceptors.
type InterceptorOption func(*interceptorConfig)

type interceptorConfig struct {
	key        func(ctx context.Context, fullMethod string) string
	resource   func(ctx context.Context, fullMethod string) string
	attributes func(ctx context.Context, fullMethod string) map[string]string
	cost       func(ctx context.Context, fullMethod string) int64
	skip       func(fullMethod string) bool
}

// WithKey sets how a call names its client. Default: the caller's IP
// address (the peer's host). See KeyFromMetadata.
func WithKey(f func(ctx context.Context, fullMethod string) string) InterceptorOption {
	return func(c *interceptorConfig) {
		if f != nil {
			c.key = f
		}
	}
}

// WithResource sets a call's resource. Default: the full method name,
// "/package.Service/Method", which rules match with "resource".
func WithResource(f func(ctx context.Context, fullMethod string) string) InterceptorOption {
	return func(c *interceptorConfig) {
		if f != nil {
			c.resource = f
		}
	}
}

// WithAttributes sets the attributes rules match on (tier, api_key, ...).
// Default: none.
func WithAttributes(f func(ctx context.Context, fullMethod string) map[string]string) InterceptorOption {
	return func(c *interceptorConfig) { c.attributes = f }
}

// WithCost sets a call's cost in tokens. Default: 1.
func WithCost(f func(ctx context.Context, fullMethod string) int64) InterceptorOption {
	return func(c *interceptorConfig) { c.cost = f }
}

// WithSkip exempts methods from limiting. Default: the standard health and
// reflection services (grpc.health.v1.*, grpc.reflection.*) are exempt.
func WithSkip(f func(fullMethod string) bool) InterceptorOption {
	return func(c *interceptorConfig) {
		if f != nil {
			c.skip = f
		}
	}
}

// KeyFromMetadata returns a key function that reads the client key from the
// incoming metadata entry name (e.g. "x-api-key"), falling back to the
// caller's IP address when the entry is absent.
func KeyFromMetadata(name string) func(ctx context.Context, fullMethod string) string {
	name = strings.ToLower(name)
	return func(ctx context.Context, fullMethod string) string {
		if md, ok := metadata.FromIncomingContext(ctx); ok {
			if v := md.Get(name); len(v) > 0 && v[0] != "" {
				return v[0]
			}
		}
		return peerIP(ctx, fullMethod)
	}
}

func peerIP(ctx context.Context, _ string) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return "unknown"
	}
	host, _, err := net.SplitHostPort(p.Addr.String())
	if err != nil {
		return p.Addr.String()
	}
	return host
}

func defaultSkip(fullMethod string) bool {
	return strings.HasPrefix(fullMethod, "/grpc.health.v1.") || strings.HasPrefix(fullMethod, "/grpc.reflection.")
}

func (c *Client) interceptorConfig(opts []InterceptorOption) *interceptorConfig {
	cfg := &interceptorConfig{
		key:      peerIP,
		resource: func(_ context.Context, m string) string { return m },
		skip:     defaultSkip,
	}
	for _, o := range opts {
		o(cfg)
	}
	return cfg
}

// UnaryServerInterceptor returns a gRPC server interceptor that asks the
// enforcer before every unary call. A rejected call is answered
// ResourceExhausted with a RetryInfo detail (only when waiting can help:
// not when RetryAfter is Never; the message then says why) and a
// QuotaFailure detail naming the rule, and the handler does not run.
//
// The header metadata carries the rate-limit headers of the enforcer's
// HTTP API and the HTTP middleware, from the same writer
// (regional/header.Fields), in lower case: on an answer an enforced rule
// bound, x-ratelimit-limit, x-ratelimit-remaining, x-ratelimit-reset
// (seconds), ratelimit-policy, ratelimit and, on a rejection when waiting
// can help, retry-after (seconds); none when no rule or only shadow rules
// matched; on an answer of the enforcer's failure policy (its store down:
// Decision.FailOpen) only x-ratelimit-limit, ratelimit-policy and a
// rejection's retry-after, as the buckets' state is unknown.
//
// When the enforcer cannot be asked the Client's FailurePolicy decides:
// FailOpen runs the handler, FailClosed answers Unavailable (no rate-limit
// metadata either way). A call's key and resource are fitted first (an
// empty key is the caller's IP; an over-long or invalid key, resource or
// attribute its hashed form: FitKey), and a check the enforcer still
// refuses (a negative cost, one above its --max-cost) is answered
// InvalidArgument: a caller can never go unlimited by sending what the
// enforcer refuses.
func (c *Client) UnaryServerInterceptor(opts ...InterceptorOption) grpc.UnaryServerInterceptor {
	cfg := c.interceptorConfig(opts)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if cfg.skip(info.FullMethod) {
			return handler(ctx, req)
		}
		md, err := c.admit(ctx, cfg, info.FullMethod)
		if md != nil {
			_ = grpc.SetHeader(ctx, md) // fails only when headers were sent: not before the handler
		}
		if err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

// StreamServerInterceptor is UnaryServerInterceptor for streaming calls:
// one check when the stream opens.
func (c *Client) StreamServerInterceptor(opts ...InterceptorOption) grpc.StreamServerInterceptor {
	cfg := c.interceptorConfig(opts)
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if cfg.skip(info.FullMethod) {
			return handler(srv, ss)
		}
		md, err := c.admit(ss.Context(), cfg, info.FullMethod)
		if md != nil {
			_ = ss.SetHeader(md)
		}
		if err != nil {
			return err
		}
		return handler(srv, ss)
	}
}

// admit checks one call: a nil error lets it through.
func (c *Client) admit(ctx context.Context, cfg *interceptorConfig, method string) (metadata.MD, error) {
	// The key, resource and attributes may come from the caller (its
	// metadata): an empty key is the caller's IP, an over-long or invalid
	// one its hashed form (FitKey), so that no caller can make the
	// enforcer refuse the check and so go unlimited.
	key := cfg.key(ctx, method)
	if key == "" {
		key = peerIP(ctx, method)
	}
	req := Request{ClientKey: FitKey(key), Resource: FitField(cfg.resource(ctx, method))}
	if cfg.attributes != nil {
		req.Attributes = FitAttributes(cfg.attributes(ctx, method))
	}
	if cfg.cost != nil {
		req.Cost = cfg.cost(ctx, method)
	}
	d, err := c.Check(ctx, req)
	var re *RequestError
	switch {
	case err != nil && ctx.Err() != nil:
		return nil, status.FromContextError(ctx.Err()).Err()
	case errors.As(err, &re):
		// A request the enforcer refuses (a negative cost, a cost above
		// its --max-cost, too many attributes): refused, never let
		// through by the failure policy, which is for an enforcer that
		// cannot answer.
		return nil, status.Errorf(codes.InvalidArgument, "rate limit: %s: %s", re.Field, re.Msg)
	case err != nil:
		// A closed Client: the limiter cannot answer this call, so the
		// failure policy decides.
		d = c.policy(err)
	}
	if d.Unreachable != nil {
		if d.Allowed {
			return nil, nil
		}
		return nil, status.Error(codes.Unavailable, "rate limiter unavailable")
	}
	a := header.FromProto(toWire(d), req.Cost)
	md := headers(a)
	if d.Allowed {
		return md, nil
	}
	return md, rejection(d, a)
}

// headers is the metadata of the rate-limit headers of a (nil when there
// are none): the HTTP API's, with the names in lower case.
func headers(a header.Answer) metadata.MD {
	fs := header.Fields(a)
	if len(fs) == 0 {
		return nil
	}
	md := make(metadata.MD, len(fs))
	for _, f := range fs {
		md.Append(strings.ToLower(f.Name), f.Value)
	}
	return md
}

// rejection is the ResourceExhausted status of a rejected call: with a
// RetryInfo detail exactly when the headers carry Retry-After (waiting can
// help), else with the reason waiting cannot help in the message.
func rejection(d Decision, a header.Answer) error {
	msg := fmt.Sprintf("rate limit exceeded (rule %q)", d.RuleID)
	var retry time.Duration
	for _, f := range header.Fields(a) {
		if f.Name == header.RetryAfter {
			secs, _ := strconv.ParseInt(f.Value, 10, 64)
			retry = time.Duration(secs) * time.Second
		}
	}
	if d.RetryAfter > 0 && retry > 0 {
		retry = d.RetryAfter // the precise delay; the header's is whole seconds
	}
	if retry == 0 {
		_, reason := header.Status(a)
		msg += ": " + reason
	}
	st := status.New(codes.ResourceExhausted, msg)
	desc := fmt.Sprintf("limit %d, remaining %d", d.Limit, d.Remaining)
	if d.FailOpen { // the enforcer's failure policy answered: the bucket's state is unknown
		desc = fmt.Sprintf("limit %d (answered by the rule's failure mode: the enforcer's store is unreachable)", d.Limit)
	}
	qf := &errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{Subject: "rule:" + d.RuleID, Description: desc}}}
	var err error
	if retry > 0 {
		st, err = st.WithDetails(qf, &errdetails.RetryInfo{RetryDelay: durationpb.New(retry)})
	} else {
		st, err = st.WithDetails(qf)
	}
	if err != nil { // only for a detail that does not marshal
		return status.Errorf(codes.ResourceExhausted, "rate limit exceeded (rule %q)", d.RuleID)
	}
	return st.Err()
}
