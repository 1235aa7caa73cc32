package middleware

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// fakeChecker is pure logic: it allows the first n calls per key.
type fakeChecker struct {
	n    int
	seen map[string]int
	err  error
	last *ratelimitv1.CheckLimitRequest
}

func (f *fakeChecker) CheckLimit(_ context.Context, in *ratelimitv1.CheckLimitRequest, _ ...grpc.CallOption) (*ratelimitv1.CheckLimitResponse, error) {
	f.last = in
	if f.err != nil {
		return nil, f.err
	}
	f.seen[in.ClientKey]++
	used := f.seen[in.ClientKey]
	ok := used <= f.n
	resp := &ratelimitv1.CheckLimitResponse{Allowed: ok, Limit: int64(f.n), RuleId: "per-ip", ResetAfterMs: 1500}
	if ok {
		resp.Remaining = int64(f.n - used)
	} else {
		resp.RetryAfterMs = 1200
	}
	return resp, nil
}

func TestMiddleware(t *testing.T) {
	quiet := WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	tests := []struct {
		name       string
		checker    *fakeChecker
		opts       []Option
		calls      int
		wantStatus int
		wantHeader map[string]string
	}{
		{"allowed", &fakeChecker{n: 2}, nil, 1, 200, map[string]string{"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "1", "X-RateLimit-Reset": "2"}},
		{"rejected with Retry-After", &fakeChecker{n: 2}, nil, 3, 429, map[string]string{"Retry-After": "2", "X-RateLimit-Remaining": "0"}},
		{"enforcer down fails open", &fakeChecker{err: errors.New("unavailable")}, nil, 1, 200, nil},
		{"enforcer down, fail closed", &fakeChecker{err: errors.New("unavailable")}, []Option{WithFailClosed()}, 1, 503, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.checker.seen = map[string]int{}
			mw, err := New(tt.checker, append(tt.opts, quiet)...)
			if err != nil {
				t.Fatal(err)
			}
			h := mw(ok)
			var rec *httptest.ResponseRecorder
			for i := 0; i < tt.calls; i++ {
				rec = httptest.NewRecorder()
				req := httptest.NewRequest("POST", "/orders", nil)
				req.RemoteAddr = "203.0.113.7:5555"
				h.ServeHTTP(rec, req)
			}
			if rec.Code != tt.wantStatus {
				t.Fatalf("status %d, want %d", rec.Code, tt.wantStatus)
			}
			for k, v := range tt.wantHeader {
				if got := rec.Header().Get(k); got != v {
					t.Errorf("%s = %q, want %q", k, got, v)
				}
			}
			if tt.checker.last.ClientKey != "203.0.113.7" || tt.checker.last.Resource != "POST /orders" {
				t.Errorf("request sent: %+v", tt.checker.last)
			}
		})
	}
}

func TestOptionsValidate(t *testing.T) {
	if _, err := New(nil); err == nil {
		t.Error("nil checker accepted")
	}
	if _, err := New(&fakeChecker{}, WithTimeout(0)); err == nil {
		t.Error("zero timeout accepted")
	}
	if _, err := New(&fakeChecker{}, WithKey(nil)); err == nil {
		t.Error("nil key function accepted")
	}
}

// ExampleNew wraps a handler with the enforcer of the local region.
func ExampleNew() {
	// In production: conn, _ := grpc.NewClient("127.0.0.1:8081", append(client.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	//                (client.DialOptions: reconnect within a second of the enforcer's return)
	//                client := ratelimitv1.NewRateLimiterClient(conn)
	client := &fakeChecker{n: 1, seen: map[string]int{}}
	mw, err := New(client,
		WithKey(func(r *http.Request) string { return r.Header.Get("X-User") }),
		WithAttributes(func(r *http.Request) map[string]string { return map[string]string{"tier": r.Header.Get("X-Tier")} }),
	)
	if err != nil {
		panic(err)
	}
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "hello") }))
	for i := 0; i < 2; i++ {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("GET", "/feed", nil)
		req.Header.Set("X-User", "user:42")
		h.ServeHTTP(rec, req)
		fmt.Println(rec.Code, rec.Header().Get("X-RateLimit-Remaining"))
	}
	// Output:
	// 200 0
	// 429 0
}

// staticChecker answers every check with resp.
type staticChecker struct {
	resp *ratelimitv1.CheckLimitResponse
}

func (s staticChecker) CheckLimit(context.Context, *ratelimitv1.CheckLimitRequest, ...grpc.CallOption) (*ratelimitv1.CheckLimitResponse, error) {
	return s.resp, nil
}

