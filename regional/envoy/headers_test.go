package envoy_test

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"strings"
	"testing"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/envoy"
	"github.com/apportion/apportion/regional/header"
	"github.com/apportion/apportion/regional/middleware"
	"github.com/apportion/apportion/rules"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// frontEnd asks one front end of the enforcer and returns the rate-limit
// headers of its answer and its HTTP status (for Envoy: 200 for OK, 429
// for OVER_LIMIT, 413 when the body says that waiting cannot help).
type frontEnd func(t *testing.T, key, resource string, cost int64) (http.Header, int)

// limitHeaders keeps the headers regional/header writes.
func limitHeaders(h http.Header) http.Header {
	out := http.Header{}
	for _, k := range []string{header.Limit, header.Remaining, header.Reset, header.Policy, header.RateLimit, header.RetryAfter} {
		if v := h.Values(k); len(v) > 0 {
			out[k] = v
		}
	}
	return out
}

// TestSameHeadersEverywhere asks the same questions through the HTTP API,
// the Go middleware and the Envoy service of one enforcer (each with its own
// client key, so with the same bucket states) and expects the same
// rate-limit headers from all three: allowed, rejected (with Retry-After),
// a cost above the capacity (413 and no Retry-After), and a request only a
// shadow rule matches (no headers).
func TestSameHeadersEverywhere(t *testing.T) {
	// A refill of 0.001/s: nothing refills during the test, so the resets
	// are the same whenever each front end asks.
	tb := tokenBucket("orders", "POST /orders", 3, 0.001)
	trial := tokenBucket("trial", "GET /trial", 1, 0.001)
	trial.Shadow = true
	e := newEnv(t, []rules.Rule{tb, trial}, envoy.WithResponseHeaders(true))

	api := httptest.NewServer(regional.NewHTTPHandler(e.enf, nil, nil))
	t.Cleanup(api.Close)
	viaHTTP := func(t *testing.T, key, resource string, cost int64) (http.Header, int) {
		body := fmt.Sprintf(`{"client_key":%q,"resource":%q,"cost":%d}`, key, resource, cost)
		resp, err := http.Post(api.URL+"/v1/check", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusRequestEntityTooLarge && !bytes.Contains(b, []byte(`"reason":"cost 5 is above the 3 tokens rule \"orders\" admits here at most`)) {
			t.Errorf("HTTP 413 body %s, want the reason", b)
		}
		return limitHeaders(resp.Header), resp.StatusCode
	}

	conn, err := grpc.NewClient(e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	mw, err := middleware.New(ratelimitv1.NewRateLimiterClient(conn),
		middleware.WithKey(func(r *http.Request) string { return r.Header.Get("X-Key") }),
		middleware.WithResource(func(r *http.Request) string { return r.Header.Get("X-Resource") }),
		middleware.WithCost(func(r *http.Request) int64 { c, _ := strconv.ParseInt(r.Header.Get("X-Cost"), 10, 64); return c }),
		middleware.WithTimeout(5e9), middleware.WithFailClosed(),
		middleware.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		t.Fatal(err)
	}
	app := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	viaMiddleware := func(t *testing.T, key, resource string, cost int64) (http.Header, int) {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("GET", "/", nil)
		req.Header.Set("X-Key", key)
		req.Header.Set("X-Resource", resource)
		req.Header.Set("X-Cost", fmt.Sprint(cost))
		app.ServeHTTP(rec, req)
		if rec.Code == http.StatusRequestEntityTooLarge && !strings.Contains(rec.Body.String(), "waiting cannot help") {
			t.Errorf("middleware 413 body %q, want the reason", rec.Body)
		}
		if rec.Code == http.StatusServiceUnavailable {
			t.Fatal("middleware: enforcer unavailable")
		}
		return limitHeaders(rec.Header()), rec.Code
	}

	viaEnvoy := func(t *testing.T, key, resource string, cost int64) (http.Header, int) {
		d := desc("client_key", key, "resource", resource)
		d.HitsAddend = wrapperspb.UInt64(uint64(cost))
		resp := e.ask(t, &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{d}})
		h := http.Header{}
		for _, hv := range resp.ResponseHeadersToAdd {
			if hv.Key != strings.ToLower(hv.Key) {
				t.Errorf("Envoy header %q is not lower case", hv.Key)
			}
			h.Add(hv.Key, hv.Value)
		}
		code := http.StatusOK
		switch {
		case resp.OverallCode == rlsv3.RateLimitResponse_OK:
		case strings.Contains(string(resp.RawBody), "cost 5 is above the 3 tokens rule \"orders\" admits here at most: waiting cannot help"):
			code = http.StatusRequestEntityTooLarge
		default:
			code = http.StatusTooManyRequests
		}
		return limitHeaders(h), code
	}

	steps := []struct {
		name     string
		resource string
		cost     int64
		code     int
		want     http.Header
	}{
		{"allowed", "POST /orders", 1, 200, http.Header{header.Limit: {"3"}, header.Remaining: {"2"}, header.Reset: {"1000"},
			header.Policy: {`"orders";q=3;w=3000`}, header.RateLimit: {`"orders";r=2;t=1000`}}},
		{"allowed, empty", "POST /orders", 2, 200, http.Header{header.Limit: {"3"}, header.Remaining: {"0"}, header.Reset: {"3000"},
			header.Policy: {`"orders";q=3;w=3000`}, header.RateLimit: {`"orders";r=0;t=3000`}}},
		{"rejected", "POST /orders", 1, 429, http.Header{header.Limit: {"3"}, header.Remaining: {"0"}, header.Reset: {"3000"},
			header.Policy: {`"orders";q=3;w=3000`}, header.RateLimit: {`"orders";r=0;t=3000`}, header.RetryAfter: {"1000"}}},
		{"cost above capacity", "POST /orders", 5, 413, http.Header{header.Limit: {"3"}, header.Remaining: {"0"}, header.Reset: {"3000"},
			header.Policy: {`"orders";q=3;w=3000`}, header.RateLimit: {`"orders";r=0;t=3000`}}},
		{"shadow only", "GET /trial", 1, 200, http.Header{}},
		{"shadow only, would reject", "GET /trial", 1, 200, http.Header{}},
	}
	fronts := []struct {
		name string
		ask  frontEnd
	}{{"http", viaHTTP}, {"middleware", viaMiddleware}, {"envoy", viaEnvoy}}
	for _, st := range steps {
		var first http.Header
		for i, f := range fronts {
			h, code := f.ask(t, "client-"+f.name, st.resource, st.cost)
			if code != st.code {
				t.Errorf("%s via %s: status %d, want %d", st.name, f.name, code, st.code)
			}
			if !reflect.DeepEqual(h, st.want) {
				t.Errorf("%s via %s: headers %v, want %v", st.name, f.name, h, st.want)
			}
			if i == 0 {
				first = h
			} else if !reflect.DeepEqual(h, first) {
				t.Errorf("%s: %s headers %v differ from %s headers %v", st.name, f.name, h, fronts[0].name, first)
			}
		}
	}
}
