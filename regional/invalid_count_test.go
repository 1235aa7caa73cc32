package regional

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/rules"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
)

// TestRefusedCallsCountedInvalid: every call refused as the client's fault
// is counted once in apportion_requests_total{result="invalid"} under its
// protocol, also those refused before any check: a gRPC request that does
// not decode or is over the message size limit, a batch over MaxBatch, an
// HTTP body over 64 KiB or another method than POST.
func TestRefusedCallsCountedInvalid(t *testing.T) {
	st, _ := miniStore(t)
	reg := prometheus.NewRegistry()
	cfg := DefaultConfig()
	cfg.Region, cfg.Timeout, cfg.Logger = "us-east", time.Second, quietLogger()
	cfg.Metrics = NewMetrics(reg, cfg.Region)
	enf, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	r := tokenBucket("tb", 10, 1)
	r.Normalize()
	if err := enf.SetRules([]rules.Rule{r}); err != nil {
		t.Fatal(err)
	}
	conn := serveGRPC(t, enf)
	srv := httptest.NewServer(NewHTTPHandler(enf, nil, nil))
	t.Cleanup(srv.Close)

	invalid := func(protocol string) float64 {
		v, _ := testutil.Metric(t, reg, MetricRequests, map[string]string{"protocol": protocol, "result": "invalid"})
		return v
	}
	grpcCall := func(method string, body any, want codes.Code) func(t *testing.T) {
		return func(t *testing.T) {
			var resp ratelimitv1.CheckLimitsResponse
			err := conn.Invoke(context.Background(), "/ratelimit.v1.RateLimiter/"+method, body, &resp, grpc.ForceCodec(rawCodec{}))
			if status.Code(err) != want {
				t.Fatalf("got %v, want %v", err, want)
			}
		}
	}
	httpCall := func(method, body string, want int) func(t *testing.T) {
		return func(t *testing.T) {
			req, err := http.NewRequest(method, srv.URL+"/v1/check", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != want {
				t.Fatalf("status %d, want %d", resp.StatusCode, want)
			}
		}
	}
	tooMany := &ratelimitv1.CheckLimitsRequest{}
	for range MaxBatch + 1 {
		tooMany.Requests = append(tooMany.Requests, &ratelimitv1.CheckLimitRequest{ClientKey: "u"})
	}
	tests := []struct {
		name, protocol string
		call           func(t *testing.T)
	}{
		{"grpc bad key (checked)", "grpc", grpcCall("CheckLimit", &ratelimitv1.CheckLimitRequest{ClientKey: ""}, codes.InvalidArgument)},
		{"grpc malformed CheckLimit", "grpc", grpcCall("CheckLimit", protowire.AppendTag(nil, 1, protowire.BytesType), codes.InvalidArgument)},
		{"grpc malformed CheckLimits", "grpc", grpcCall("CheckLimits", []byte{0x00}, codes.InvalidArgument)},
		{"grpc batch over MaxBatch", "grpc", grpcCall("CheckLimits", tooMany, codes.InvalidArgument)},
		{"grpc over the message size", "grpc", grpcCall("CheckLimit", &ratelimitv1.CheckLimitRequest{ClientKey: "u", Resource: strings.Repeat("r", 5<<20)}, codes.ResourceExhausted)},
		{"http bad JSON (decoded)", "http", httpCall(http.MethodPost, "{", http.StatusBadRequest)},
		{"http body over 64 KiB", "http", httpCall(http.MethodPost, `{"client_key":"`+strings.Repeat("k", maxBody)+`"}`, http.StatusRequestEntityTooLarge)},
		{"http GET", "http", httpCall(http.MethodGet, "", http.StatusMethodNotAllowed)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := invalid(tc.protocol)
			tc.call(t)
			if got := invalid(tc.protocol) - before; got != 1 {
				t.Errorf("apportion_requests_total{protocol=%q,result=\"invalid\"} rose by %v, want 1", tc.protocol, got)
			}
		})
	}
}
