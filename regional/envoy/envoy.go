package envoy

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/apportion/apportion/regional"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
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

// WithResponseHeaders makes every answer ask Envoy to add x-ratelimit-limit
// (tokens), x-ratelimit-remaining (tokens) and x-ratelimit-reset (whole
// seconds, rounded up) of the most restrictive descriptor to the client's
// response, and retry-after (whole seconds, at least 1) when over limit,
// with the same meaning as the HTTP API's headers. Default: off (Envoy's
// enable_x_ratelimit_headers can derive its own from the statuses instead).
func WithResponseHeaders(on bool) Option {
	return func(s *service) { s.headers = on }
}

// ServiceName is the Envoy rate-limit service's gRPC name, for health checks.
var ServiceName = rlsv3.RateLimitService_ServiceDesc.ServiceName

// Register adds envoy.service.ratelimit.v3.RateLimitService to s, answering
// from e. Call it before s serves, e.g. right after regional.NewGRPCServer.
func Register(s *grpc.Server, e *regional.Enforcer, opts ...Option) {
	rlsv3.RegisterRateLimitServiceServer(s, newService(e, opts...))
}

// service implements RateLimitService. It is immutable after newService.
type service struct {
	rlsv3.UnimplementedRateLimitServiceServer
	e            *regional.Enforcer
	clientKeys   []string
	resourceKeys []string
	headers      bool
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

// check is one descriptor mapped to an enforcer request.
type check struct {
	req       regional.Request
	refund    bool // is_negative_hits: answered OK, nothing checked
	index     int  // descriptor index
	entries   []*ratelimitv3.RateLimitDescriptor_Entry
	keyEntry  int    // entry that gave the client key
	resEntry  int    // entry that gave the resource; -1: the domain alone
	costField string // where the cost came from
}

// ShouldRateLimit implements envoy.service.ratelimit.v3.RateLimitService.
func (s *service) ShouldRateLimit(ctx context.Context, in *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	ds := in.GetDescriptors()
	switch {
	case len(ds) == 0:
		return nil, status.Error(codes.InvalidArgument, "descriptors: at least one descriptor is required")
	case len(ds) > MaxDescriptors:
		return nil, status.Errorf(codes.InvalidArgument, "descriptors: %d descriptors, the maximum is %d", len(ds), MaxDescriptors)
	}
	checks := make([]check, len(ds))
	for i, d := range ds {
		if err := s.mapDescriptor(in, i, d, &checks[i]); err != nil {
			return nil, err
		}
	}

	resps := make([]regional.Response, len(checks))
	errs := make([]error, len(checks))
	if len(checks) == 1 {
		if !checks[0].refund {
			resps[0], errs[0] = s.e.Check(ctx, checks[0].req)
			s.e.CountRequest("envoy", resps[0], errs[0])
		}
	} else {
		// Independent buckets: check them concurrently, so a request's
		// latency is its slowest descriptor's, not their sum.
		var wg sync.WaitGroup
		for i := range checks {
			if checks[i].refund {
				continue
			}
			wg.Go(func() {
				resps[i], errs[i] = s.e.Check(ctx, checks[i].req)
				s.e.CountRequest("envoy", resps[i], errs[i])
			})
		}
		wg.Wait()
	}
	for i, err := range errs {
		if err != nil {
			return nil, grpcError(err, &checks[i])
		}
	}

	out := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK,
		Statuses: make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(checks))}
	tightest := -1
	for i := range checks {
		if checks[i].refund {
			out.Statuses[i] = &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
			continue
		}
		out.Statuses[i] = descriptorStatus(resps[i])
		if !resps[i].Allowed {
			out.OverallCode = rlsv3.RateLimitResponse_OVER_LIMIT
		}
		if binding(resps[i]) != nil && (tightest < 0 || tighter(resps[i], resps[tightest])) {
			tightest = i
		}
	}
	if s.headers && tightest >= 0 {
		out.ResponseHeadersToAdd = responseHeaders(resps[tightest])
	}
	return out, nil
}

