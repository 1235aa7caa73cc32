package regional

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// MaxBatch is the largest CheckLimits batch.
const MaxBatch = 1000

// GRPCService implements ratelimit.v1.RateLimiter on an Enforcer.
type GRPCService struct {
	ratelimitv1.UnimplementedRateLimiterServer
	e      *Enforcer
	Health *health.Server
	others []string // more services on the server, for health
}

// NewGRPCServer returns a gRPC server with the RateLimiter service, the
// standard health service and server reflection registered. The health
// status of "" and "ratelimit.v1.RateLimiter" is NOT_SERVING until
// SetServing is called.
func NewGRPCServer(e *Enforcer, opts ...grpc.ServerOption) (*grpc.Server, *GRPCService) {
	opts = append([]grpc.ServerOption{grpc.ForceServerCodec(lenientCodec{})}, opts...)
	s := grpc.NewServer(opts...)
	svc := &GRPCService{e: e, Health: health.NewServer()}
	RegisterService(s, &ratelimitv1.RateLimiter_ServiceDesc, svc)
	healthpb.RegisterHealthServer(s, svc.Health)
	reflection.Register(s)
	svc.SetServing(false)
	return s, svc
}

// AlsoServes adds a service registered on the same server (the Envoy
// protocol) to those whose health status SetServing sets. Call it before
// SetServing.
func (s *GRPCService) AlsoServes(service string) {
	s.others = append(s.others, service)
}

// SetServing sets the health status of the server and the service.
func (s *GRPCService) SetServing(ok bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ok {
		st = healthpb.HealthCheckResponse_SERVING
	}
	s.Health.SetServingStatus("", st)
	s.Health.SetServingStatus(ratelimitv1.RateLimiter_ServiceDesc.ServiceName, st)
	for _, o := range s.others {
		s.Health.SetServingStatus(o, st)
	}
}

// ShedHeader is the gRPC response header set on an answer given without the
// store because the enforcer was overloaded (Response.Shed): "1" for
// CheckLimit, the comma-separated indexes of the shed requests for CheckLimits.
const ShedHeader = "apportion-shed"

// CountInvalid implements InvalidCounter: a call refused before it was
// checked is counted as invalid under grpc.
func (s *GRPCService) CountInvalid() {
	s.e.metrics.request("grpc", Response{}, ErrInvalidRequest)
}

// CheckLimit implements ratelimit.v1.RateLimiter.
func (s *GRPCService) CheckLimit(ctx context.Context, in *ratelimitv1.CheckLimitRequest) (*ratelimitv1.CheckLimitResponse, error) {
	resp, err := s.e.Check(ctx, fromProto(in))
	s.e.metrics.request("grpc", resp, err)
	if err != nil {
		return nil, grpcError(err)
	}
	if resp.Shed {
		_ = grpc.SetHeader(ctx, metadata.Pairs(ShedHeader, "1"))
	}
	return toProto(resp), nil
}

