package envoy

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// TestRefusedCallsCountedInvalid: a ShouldRateLimit call refused as the
// client's fault (no descriptor, more than MaxDescriptors, a hits_addend
// beyond any cost, a request that does not decode or is over the message
// size limit) is counted once in apportion_requests_total{protocol="envoy",
// result="invalid"}, as a descriptor refused by its check (a hits_addend
// above the enforcer's maximum cost) is.
func TestRefusedCallsCountedInvalid(t *testing.T) {
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { client.Close() })
	st, err := redisstore.New(client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	reg := prometheus.NewRegistry()
	cfg := regional.DefaultConfig()
	cfg.Region, cfg.Timeout = "us-east", time.Second
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg.Metrics = regional.NewMetrics(reg, cfg.Region)
	e, err := regional.New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	r := rules.Rule{ID: "all", Algorithm: rules.TokenBucket, Capacity: 100, RefillPerSecond: 10}
	r.Normalize()
	if err := e.SetRules([]rules.Rule{r}); err != nil {
		t.Fatal(err)
	}
	conn := serve(t, e)

	one := func(hits uint64) *rlsv3.RateLimitRequest {
		return &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*ratelimitv3.RateLimitDescriptor{
			{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "client_key", Value: "u"}}, HitsAddend: wrapperspb.UInt64(hits)}}}
	}
	many := &rlsv3.RateLimitRequest{Domain: "d"}
	for range MaxDescriptors + 1 {
		many.Descriptors = append(many.Descriptors, one(1).Descriptors[0])
	}
	tests := []struct {
		name string
		body any
		want codes.Code
	}{
		{"cost above the maximum (checked)", one(1 << 30), codes.OK},
		{"no descriptors", &rlsv3.RateLimitRequest{Domain: "d"}, codes.InvalidArgument},
		{"65 descriptors", many, codes.InvalidArgument},
		{"hits_addend beyond any cost", one(1 << 63), codes.InvalidArgument},
		{"malformed", protowire.AppendTag(nil, 2, protowire.BytesType), codes.InvalidArgument},
		{"over the message size", &rlsv3.RateLimitRequest{Domain: strings.Repeat("d", 5<<20), Descriptors: one(1).Descriptors}, codes.ResourceExhausted},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			labels := map[string]string{"protocol": "envoy", "result": "invalid"}
			before, _ := testutil.Metric(t, reg, regional.MetricRequests, labels)
			var resp rlsv3.RateLimitResponse
			err := conn.Invoke(context.Background(), "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", tc.body, &resp, grpc.ForceCodec(rawCodec{}))
			if status.Code(err) != tc.want {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			if after, _ := testutil.Metric(t, reg, regional.MetricRequests, labels); after-before != 1 {
				t.Errorf("invalid envoy calls rose by %v, want 1", after-before)
			}
		})
	}
}