// mapDescriptor maps descriptor i of in to c, or returns an InvalidArgument
// status naming the offending part.
func (s *service) mapDescriptor(in *rlsv3.RateLimitRequest, i int, d *ratelimitv3.RateLimitDescriptor, c *check) error {
	entries := d.GetEntries()
	*c = check{index: i, entries: entries, keyEntry: -1, resEntry: -1, costField: "hits_addend"}
	if len(entries) == 0 {
		return status.Errorf(codes.InvalidArgument, "descriptors[%d].entries: at least one entry is required", i)
	}
	attrs := make(map[string]string, len(entries)+1)
	for j, e := range entries {
		if e.GetKey() == "" {
			return status.Errorf(codes.InvalidArgument, "%s: key is empty", c.entryName(j))
		}
		if _, dup := attrs[e.GetKey()]; !dup {
			attrs[e.GetKey()] = e.GetValue()
		}
	}
	if dom := in.GetDomain(); dom != "" {
		if _, ok := attrs[AttrDomain]; !ok {
			attrs[AttrDomain] = dom
		}
	}

	empty := -1 // a client key entry present with an empty value
	for _, k := range s.clientKeys {
		j := c.find(k)
		if j < 0 {
			continue
		}
		if entries[j].GetValue() == "" {
			if empty < 0 {
				empty = j
			}
			continue
		}
		c.keyEntry = j
		break
	}
	switch {
	case c.keyEntry < 0 && empty >= 0:
		return status.Errorf(codes.InvalidArgument, "%s: client key value is empty", c.entryName(empty))
	case c.keyEntry < 0:
		return status.Errorf(codes.InvalidArgument, "descriptors[%d]: no client key entry; want an entry keyed %s",
			i, strings.Join(s.clientKeys, ", "))
	case len(entries[c.keyEntry].GetValue()) > regional.MaxClientKeyBytes:
		return status.Errorf(codes.InvalidArgument, "%s: client key is %d bytes, the maximum is %d",
			c.entryName(c.keyEntry), len(entries[c.keyEntry].GetValue()), regional.MaxClientKeyBytes)
	}

	resource := in.GetDomain()
	if j := c.find(EntryResource); j >= 0 {
		c.resEntry, resource = j, entries[j].GetValue()
	} else {
		for _, k := range s.resourceKeys {
			if j := c.find(k); j >= 0 {
				c.resEntry = j
				if resource != "" {
					resource += " "
				}
				resource += entries[j].GetValue()
				break
			}
		}
	}

	cost := uint64(in.GetHitsAddend())
	if h := d.GetHitsAddend(); h != nil {
		cost, c.costField = h.GetValue(), fmt.Sprintf("descriptors[%d].hits_addend", i)
	}
	if cost > math.MaxInt64 {
		return status.Errorf(codes.InvalidArgument, "%s: %d is above the maximum of %d", c.costField, cost, int64(math.MaxInt64))
	}
	c.refund = d.GetIsNegativeHits()
	c.req = regional.Request{ClientKey: entries[c.keyEntry].GetValue(), Resource: resource, Cost: int64(cost), Attributes: attrs}
	return nil
}

// find is the index of the first entry keyed k, or -1.
func (c *check) find(k string) int {
	for j, e := range c.entries {
		if e.GetKey() == k {
			return j
		}
	}
	return -1
}

func (c *check) entryName(j int) string {
	return fmt.Sprintf("descriptors[%d].entries[%d] (key %q)", c.index, j, c.entries[j].GetKey())
}

// field names the part of the Envoy request that a regional.RequestError is about.
func (c *check) field(re *regional.RequestError) string {
	switch f := re.Field; {
	case f == "client_key":
		return c.entryName(c.keyEntry)
	case f == "resource" && c.resEntry >= 0:
		return c.entryName(c.resEntry)
	case f == "resource":
		return "domain"
	case f == "cost":
		return c.costField
	case strings.HasPrefix(f, "attributes."):
		k := strings.TrimPrefix(f, "attributes.")
		for j, e := range c.entries {
			if strings.HasPrefix(e.GetKey(), k) {
				return c.entryName(j)
			}
		}
		if strings.HasPrefix(AttrDomain, k) {
			return "domain"
		}
	}
	return fmt.Sprintf("descriptors[%d].entries", c.index)
}

