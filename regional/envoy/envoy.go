package envoy

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/header"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// MaxDescriptors is the largest number of descriptors one request may carry.
const MaxDescriptors = 64

// Entry keys with a fixed meaning.
const (
	// EntryResource names the entry whose value is the resource as is.
	EntryResource = "resource"
	// AttrDomain is the attribute that carries the request's domain.
	AttrDomain = "domain"
)

// Option configures the service that Register adds.
type Option func(*service)

// WithClientKeyEntries sets the descriptor entry keys whose value is the
// client key, in order of preference. Default: client_key, remote_address,
// generic_key, user_id, api_key. An empty list keeps the default.
func WithClientKeyEntries(keys ...string) Option {
	return func(s *service) {
		if len(keys) > 0 {
			s.clientKeys = append([]string(nil), keys...)
		}
	}
}

// WithResourceEntries sets the descriptor entry keys whose value, after the
// request's domain and a space, is the resource when the descriptor has no
// "resource" entry, in order of preference. Default: path, header_match.
// An empty list keeps the default.
func WithResourceEntries(keys ...string) Option {
	return func(s *service) {
		if len(keys) > 0 {
			s.resourceKeys = append([]string(nil), keys...)
		}
	}
}

// WithResponseHeaders makes every answer ask Envoy to add the rate-limit
// headers of the most restrictive descriptor to the client's response:
// exactly those of the enforcer's HTTP API and the Go middleware (written by
// regional/header, in lower case). Default: off (Envoy's
// enable_x_ratelimit_headers can derive its own from the statuses instead).
func WithResponseHeaders(on bool) Option {
	return func(s *service) { s.headers = on }
}

// ServiceName is the Envoy rate-limit service's gRPC name, for health checks.
var ServiceName = rlsv3.RateLimitService_ServiceDesc.ServiceName

// Register adds envoy.service.ratelimit.v3.RateLimitService to s, answering
// from e. Call it before s serves, e.g. right after regional.NewGRPCServer.
func Register(s *grpc.Server, e *regional.Enforcer, opts ...Option) {
	regional.RegisterServiceLenient(s, &rlsv3.RateLimitService_ServiceDesc, newService(e, opts...), decodeLenient)
}

// service implements RateLimitService. Its settings are immutable after
// newService; tree caches the configuration trees of the enforcer's current
// rule index (replaced, never modified).
type service struct {
	rlsv3.UnimplementedRateLimitServiceServer
	e            *regional.Enforcer
	clientKeys   []string
	resourceKeys []string
	headers      bool
	tree         atomic.Pointer[trees]
	rebuild      sync.Mutex // one goroutine rebuilds tree after a rule change; the others wait for it
}