// CheckLimits implements ratelimit.v1.RateLimiter: the requests are checked
// together (one pipeline to Redis) and answered in order, each as CheckLimit
// would answer it alone; an invalid one fails the whole batch and names its
// index.
func (s *GRPCService) CheckLimits(ctx context.Context, in *ratelimitv1.CheckLimitsRequest) (*ratelimitv1.CheckLimitsResponse, error) {
	if len(in.GetRequests()) > MaxBatch {
		s.CountInvalid()
		return nil, status.Errorf(codes.InvalidArgument, "requests: %d requests, the maximum is %d", len(in.GetRequests()), MaxBatch)
	}
	reqs := make([]Request, len(in.GetRequests()))
	for i, r := range in.GetRequests() {
		reqs[i] = fromProto(r)
	}
	resps, err := s.e.CheckBatch(ctx, reqs)
	if err != nil {
		s.e.metrics.request("grpc", Response{}, err)
		var be *BatchError
		var re *RequestError
		if errors.As(err, &be) && errors.As(be.Err, &re) {
			return nil, status.Errorf(codes.InvalidArgument, "requests[%d].%s: %s", be.Index, re.Field, re.Msg)
		}
		return nil, grpcError(err)
	}
	// The answers and their statuses in three allocations, not three each.
	out := &ratelimitv1.CheckLimitsResponse{Responses: make([]*ratelimitv1.CheckLimitResponse, len(resps))}
	n := 0
	for _, resp := range resps {
		n += len(resp.Statuses)
	}
	msgs, sts, ptrs := make([]ratelimitv1.CheckLimitResponse, len(resps)), make([]ratelimitv1.RuleStatus, n), make([]*ratelimitv1.RuleStatus, n)
	var shed []string
	for i, resp := range resps {
		s.e.metrics.request("grpc", resp, nil)
		k := len(resp.Statuses)
		toProtoInto(resp, &msgs[i], sts[:k:k], ptrs[:k:k])
		sts, ptrs = sts[k:], ptrs[k:]
		out.Responses[i] = &msgs[i]
		if resp.Shed {
			shed = append(shed, strconv.Itoa(i))
		}
	}
	if len(shed) > 0 {
		_ = grpc.SetHeader(ctx, metadata.Pairs(ShedHeader, strings.Join(shed, ",")))
	}
	return out, nil
}

func isInvalid(err error) bool { return errors.Is(err, ErrInvalidRequest) }

// grpcError maps enforcer errors to gRPC status codes (GRPCStatus).
func grpcError(err error) error { return GRPCStatus(err, nil) }

// GRPCStatus maps an enforcer error to its gRPC status, for every gRPC
// service the enforcer serves (RateLimiter here, Envoy's in regional/envoy):
// a RequestError is InvalidArgument naming the field (as field names it,
// when given: a service whose requests spell fields otherwise), no rule set
// is Unavailable, the caller's cancellation and deadline keep their codes,
// anything else is Internal.
func GRPCStatus(err error, field func(*RequestError) string) error {
	var re *RequestError
	switch {
	case errors.As(err, &re):
		name := re.Field
		if field != nil {
			name = field(re)
		}
		return status.Errorf(codes.InvalidArgument, "%s: %s", name, re.Msg)
	case errors.Is(err, ErrNoRules):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

func fromProto(in *ratelimitv1.CheckLimitRequest) Request {
	return Request{ClientKey: in.GetClientKey(), Resource: in.GetResource(), Cost: in.GetCost(), Attributes: in.GetAttributes()}
}

func toProto(r Response) *ratelimitv1.CheckLimitResponse {
	if len(r.Statuses) <= 1 {
		// The answer of one rule in one allocation, not three.
		one := &oneProto{}
		k := len(r.Statuses)
		toProtoInto(r, &one.resp, one.sts[:k], one.ptrs[:k])
		return &one.resp
	}
	out := &ratelimitv1.CheckLimitResponse{}
	toProtoInto(r, out, make([]ratelimitv1.RuleStatus, len(r.Statuses)), make([]*ratelimitv1.RuleStatus, len(r.Statuses)))
	return out
}

// oneProto holds toProto's answer of at most one status.
type oneProto struct {
	resp ratelimitv1.CheckLimitResponse
	sts  [1]ratelimitv1.RuleStatus
	ptrs [1]*ratelimitv1.RuleStatus
}

// toProtoInto fills out (zero) with r, its statuses in sts and ptrs (both of
// len(r.Statuses)).
func toProtoInto(r Response, out *ratelimitv1.CheckLimitResponse, sts []ratelimitv1.RuleStatus, ptrs []*ratelimitv1.RuleStatus) {
	out.Allowed, out.Limit, out.Remaining = r.Allowed, r.Limit, r.Remaining
	out.RetryAfterMs, out.ResetAfterMs, out.RuleId, out.FailOpen, out.WindowMs = r.RetryAfterMs, r.ResetAfterMs, r.RuleID, r.FailOpen, r.WindowMs
	for i, s := range r.Statuses {
		sts[i] = ratelimitv1.RuleStatus{RuleId: s.RuleID, Allowed: s.Allowed, Limit: s.Limit, Remaining: s.Remaining,
			RetryAfterMs: s.RetryAfterMs, ResetAfterMs: s.ResetAfterMs, Shadow: s.Shadow, WindowMs: s.WindowMs}
		ptrs[i] = &sts[i]
	}
	out.Statuses = ptrs
}

// lenientCodec is the proto codec, except that a CheckLimitRequest whose
// strings are not valid UTF-8 still decodes (proto3 refuses it, and gRPC
// would answer Internal); the enforcer then answers InvalidArgument naming
// the field.
type lenientCodec struct{}

func (lenientCodec) Name() string { return "proto" }

func (lenientCodec) Marshal(v any) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("regional: codec: cannot marshal %T", v)
	}
	return proto.Marshal(m)
}

