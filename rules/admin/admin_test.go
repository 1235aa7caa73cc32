package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const token = "s3cret-token"

const goodDoc = `{"id":"orders","match":{"resource":"POST /orders"},"algorithm":"token_bucket","capacity":20,"refill_per_second":10}`

type env struct {
	srv   *httptest.Server
	h     *Handler
	store *etcdstore.Store
	etcd  *clientv3.Client
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := testutil.StartEtcd(t)
	c := e.Client(t)
	s, err := etcdstore.New(c)
	if err != nil {
		t.Fatal(err)
	}
	h, err := New(s, WithToken(token))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &env{srv: srv, h: h, store: s, etcd: c}
}

type reply struct {
	code int
	hdr  http.Header
	body []byte
	err  apiError
}

func (e *env) do(t *testing.T, method, path, body string, hdr map[string]string) reply {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, e.srv.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		if v == "" {
			req.Header.Del(k)
		} else {
			req.Header.Set(k, v)
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	r := reply{code: resp.StatusCode, hdr: resp.Header, body: b}
	if resp.StatusCode >= 300 {
		if err := json.Unmarshal(b, &r.err); err != nil || r.err.Error == "" {
			t.Fatalf("%s %s: %d with a body that is not a JSON error: %q", method, path, resp.StatusCode, b)
		}
	}
	return r
}

// stored returns every key under the prefix with its value and mod revision.
func (e *env) stored(t *testing.T) map[string]string {
	t.Helper()
	resp, err := e.etcd.Get(context.Background(), etcdstore.DefaultPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, kv := range resp.Kvs {
		out[string(kv.Key)] = fmt.Sprintf("%s@%d", kv.Value, kv.ModRevision)
	}
	return out
}

func TestNewRequiresAuthChoice(t *testing.T) {
	e := testutil.StartEtcd(t)
	s, err := etcdstore.New(e.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(s); err == nil || !strings.Contains(err.Error(), "WithoutAuth") {
		t.Fatalf("New without auth option: %v, want an error that names WithoutAuth", err)
	}
	if _, err := New(s, WithToken("")); err == nil {
		t.Fatal("New with an empty token succeeded")
	}
	if _, err := New(s, WithToken("x"), WithoutAuth()); err == nil {
		t.Fatal("New with both WithToken and WithoutAuth succeeded")
	}
	h, err := New(s, WithoutAuth())
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/rules", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("GET /rules without auth on a WithoutAuth handler: %d", rec.Code)
	}
}

func TestRuleLifecycle(t *testing.T) {
	e := newEnv(t)

	if r := e.do(t, "GET", "/healthz", "", map[string]string{"Authorization": ""}); r.code != 200 {
		t.Fatalf("healthz: %d", r.code)
	}
	// Create only; the body may leave the id out (taken from the path).
	noID := strings.Replace(goodDoc, `"id":"orders",`, "", 1)
	r := e.do(t, "PUT", "/rules/orders", noID, map[string]string{"If-None-Match": "*"})
	if r.code != 200 || r.hdr.Get("ETag") == "" {
		t.Fatalf("create: %d %s", r.code, r.body)
	}
	etag1 := r.hdr.Get("ETag")
	if r := e.do(t, "PUT", "/rules/orders", goodDoc, map[string]string{"If-None-Match": "*"}); r.code != http.StatusPreconditionFailed {
		t.Fatalf("second create: %d %s, want 412", r.code, r.body)
	}

	r = e.do(t, "GET", "/rules/orders", "", nil)
	if r.code != 200 || r.hdr.Get("ETag") != etag1 {
		t.Fatalf("get: %d etag %q, want %q", r.code, r.hdr.Get("ETag"), etag1)
	}
	var got rules.Rule
	if err := json.Unmarshal(r.body, &got); err != nil || got.ID != "orders" || got.Capacity != 20 || got.Scope != rules.Regional {
		t.Fatalf("get body %s (%v): want the normalized rule", r.body, err)
	}

	upd := strings.Replace(goodDoc, `"capacity":20`, `"capacity":30`, 1)
	r = e.do(t, "PUT", "/rules/orders", upd, map[string]string{"If-Match": etag1})
	if r.code != 200 || r.hdr.Get("ETag") == etag1 {
		t.Fatalf("conditional update: %d %s", r.code, r.body)
	}
	etag2 := r.hdr.Get("ETag")
	if r := e.do(t, "PUT", "/rules/orders", upd, map[string]string{"If-Match": "*"}); r.code != 200 {
		t.Fatalf("If-Match * on existing rule: %d %s", r.code, r.body)
	}
	if r := e.do(t, "PUT", "/rules/missing", strings.Replace(goodDoc, "orders", "missing", 1), map[string]string{"If-Match": "*"}); r.code != 412 {
		t.Fatalf("If-Match * on missing rule: %d %s, want 412", r.code, r.body)
	}

	if _, err := e.store.Put(context.Background(), rules.Rule{ID: "b", Algorithm: rules.TokenBucket, Capacity: 1, RefillPerSecond: 1}, 0); err != nil {
		t.Fatal(err)
	}
	r = e.do(t, "GET", "/rules", "", nil)
	var list []rules.Rule
	if err := json.Unmarshal(r.body, &list); err != nil || r.code != 200 || len(list) != 2 || list[0].ID != "b" || list[1].ID != "orders" || r.hdr.Get("ETag") == "" {
		t.Fatalf("list: %d %s", r.code, r.body)
	}

	if r := e.do(t, "DELETE", "/rules/orders", "", map[string]string{"If-Match": etag2}); r.code != 412 || r.err.Field != "If-Match" {
		t.Fatalf("delete with stale If-Match: %d %s, want 412", r.code, r.body)
	}
	cur := e.do(t, "GET", "/rules/orders", "", nil).hdr.Get("ETag")
	if r := e.do(t, "DELETE", "/rules/orders", "", map[string]string{"If-Match": cur}); r.code != 204 {
		t.Fatalf("delete: %d %s", r.code, r.body)
	}
	if r := e.do(t, "GET", "/rules/orders", "", nil); r.code != 404 {
		t.Fatalf("get deleted: %d", r.code)
	}
	if r := e.do(t, "DELETE", "/rules/orders", "", nil); r.code != 404 {
		t.Fatalf("delete missing: %d", r.code)
	}
	// An id no rule can have, with nothing under it: 400 naming it, not 404.
	if r := e.do(t, "GET", "/rules/a%20b", "", nil); r.code != 400 || r.err.Field != "id" || !strings.Contains(string(r.body), "a b") {
		t.Fatalf("get of an invalid id: %d %s, want 400 naming the id", r.code, r.body)
	}
}

// TestBadInputChangesNothing sends every kind of bad PUT and checks the
// status, that the error is JSON naming the field where one is at fault, and
// that nothing stored changed.
func TestBadInputChangesNothing(t *testing.T) {
	e := newEnv(t)
	first := e.do(t, "PUT", "/rules/orders", goodDoc, nil)
	if first.code != 200 {
		t.Fatalf("seed: %d %s", first.code, first.body)
	}
	// Make the seed's ETag stale.
	if r := e.do(t, "PUT", "/rules/orders", strings.Replace(goodDoc, `"capacity":20`, `"capacity":21`, 1), nil); r.code != 200 {
		t.Fatalf("seed update: %d", r.code)
	}
	big := `{"id":"orders","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"match":{"resource":"` + strings.Repeat("x", 10<<20) + `"}}`
	cases := []struct {
		name   string
		body   string
		hdr    map[string]string
		code   int
		field  string
		inText string
	}{
		{"unknown field", strings.Replace(goodDoc, `"capacity"`, `"bogus":1,"capacity"`, 1), nil, 400, "bogus", "bogus"},
		{"negative capacity", strings.Replace(goodDoc, `"capacity":20`, `"capacity":-5`, 1), nil, 400, "capacity", "capacity"},
		{"zero refill", strings.Replace(goodDoc, `"refill_per_second":10`, `"refill_per_second":0`, 1), nil, 400, "refill_per_second", "refill_per_second"},
		{"unknown algorithm", strings.Replace(goodDoc, `"token_bucket"`, `"magic_bucket"`, 1), nil, 400, "algorithm", "algorithm"},
		{"window abc", `{"id":"orders","algorithm":"fixed_window","limit":5,"window":"abc"}`, nil, 400, "window", "abc"},
		{"stranded floors", `{"id":"orders","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"scope":"global","regions":{"a":1,"b":1},"min_share":0.1}`, nil, 400, "min_share", "whole token"},
		{"id disagrees with path", strings.Replace(goodDoc, `"id":"orders"`, `"id":"other"`, 1), nil, 400, "id", "does not match"},
		{"10 MB document", big, nil, 413, "", "limit"},
		{"invalid JSON", `{"id":"orders",`, nil, 400, "", "JSON"},
		{"not JSON content type", goodDoc, map[string]string{"Content-Type": "text/plain"}, 415, "Content-Type", "application/json"},
		{"stale If-Match", goodDoc, map[string]string{"If-Match": first.hdr.Get("ETag")}, 412, "If-Match", "revision"},
		{"malformed If-Match", goodDoc, map[string]string{"If-Match": "12"}, 400, "If-Match", "entity tag"},
		{"missing token", goodDoc, map[string]string{"Authorization": ""}, 401, "Authorization", "token"},
		{"wrong token", goodDoc, map[string]string{"Authorization": "Bearer nope"}, 401, "Authorization", "token"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := e.stored(t)
			r := e.do(t, "PUT", "/rules/orders", tc.body, tc.hdr)
			if r.code != tc.code || r.err.Field != tc.field || !strings.Contains(r.err.Error, tc.inText) {
				t.Fatalf("got %d field %q error %q; want %d field %q error containing %q",
					r.code, r.err.Field, r.err.Error, tc.code, tc.field, tc.inText)
			}
			if after := e.stored(t); !reflect.DeepEqual(before, after) {
				t.Fatalf("store changed:\n%v\n%v", before, after)
			}
		})
	}
	// Reads need the token too.
	for _, path := range []string{"/rules", "/rules/orders"} {
		if r := e.do(t, "GET", path, "", map[string]string{"Authorization": ""}); r.code != 401 {
			t.Fatalf("GET %s without token: %d", path, r.code)
		}
	}
	if r := e.do(t, "DELETE", "/rules/orders", "", map[string]string{"Authorization": "Bearer nope"}); r.code != 401 {
		t.Fatalf("DELETE with wrong token: %d", r.code)
	}
	if r := e.do(t, "GET", "/rules/orders", "", nil); r.code != 200 {
		t.Fatalf("rule gone after refused requests: %d", r.code)
	}
}

// countingReader counts the bytes the handler reads from a body.
type countingReader struct {
	r io.Reader
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

func TestHugeBodyIsNotReadWhole(t *testing.T) {
	e := newEnv(t)
	body := &countingReader{r: io.MultiReader(strings.NewReader(`{"id":"x","match":{"a":"`), bytes.NewReader(make([]byte, 10<<20)))}
	req := httptest.NewRequest("PUT", "/rules/x", body)
	req.ContentLength = -1 // chunked: the size is unknown up front
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+token)
	rec := httptest.NewRecorder()
	e.h.ServeHTTP(rec, req)
	if rec.Code != http.StatusRequestEntityTooLarge {
		t.Fatalf("status %d %s, want 413", rec.Code, rec.Body)
	}
	if body.n > 2*MaxBodyBytes {
		t.Fatalf("handler read %d bytes of a 10 MB body; want at most about %d", body.n, MaxBodyBytes)
	}
	if len(e.stored(t)) != 0 {
		t.Fatal("something was stored")
	}
}

func TestClientMirrorsStore(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	c, err := NewClient(e.srv.URL, token, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := rules.Rule{ID: "c1", Algorithm: rules.TokenBucket, Capacity: 5, RefillPerSecond: 2}
	rev, err := c.Put(ctx, r, etcdstore.MustNotExist)
	if err != nil || rev == 0 {
		t.Fatalf("put: %d %v", rev, err)
	}
	if _, err := c.Put(ctx, r, etcdstore.MustNotExist); !errors.Is(err, etcdstore.ErrConflict) {
		t.Fatalf("second create: %v, want ErrConflict", err)
	}
	got, grev, err := c.Get(ctx, "c1")
	if err != nil || grev != rev || got.Capacity != 5 {
		t.Fatalf("get: %+v %d %v", got, grev, err)
	}
	if _, err := c.Put(ctx, rules.Rule{ID: "c1", Algorithm: rules.TokenBucket, Capacity: -1, RefillPerSecond: 2}, 0); err == nil {
		t.Fatal("invalid rule accepted")
	} else if fe := (*rules.FieldError)(nil); !errors.As(err, &fe) || fe.Field != "capacity" {
		t.Fatalf("invalid rule: %v, want a FieldError naming capacity", err)
	}
	if _, _, err := c.Get(ctx, "nope"); !errors.Is(err, etcdstore.ErrNotFound) {
		t.Fatalf("get missing: %v", err)
	}
	if list, lrev, err := c.List(ctx); err != nil || len(list) != 1 || lrev < rev {
		t.Fatalf("list: %v %d %v", list, lrev, err)
	}
	if err := c.Delete(ctx, "c1", rev+100); !errors.Is(err, etcdstore.ErrConflict) {
		t.Fatalf("stale delete: %v", err)
	}
	if err := c.Delete(ctx, "c1", rev); err != nil {
		t.Fatal(err)
	}
	bad, _ := NewClient(e.srv.URL, "wrong", nil)
	if _, _, err := bad.List(ctx); !errors.Is(err, ErrUnauthorized) {
		t.Fatalf("wrong token: %v", err)
	}
}

// While etcd is down every store route answers 503 with the JSON error body
// and Retry-After within the store timeout, and serves again once etcd is
// back.
func TestEtcdDownAnswers503WithinTheStoreTimeout(t *testing.T) {
	testutil.CheckGoroutines(t)
	e := testutil.StartEtcd(t)
	s, err := etcdstore.New(e.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	const timeout = 300 * time.Millisecond
	h, err := New(s, WithToken(token), WithStoreTimeout(timeout))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	env := &env{srv: srv, h: h, store: s}
	if r := env.do(t, "PUT", "/rules/orders", goodDoc, nil); r.code != 200 {
		t.Fatalf("PUT before the outage: %d %s", r.code, r.body)
	}
	e.Stop()
	for _, c := range []struct{ method, path, body string }{
		{"GET", "/rules", ""}, {"GET", "/rules/orders", ""}, {"PUT", "/rules/orders", goodDoc}, {"DELETE", "/rules/orders", ""},
	} {
		start := time.Now()
		r := env.do(t, c.method, c.path, c.body, nil)
		d := time.Since(start)
		t.Logf("%s %s with etcd down: %d in %v: %s", c.method, c.path, r.code, d, bytes.TrimSpace(r.body))
		if r.code != http.StatusServiceUnavailable || !strings.Contains(r.err.Error, "did not answer within 300ms") ||
			r.hdr.Get("Retry-After") == "" || r.hdr.Get("Content-Type") != "application/json" {
			t.Errorf("%s %s: %d %v %s, want 503 JSON naming the timeout, with Retry-After", c.method, c.path, r.code, r.hdr, r.body)
		}
		if c.method != "GET" && !strings.Contains(r.err.Error, "may or may not have been applied") {
			t.Errorf("%s %s: the error does not say the write's outcome is unknown: %s", c.method, c.path, r.body)
		}
		if d > timeout+2*time.Second {
			t.Errorf("%s %s took %v with a store timeout of %v", c.method, c.path, d, timeout)
		}
	}
	if r := env.do(t, "GET", "/healthz", "", nil); r.code != 200 {
		t.Errorf("/healthz with etcd down: %d, want 200 (the process is alive)", r.code)
	}
	e.Restart(t)
	testutil.WaitFor(t, 30*time.Second, "the admin API after etcd returned", func() bool {
		return env.do(t, "GET", "/rules/orders", "", nil).code == 200
	})
}

func TestStoreTimeoutOption(t *testing.T) {
	if _, err := New(&etcdstore.Store{}, WithoutAuth(), WithStoreTimeout(0)); err == nil || !strings.Contains(err.Error(), "positive") {
		t.Fatalf("got %v, want a refusal of a zero timeout", err)
	}
}