func TestHonestAnswers(t *testing.T) {
	tests := []struct {
		name       string
		resp       *ratelimitv1.CheckLimitResponse
		wantStatus int
		wantBody   string
		wantHeader map[string]string // "" : absent
	}{
		{"cost above capacity: 413, no Retry-After", &ratelimitv1.CheckLimitResponse{RuleId: "llm", Limit: 3, Remaining: 3, RetryAfterMs: -1,
			Statuses: []*ratelimitv1.RuleStatus{{RuleId: "llm", Limit: 3, Remaining: 3, RetryAfterMs: -1, WindowMs: 3000}}},
			413, `cost 5 is above the 3 tokens rule "llm" admits here at most: waiting cannot help`,
			map[string]string{"Retry-After": "", "X-RateLimit-Limit": "3", "RateLimit-Policy": `"llm";q=3;w=3`}},
		{"shadow only: no headers", &ratelimitv1.CheckLimitResponse{Allowed: true, RuleId: "trial", Limit: 1,
			Statuses: []*ratelimitv1.RuleStatus{{RuleId: "trial", Shadow: true, Limit: 1, RetryAfterMs: 500, WindowMs: 1000}}},
			200, "ok", map[string]string{"X-RateLimit-Limit": "", "RateLimit": "", "Retry-After": ""}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			mw, err := New(staticChecker{tc.resp}, WithCost(func(*http.Request) int64 { return 5 }))
			if err != nil {
				t.Fatal(err)
			}
			rec := httptest.NewRecorder()
			mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })).
				ServeHTTP(rec, httptest.NewRequest("POST", "/complete", nil))
			if rec.Code != tc.wantStatus || !strings.Contains(rec.Body.String(), tc.wantBody) {
				t.Errorf("%d %q, want %d containing %q", rec.Code, rec.Body, tc.wantStatus, tc.wantBody)
			}
			for k, v := range tc.wantHeader {
				if got := rec.Header().Get(k); got != v {
					t.Errorf("%s = %q, want %q", k, got, v)
				}
			}
		})
	}
}

// TestClientCannotChooseNoBucket: a key, resource or cost the enforcer
// would refuse never lets a request through as if the enforcer were down.
// An empty key (WithKey reading an absent header) is the remote IP; an
// over-long or non-UTF-8 key or resource its hashed form; a check the
// enforcer still refuses (InvalidArgument) answers 400, or 413 for its
// cost. Before, each was a failed check: the request went through.
func TestClientCannotChooseNoBucket(t *testing.T) {
	quiet := WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	byHeader := WithKey(func(r *http.Request) string { return r.Header.Get("X-User") })
	for _, tc := range []struct {
		name, user, path string
		wantKey, wantRes string
	}{
		{"absent header", "", "/a", "203.0.113.7", "GET /a"},
		{"long key", strings.Repeat("u", 300), "/a", "sha256:", "GET /a"},
		{"invalid key", "u\xff", "/a", "sha256:", "GET /a"},
		{"long path", "alice", "/" + strings.Repeat("p", 1100), "alice", "sha256:"},
		{"invalid path", "alice", "/\xff", "alice", "sha256:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeChecker{n: 1, seen: map[string]int{}}
			mw, err := New(f, byHeader, quiet)
			if err != nil {
				t.Fatal(err)
			}
			h := mw(ok)
			var codes []int
			for range 2 {
				rec := httptest.NewRecorder()
				req := httptest.NewRequest("GET", "/", nil)
				req.URL.Path = tc.path
				req.RemoteAddr = "203.0.113.7:5555"
				if tc.user != "" {
					req.Header.Set("X-User", tc.user)
				}
				h.ServeHTTP(rec, req)
				codes = append(codes, rec.Code)
			}
			if codes[0] != 200 || codes[1] != 429 {
				t.Errorf("statuses %v, want 200 then 429 (limited)", codes)
			}
			if !strings.HasPrefix(f.last.ClientKey, tc.wantKey) || !strings.HasPrefix(f.last.Resource, tc.wantRes) || len(f.last.ClientKey) > 256 || len(f.last.Resource) > 1024 {
				t.Errorf("sent key %.20q resource %.20q, want %q... and %q...", f.last.ClientKey, f.last.Resource, tc.wantKey, tc.wantRes)
			}
		})
	}
	for _, tc := range []struct {
		msg  string
		want int
	}{
		{"cost: 5000 is above the maximum of 1000", http.StatusRequestEntityTooLarge},
		{"cost: must not be negative, got -1", http.StatusBadRequest},
		{"attributes: has 65 entries, the maximum is 64", http.StatusBadRequest},
	} {
		f := &fakeChecker{err: status.Error(codes.InvalidArgument, tc.msg), seen: map[string]int{}}
		mw, err := New(f, quiet)
		if err != nil {
			t.Fatal(err)
		}
		rec := httptest.NewRecorder()
		mw(ok).ServeHTTP(rec, httptest.NewRequest("GET", "/a", nil))
		if rec.Code != tc.want || !strings.Contains(rec.Body.String(), tc.msg) {
			t.Errorf("refused %q: %d %q, want %d naming it (never let through)", tc.msg, rec.Code, rec.Body.String(), tc.want)
		}
	}
}
