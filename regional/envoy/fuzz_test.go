package envoy

import (
	"context"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// fuzzEnforcer is an enforcer over the real store on an embedded miniredis,
// with a rule on every request and one keyed by an attribute.
func fuzzEnforcer(t testing.TB) *regional.Enforcer {
	t.Helper()
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { client.Close() })
	st, err := redisstore.New(client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	cfg := regional.DefaultConfig()
	cfg.Region = "us-east"
	cfg.Timeout = time.Second // the CI machine is small and shared; a fail-open answer stores nothing
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	e, err := regional.New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	rs := []rules.Rule{
		{ID: "all", Algorithm: rules.TokenBucket, Capacity: 100, RefillPerSecond: 10},
		{ID: "tier", Match: map[string]string{"tier": "*"}, Key: []string{"tier", "client_key"}, Algorithm: rules.FixedWindow, Limit: 10, Window: rules.Duration(60e9)},
	}
	for i := range rs {
		rs[i].Normalize()
	}
	if err := e.SetRules(rs); err != nil {
		t.Fatal(err)
	}
	return e
}

// A request that does not decode as protobuf answers InvalidArgument (gRPC
// alone answers Internal), and the service keeps serving.
func TestMalformedRequestIsInvalidArgument(t *testing.T) {
	e := fuzzEnforcer(t)
	gs, _ := regional.NewGRPCServer(e)
	Register(gs, e)
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
	entry := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "client_key")
	entry = protowire.AppendBytes(protowire.AppendTag(entry, 2, protowire.BytesType), []byte{'u', 0xff})
	d := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), entry)
	invalidUTF8 := protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), d)
	for name, body := range map[string][]byte{
		"truncated":           protowire.AppendTag(nil, 2, protowire.BytesType),
		"field 0":             {0x00},
		"invalid UTF-8 value": invalidUTF8,
	} {
		t.Run(name, func(t *testing.T) {
			var resp rlsv3.RateLimitResponse
			err := conn.Invoke(context.Background(), "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", body, &resp, grpc.ForceCodec(rawCodec{}))
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "malformed envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit request") {
				t.Fatalf("got %v, want InvalidArgument naming the method", err)
			}
		})
	}
	resp, err := rlsv3.NewRateLimitServiceClient(conn).ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{
		Descriptors: []*ratelimitv3.RateLimitDescriptor{{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "client_key", Value: "u"}}}}})
	if err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		t.Fatalf("valid request after malformed ones: %v %v", resp, err)
	}
}

// rawCodec sends []byte as they are.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }
func (rawCodec) Marshal(v any) ([]byte, error) {
	if b, ok := v.([]byte); ok {
		return b, nil
	}
	return proto.Marshal(v.(proto.Message))
}
func (rawCodec) Unmarshal(b []byte, v any) error { return proto.Unmarshal(b, v.(proto.Message)) }

// FuzzShouldRateLimit: every request that decodes gets either an answer
// per descriptor that encodes, or InvalidArgument naming the part at fault
// (a descriptor, an entry, the domain or hits_addend), never another code,
// and every descriptor's code is OK or OVER_LIMIT.
func FuzzShouldRateLimit(f *testing.F) {
	for _, in := range []*rlsv3.RateLimitRequest{
		{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{
			{Key: "remote_address", Value: "10.0.0.1"}, {Key: "path", Value: "/orders"}, {Key: "tier", Value: "free"}}}}, HitsAddend: 2},
		{Descriptors: []*ratelimitv3.RateLimitDescriptor{
			{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "client_key", Value: "u"}, {Key: "resource", Value: "GET /"}}, HitsAddend: wrapperspb.UInt64(3)},
			{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "api_key", Value: ""}, {Key: "user_id", Value: "v"}}, IsNegativeHits: true}}},
	} {
		b, err := proto.Marshal(in)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	s := newService(fuzzEnforcer(f))
	f.Fuzz(func(t *testing.T, data []byte) {
		in := &rlsv3.RateLimitRequest{}
		if proto.Unmarshal(data, in) != nil {
			return // the codec answers InvalidArgument (TestMalformedRequestIsInvalidArgument)
		}
		resp, err := s.ShouldRateLimit(context.Background(), in)
		if err != nil {
			msg := status.Convert(err).Message()
			if status.Code(err) != codes.InvalidArgument || !(strings.HasPrefix(msg, "descriptors") || strings.HasPrefix(msg, "domain") || strings.HasPrefix(msg, "hits_addend")) {
				t.Fatalf("got %v: want InvalidArgument naming the part at fault", err)
			}
			return
		}
		if len(resp.GetStatuses()) != len(in.GetDescriptors()) {
			t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), len(in.GetDescriptors()))
		}
		for i, st := range resp.GetStatuses() {
			if c := st.GetCode(); c != rlsv3.RateLimitResponse_OK && c != rlsv3.RateLimitResponse_OVER_LIMIT {
				t.Fatalf("descriptor %d: code %v", i, c)
			}
		}
		if _, err := proto.Marshal(resp); err != nil {
			t.Fatalf("answer does not encode: %v", err)
		}
	})
}