// grpcError maps enforcer errors to gRPC status codes, in one place.
func grpcError(err error, c *check) error {
	var re *regional.RequestError
	switch {
	case errors.As(err, &re):
		return status.Errorf(codes.InvalidArgument, "%s: %s", c.field(re), re.Msg)
	case errors.Is(err, regional.ErrNoRules):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// binding is the status of r's binding rule, or nil when no enforced rule
// bound (no rule matched, or only shadow rules did).
func binding(r regional.Response) *regional.Status {
	if r.RuleID == "" {
		return nil
	}
	for i := range r.Statuses {
		if st := &r.Statuses[i]; st.RuleID == r.RuleID {
			if st.Shadow {
				return nil
			}
			return st
		}
	}
	return nil
}

// tighter reports whether a binds the client more than b: rejected before
// allowed, then the longer retry, then the fewer remaining tokens.
func tighter(a, b regional.Response) bool {
	if a.Allowed != b.Allowed {
		return !a.Allowed
	}
	if !a.Allowed {
		return a.RetryAfterMs > b.RetryAfterMs
	}
	return a.Remaining < b.Remaining
}

// descriptorStatus maps one check's answer. A failure-policy answer that
// allows (fail_open) is OK like any other allowed answer.
func descriptorStatus(r regional.Response) *rlsv3.RateLimitResponse_DescriptorStatus {
	st := &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
	if !r.Allowed {
		st.Code = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	b := binding(r)
	if b == nil {
		return st
	}
	st.CurrentLimit = currentLimit(b.RuleID, b.Limit, b.WindowMs)
	st.LimitRemaining = clampUint32(b.Remaining)
	reset := r.ResetAfterMs
	if !r.Allowed && r.RetryAfterMs >= 0 {
		reset = r.RetryAfterMs
	}
	if reset >= 0 {
		st.DurationUntilReset = durationpb.New(time.Duration(reset) * time.Millisecond)
	}
	return st
}

var units = [...]struct {
	unit rlsv3.RateLimitResponse_RateLimit_Unit
	secs float64
}{
	{rlsv3.RateLimitResponse_RateLimit_SECOND, 1},
	{rlsv3.RateLimitResponse_RateLimit_MINUTE, 60},
	{rlsv3.RateLimitResponse_RateLimit_HOUR, 3600},
	{rlsv3.RateLimitResponse_RateLimit_DAY, 86400},
}

// currentLimit expresses limit tokens per periodMs as a whole number of
// requests per the unit nearest to the period on a log scale (the next
// larger unit when that rounds to 0; at least 1 per DAY). It is nil when
// there is no rate to express.
func currentLimit(name string, limit, periodMs int64) *rlsv3.RateLimitResponse_RateLimit {
	if limit <= 0 || periodMs <= 0 {
		return nil
	}
	period := float64(periodMs) / 1000
	perSecond := float64(limit) / period
	u := 0
	for i := range units {
		if math.Abs(math.Log(period/units[i].secs)) < math.Abs(math.Log(period/units[u].secs)) {
			u = i
		}
	}
	n := math.Round(perSecond * units[u].secs)
	for n < 1 && u < len(units)-1 {
		u++
		n = math.Round(perSecond * units[u].secs)
	}
	n = max(n, 1)
	return &rlsv3.RateLimitResponse_RateLimit{Name: name, RequestsPerUnit: uint32(min(n, math.MaxUint32)), Unit: units[u].unit}
}

func clampUint32(v int64) uint32 {
	return uint32(min(max(v, 0), math.MaxUint32))
}

func ceilSeconds(ms int64) int64 {
	if ms <= 0 {
		return 0
	}
	return (ms + 999) / 1000
}

// Response header names (lower case: HTTP/2 and Envoy want them so).
const (
	HeaderLimit      = "x-ratelimit-limit"
	HeaderRemaining  = "x-ratelimit-remaining"
	HeaderReset      = "x-ratelimit-reset"
	HeaderRetryAfter = "retry-after"
)

// responseHeaders are the headers of r's binding rule, as the HTTP API sets them.
func responseHeaders(r regional.Response) []*corev3.HeaderValue {
	b := binding(r)
	h := []*corev3.HeaderValue{
		{Key: HeaderLimit, Value: strconv.FormatInt(b.Limit, 10)},
		{Key: HeaderRemaining, Value: strconv.FormatInt(b.Remaining, 10)},
		{Key: HeaderReset, Value: strconv.FormatInt(ceilSeconds(r.ResetAfterMs), 10)},
	}
	if !r.Allowed {
		h = append(h, &corev3.HeaderValue{Key: HeaderRetryAfter, Value: strconv.FormatInt(max(ceilSeconds(r.RetryAfterMs), 1), 10)})
	}
	return h
}