func (c lenientCodec) Unmarshal(data []byte, v any) error {
	if t, ok := v.(*decodeTarget); ok {
		t.err = c.Unmarshal(data, t.msg)
		if t.err != nil && t.lenient != nil && t.lenient(data, t.msg) == nil {
			t.err = nil
		}
		return nil
	}
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("regional: codec: cannot unmarshal into %T", v)
	}
	err := proto.Unmarshal(data, m)
	if err == nil {
		return nil
	}
	switch t := v.(type) {
	case *ratelimitv1.CheckLimitRequest:
		if e := decodeRequestLenient(data, t); e == nil {
			return nil
		}
	case *ratelimitv1.CheckLimitsRequest:
		if e := decodeBatchLenient(data, t); e == nil {
			return nil
		}
	}
	return err
}

// WalkFields calls fn with every field of the protobuf message b: its
// number, its wire type, and its value (the bytes of a length-delimited
// field, or a varint). Other wire types are skipped. No UTF-8 checks: it
// is what a lenient decoder (RegisterServiceLenient) is built on.
func WalkFields(b []byte, fn func(num protowire.Number, typ protowire.Type, raw []byte, v uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		var raw []byte
		var v uint64
		switch typ {
		case protowire.BytesType:
			raw, n = protowire.ConsumeBytes(b)
		case protowire.VarintType:
			v, n = protowire.ConsumeVarint(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if err := fn(num, typ, raw, v); err != nil {
			return err
		}
	}
	return nil
}

// decodeRequestLenient decodes a CheckLimitRequest without UTF-8 checks.
func decodeRequestLenient(b []byte, out *ratelimitv1.CheckLimitRequest) error {
	out.Reset()
	return WalkFields(b, func(num protowire.Number, typ protowire.Type, raw []byte, v uint64) error {
		switch {
		case num == 1 && typ == protowire.BytesType:
			out.ClientKey = string(raw)
		case num == 2 && typ == protowire.BytesType:
			out.Resource = string(raw)
		case num == 3 && typ == protowire.VarintType:
			out.Cost = int64(v)
		case num == 4 && typ == protowire.BytesType: // a map entry: key 1, value 2
			var key, val string
			err := WalkFields(raw, func(num protowire.Number, typ protowire.Type, raw []byte, _ uint64) error {
				if typ == protowire.BytesType && num == 1 {
					key = string(raw)
				} else if typ == protowire.BytesType && num == 2 {
					val = string(raw)
				}
				return nil
			})
			if err != nil {
				return err
			}
			if out.Attributes == nil {
				out.Attributes = map[string]string{}
			}
			out.Attributes[key] = val
		}
		return nil
	})
}

// decodeBatchLenient decodes a CheckLimitsRequest without UTF-8 checks.
func decodeBatchLenient(b []byte, out *ratelimitv1.CheckLimitsRequest) error {
	out.Reset()
	return WalkFields(b, func(num protowire.Number, typ protowire.Type, raw []byte, _ uint64) error {
		if num != 1 || typ != protowire.BytesType {
			return nil
		}
		r := &ratelimitv1.CheckLimitRequest{}
		if err := decodeRequestLenient(raw, r); err != nil {
			return err
		}
		out.Requests = append(out.Requests, r)
		return nil
	})
}
