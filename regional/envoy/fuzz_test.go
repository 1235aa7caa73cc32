package envoy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
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
	return miniEnforcer(t, []rules.Rule{
		{ID: "all", Algorithm: rules.TokenBucket, Capacity: 100, RefillPerSecond: 10},
		{ID: "tier", Match: map[string]string{"tier": "*"}, Key: []string{"tier", "client_key"}, Algorithm: rules.FixedWindow, Limit: 10, Window: rules.Duration(60e9)},
	})
}

// miniEnforcer is an enforcer over the real store on an embedded
// miniredis, with the rules rs.
func miniEnforcer(t testing.TB, rs []rules.Rule) *regional.Enforcer {
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
	conn := serve(t, fuzzEnforcer(t))
	for name, body := range map[string][]byte{
		"truncated": protowire.AppendTag(nil, 2, protowire.BytesType),
		"field 0":   {0x00},
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

// serve serves the Envoy service of e on a loopback port and returns a
// connection to it; both end with the test.
func serve(t *testing.T, e *regional.Enforcer) *grpc.ClientConn {
	t.Helper()
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
	return conn
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

// FuzzShouldRateLimit: every request that decodes (every request the
// Envoy protocol accepts) gets an answer per descriptor that encodes, each
// OK or OVER_LIMIT, and every descriptor is checked within the enforcer's
// limits (none refused by it, but for a cost above its maximum, which is
// that descriptor's OVER_LIMIT); the call fails only as documented:
// InvalidArgument for no descriptors, more than MaxDescriptors, or a
// hits_addend above 2^63-1, naming it.
func FuzzShouldRateLimit(f *testing.F) {
	long := strings.Repeat("a", 1100)
	many := func(n int) *ratelimitv3.RateLimitDescriptor {
		d := &ratelimitv3.RateLimitDescriptor{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{
			{Key: "remote_address", Value: "10.0.0.1"}, {Key: "path", Value: "/many"}}}
		for i := len(d.Entries); i < n; i++ {
			d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: fmt.Sprintf("e%d", i), Value: "v"})
		}
		return d
	}
	for _, in := range []*rlsv3.RateLimitRequest{
		{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{
			{Key: "remote_address", Value: "10.0.0.1"}, {Key: "path", Value: "/orders"}, {Key: "tier", Value: "free"}}}}, HitsAddend: 2},
		{Descriptors: []*ratelimitv3.RateLimitDescriptor{
			{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "client_key", Value: "u"}, {Key: "resource", Value: "GET /"}}, HitsAddend: wrapperspb.UInt64(3)},
			{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "api_key", Value: ""}, {Key: "user_id", Value: "v"}}, IsNegativeHits: true}}},
		// The tester's report: a long :path with its query string.
		{Domain: "edge2", Descriptors: []*ratelimitv3.RateLimitDescriptor{
			{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "remote_address", Value: "198.51.100.9"}}},
			{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "remote_address", Value: "198.51.100.9"}, {Key: "path", Value: "/index.html?q=" + long}}}}},
		{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{
			{Key: "client_key", Value: "u"}, {Key: "path", Value: strings.Repeat("p", 1018)}}}}},
		{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{
			{Key: "client_key", Value: "u"}, {Key: "resource", Value: long}}}}},
		{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{
			{Key: "client_key", Value: "u"}, {Key: long, Value: "v"}, {Key: hashedForm(long), Value: "w"}}}}},
		{Domain: long, Descriptors: []*ratelimitv3.RateLimitDescriptor{{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{
			{Key: "tier", Value: "free"}}}}},
		{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{many(62), many(63), many(64), many(65), many(200)}},
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
		resp, checks, err := s.answer(context.Background(), in)
		if want := refusal(in); want != "" || err != nil {
			if msg := status.Convert(err).Message(); status.Code(err) != codes.InvalidArgument || want == "" || !strings.HasPrefix(msg, want) {
				t.Fatalf("got %v: want the call refused only as documented (%q)", err, want)
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
			c := &checks[i]
			var re *regional.RequestError
			if errors.As(c.err, &re) && (re.Field != "cost" || st.GetCode() != rlsv3.RateLimitResponse_OVER_LIMIT) {
				t.Fatalf("descriptor %d: the enforcer refused its mapping: %v", i, c.err)
			}
			if c.needsCheck() && (len(c.req.Attributes) > maxAttributes || len(c.req.Resource) > maxFieldBytes ||
				len(c.req.ClientKey) > regional.MaxClientKeyBytes) {
				t.Fatalf("descriptor %d: mapped beyond the enforcer's limits: %d attributes, %d-byte resource, %d-byte client key",
					i, len(c.req.Attributes), len(c.req.Resource), len(c.req.ClientKey))
			}
		}
		if _, err := proto.Marshal(resp); err != nil {
			t.Fatalf("answer does not encode: %v", err)
		}
	})
}

// refusal is the start of the message of the documented InvalidArgument
// for in, or "" when every descriptor must be answered.
func refusal(in *rlsv3.RateLimitRequest) string {
	ds := in.GetDescriptors()
	switch {
	case len(ds) == 0:
		return "descriptors: at least one descriptor is required"
	case len(ds) > MaxDescriptors:
		return fmt.Sprintf("descriptors: %d descriptors, the maximum is %d", len(ds), MaxDescriptors)
	}
	for i, d := range ds {
		field, cost := "hits_addend", uint64(in.GetHitsAddend())
		if h := d.GetHitsAddend(); h != nil {
			field, cost = fmt.Sprintf("descriptors[%d].hits_addend", i), h.GetValue()
		}
		if cost > math.MaxInt64 {
			return fmt.Sprintf("%s: %d is above the maximum", field, cost)
		}
	}
	return ""
}