func newService(e *regional.Enforcer, opts ...Option) *service {
	s := &service{
		e:            e,
		clientKeys:   []string{"client_key", "remote_address", "generic_key", "user_id", "api_key"},
		resourceKeys: []string{"path", "header_match"},
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

// trees returns the configuration trees of the enforcer's current rules,
// building them once per rule index.
func (s *service) trees() *trees {
	ix := s.e.RuleIndex()
	if t := s.tree.Load(); t != nil && t.ix == ix {
		return t
	}
	s.rebuild.Lock()
	defer s.rebuild.Unlock()
	if t := s.tree.Load(); t != nil && t.ix == ix {
		return t
	}
	t := buildTrees(ix)
	s.tree.Store(t)
	return t
}

// refuse counts a refused call (InvalidArgument: no descriptor, too many,
// a hits_addend beyond any cost, a request that does not decode or is over
// the server's message size) once, as invalid in apportion_requests_total,
// and returns err. A checked descriptor is counted by its check instead.
func (s *service) refuse(err error) error {
	s.CountInvalid()
	return err
}

// CountInvalid implements regional.InvalidCounter: the call was refused
// before it was answered.
func (s *service) CountInvalid() {
	s.e.CountRequest("envoy", regional.Response{}, regional.ErrInvalidRequest)
}

// ShouldRateLimit implements envoy.service.ratelimit.v3.RateLimitService.
func (s *service) ShouldRateLimit(ctx context.Context, in *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	out, _, err := s.answer(ctx, in)
	return out, err
}

// answer is ShouldRateLimit, also returning the descriptors' checks (for tests).
func (s *service) answer(ctx context.Context, in *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, []check, error) {
	ds := in.GetDescriptors()
	switch {
	case len(ds) == 0:
		return nil, nil, s.refuse(status.Error(codes.InvalidArgument, "descriptors: at least one descriptor is required"))
	case len(ds) > MaxDescriptors:
		return nil, nil, s.refuse(status.Errorf(codes.InvalidArgument, "descriptors: %d descriptors, the maximum is %d", len(ds), MaxDescriptors))
	}
	if !s.e.Ready() {
		return nil, nil, status.Error(codes.Unavailable, regional.ErrNoRules.Error())
	}
	t := s.trees()
	checks := make([]check, len(ds))
	for i, d := range ds {
		if err := s.mapDescriptor(in, i, d, &checks[i]); err != nil {
			return nil, nil, s.refuse(err)
		}
		checks[i].node = t.resolve(in.GetDomain(), checks[i].path)
	}
	applyReplaces(checks)

	// Descriptors answered without a check (refunds, unlimited and zero
	// nodes) are answered below; the others are checked, concurrently when
	// there are several, so a request's latency is its slowest descriptor's.
	var wg sync.WaitGroup
	for i := range checks {
		c := &checks[i]
		if !c.needsCheck() {
			continue
		}
		c.route()
		c.fit(t.ix)
		run := func() {
			c.resp, c.err = s.e.Check(ctx, c.req)
			if costRefused(c.err) && !s.e.Enforces(c.req) {
				// A cost above the maximum limits only where a limit
				// applies: none, or only shadow ones, is OK, as when no
				// rule matches (envoyproxy/ratelimit counts hits_addend
				// only against the limits that apply).
				c.resp, c.err = regional.Response{Allowed: true, Statuses: []regional.Status{}}, nil
			}
			s.e.CountRequest("envoy", c.resp, c.err)
		}
		if len(checks) == 1 {
			run()
		} else {
			wg.Go(run)
		}
	}
	wg.Wait()

	out := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK,
		Statuses: make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(checks))}
	tightest := -1
	var overRate, quotas, overQuota int // envoyproxy/ratelimit's count of over-limit and quota-mode descriptors
	for i := range checks {
		c := &checks[i]
		if err := c.finish(); err != nil {
			return nil, nil, err
		}
		out.Statuses[i] = c.status
		quota := c.node != nil && c.node.quota && c.node.kind != kindUnlimited
		over := c.status.Code == rlsv3.RateLimitResponse_OVER_LIMIT
		switch {
		case quota && over:
			quotas++
			overQuota++
		case quota:
			quotas++
		case over:
			overRate++
		}
	}
	// Over limit when a descriptor not in quota mode is, or every quota-mode one is.
	if overRate > 0 || quotas > 0 && quotas == overQuota {
		out.OverallCode = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	// The headers are the most restrictive descriptor's; when the request
	// passes (quota-mode descriptors over limit, but not all), an allowed one's.
	for i := range checks {
		c := &checks[i]
		if c.answered() && (out.OverallCode == rlsv3.RateLimitResponse_OVER_LIMIT || c.resp.Allowed) &&
			(tightest < 0 || tighter(c, &checks[tightest])) {
			tightest = i
		}
	}
	if tightest >= 0 && (s.headers || out.OverallCode != rlsv3.RateLimitResponse_OK) {
		c := &checks[tightest]
		a := regional.HeaderAnswer(c.resp, c.req.Cost)
		fields := header.Fields(a)
		if s.headers {
			for _, f := range fields {
				out.ResponseHeadersToAdd = append(out.ResponseHeadersToAdd, &corev3.HeaderValue{Key: strings.ToLower(f.Name), Value: f.Value})
			}
		}
		if code, reason := header.Status(a); code != 200 && !hasRetryAfter(fields) {
			out.RawBody = []byte(fmt.Sprintf("descriptors[%d]: %s\n", tightest, reason)) // waiting cannot help: say why
		}
	}
	for i := range checks { // an over-long hits_addend is over limit, and says so
		if checks[i].costErr != "" && out.RawBody == nil {
			out.RawBody = []byte(checks[i].costErr + "\n")
		}
	}
	return out, checks, nil
}

func hasRetryAfter(fs []header.Field) bool {
	for _, f := range fs {
		if f.Name == header.RetryAfter {
			return true
		}
	}
	return false
}

// tighter reports whether descriptor a binds the client more than b:
// rejected before allowed, then rejected for good (waiting cannot help)
// before rejected for a while, then the longer retry, then the fewer
// remaining tokens.
func tighter(a, b *check) bool {
	ra, rb := a.resp, b.resp
	if ra.Allowed != rb.Allowed {
		return !ra.Allowed
	}
	if !ra.Allowed {
		if (ra.RetryAfterMs < 0) != (rb.RetryAfterMs < 0) {
			return ra.RetryAfterMs < 0
		}
		return ra.RetryAfterMs > rb.RetryAfterMs
	}
	return ra.Remaining < rb.Remaining
}
