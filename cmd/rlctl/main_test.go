package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/admin"
	"github.com/apportion/apportion/rules/etcdstore"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

const token = "t0ken"

const ordersRule = `{ "id": "orders-free",
  "match": { "resource": "POST /orders", "tier": "free" },
  "key": ["client_key"],
  "algorithm": "token_bucket", "capacity": 20, "refill_per_second": 10,
  "scope": "global",
  "regions": { "us-east": 2, "eu-west": 1, "ap-south": 1 },
  "min_share": 0.1,
  "failure_mode": "open",
  "shadow": false }`

const listYAML = `- id: login
  match: {resource: "POST /login"}
  algorithm: fixed_window
  limit: 5
  window: 1m
  failure_mode: local
- id: search
  algorithm: sliding_window
  limit: 100
  window: 1s
`

type fixture struct {
	store     *etcdstore.Store
	client    *clientv3.Client
	endpoints string
	adminURL  string
	dir       string
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	e := testutil.StartEtcd(t)
	ec := e.Client(t)
	s, err := etcdstore.New(ec)
	if err != nil {
		t.Fatal(err)
	}
	h, err := admin.New(s, admin.WithToken(token))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &fixture{store: s, client: ec, endpoints: e.Endpoint, adminURL: srv.URL, dir: t.TempDir()}
}

func (f *fixture) file(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(f.dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

type result struct {
	stdout, stderr string
	err            error
	code           int
}

func rlctl(t *testing.T, args ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	err := run(context.Background(), args, &out, &errb)
	return result{out.String(), errb.String(), err, exitCode(err)}
}

func (r result) must(t *testing.T, code int, contains ...string) result {
	t.Helper()
	if r.code != code {
		t.Fatalf("exit %d (err %v), want %d\nstdout:\n%s\nstderr:\n%s", r.code, r.err, code, r.stdout, r.stderr)
	}
	all := r.stdout + r.stderr
	if r.err != nil {
		all += r.err.Error()
	}
	for _, s := range contains {
		if !strings.Contains(all, s) {
			t.Fatalf("output does not contain %q:\nstdout:\n%s\nstderr:\n%s\nerr: %v", s, r.stdout, r.stderr, r.err)
		}
	}
	return r
}

// TestRulesCommands runs the same operator session against etcd directly
// and through the admin API.
func TestRulesCommands(t *testing.T) {
	f := newFixture(t)
	backends := map[string][]string{
		"etcd":  {"--etcd-endpoints", f.endpoints},
		"admin": {"--admin-url", f.adminURL, "--token", token},
	}
	for name, global := range backends {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			for _, r := range []string{"orders-free", "login", "search"} {
				f.store.Delete(ctx, r, 0)
			}
			cmd := func(args ...string) result { return rlctl(t, append(append([]string{}, global...), args...)...) }

			cmd("rules", "put", "-f", f.file(t, "one.json", ordersRule)).must(t, exitOK, "orders-free", "stored")
			cmd("rules", "put", "-f", f.file(t, "list.yaml", listYAML)).must(t, exitOK, "login", "search")
			cmd("rules", "put", "--create", "-f", f.file(t, "one.json", ordersRule)).must(t, exitConflict, "exists")

			var list []rules.Rule
			out := cmd("rules", "list", "-o", "json").must(t, exitOK).stdout
			if err := json.Unmarshal([]byte(out), &list); err != nil || len(list) != 3 || list[0].ID != "login" {
				t.Fatalf("list -o json: %v\n%s", err, out)
			}
			cmd("rules", "list").must(t, exitOK, "ID", "ALGORITHM", "orders-free", "10/s burst 20", "5 per 1m")

			cmd("rules", "get", "orders-free").must(t, exitOK, "revision", "regions", "us-east=2")
			var got rules.Rule
			out = cmd("rules", "get", "orders-free", "-o", "json").must(t, exitOK).stdout
			if err := json.Unmarshal([]byte(out), &got); err != nil || got.Capacity != 20 || got.Scope != rules.Global {
				t.Fatalf("get -o json: %v\n%s", err, out)
			}
			cmd("rules", "get", "nope").must(t, exitNotFound, "not found")

			cmd("rules", "shadow", "orders-free", "on").must(t, exitOK, "shadow set on")
			cmd("rules", "shadow", "orders-free", "on").must(t, exitOK, "already on")
			if r, _, _ := f.store.Get(ctx, "orders-free"); !r.Shadow {
				t.Fatal("shadow not stored")
			}
			cmd("rules", "shadow", "orders-free", "maybe").must(t, exitUsage, "on or off")

			_, rev, _ := f.store.Get(ctx, "orders-free")
			cmd("limits", "set", "orders-free", "--rate", "40", "--burst", "80").must(t, exitOK, "rate 40/s, burst 80")
			r, _, _ := f.store.Get(ctx, "orders-free")
			if r.RefillPerSecond != 40 || r.Capacity != 80 || !r.Shadow || r.Regions["us-east"] != 2 {
				t.Fatalf("after limits set: %+v", r)
			}
			cmd("limits", "set", "orders-free", "--rate", "1", "--if-match", itoa(rev)).must(t, exitConflict, "revision")
			cmd("limits", "set", "login", "--rate", "1").must(t, exitFailure, "token_bucket")
			cmd("limits", "set", "orders-free").must(t, exitUsage, "--rate")

			// us-east weight 2 of 4: half the rate and burst; floor 10% of that.
			show := cmd("limits", "show", "orders-free").must(t, exitOK, "REGION", "live shares: give --agents").stdout
			if !hasRow(show, "us-east", "2", "20", "40", "2") || !hasRow(show, "eu-west", "1", "10", "20", "1") {
				t.Fatalf("limits show:\n%s", show)
			}
			var view limitsView
			out = cmd("limits", "show", "orders-free", "-o", "json").must(t, exitOK).stdout
			if err := json.Unmarshal([]byte(out), &view); err != nil || len(view.Regions) != 3 || view.Regions[2].StaticRate == nil || *view.Regions[2].StaticRate != 20 {
				t.Fatalf("limits show -o json: %v\n%s", err, out)
			}

			// A bad rule file: exit 1, the field named, nothing stored changed.
			before, _, _ := f.store.List(ctx)
			bad := strings.Replace(ordersRule, `"capacity": 20`, `"capacity": -20`, 1)
			cmd("rules", "put", "-f", f.file(t, "bad.json", bad)).must(t, exitFailure, "capacity")
			if after, _, _ := f.store.List(ctx); !sameRules(before, after) {
				t.Fatalf("store changed by a refused put")
			}

			cmd("rules", "delete", "search", "--if-match", "1").must(t, exitConflict)
			cmd("rules", "delete", "search").must(t, exitOK, "deleted search")
			cmd("rules", "delete", "search").must(t, exitNotFound)
		})
	}
}

func itoa(n int64) string { b, _ := json.Marshal(n); return string(b) }

func sameRules(a, b []rules.Rule) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}

// hasRow reports whether some line holds exactly these whitespace-separated cells.
func hasRow(table string, cells ...string) bool {
	for _, line := range strings.Split(table, "\n") {
		if strings.Join(strings.Fields(line), " ") == strings.Join(cells, " ") {
			return true
		}
	}
	return false
}

func TestValidateOffline(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) string {
		p := filepath.Join(dir, name)
		os.WriteFile(p, []byte(s), 0o600)
		return p
	}
	// No store flags: validate never talks to etcd.
	rlctl(t, "rules", "validate", "-f", write("ok.json", ordersRule)).must(t, exitOK, "ok: 1 valid rule(s): orders-free")
	rlctl(t, "rules", "validate", "-f", write("ok.yaml", listYAML)).must(t, exitOK, "2 valid", "login, search")
	single := "id: one\nalgorithm: token_bucket\ncapacity: 1\nrefill_per_second: 1\n"
	rlctl(t, "rules", "validate", "-f", write("single.yaml", single)).must(t, exitOK, "one")
	for _, tc := range []struct{ name, doc, field string }{
		{"negative capacity", strings.Replace(ordersRule, `"capacity": 20`, `"capacity": -1`, 1), "capacity"},
		{"unknown field", strings.Replace(ordersRule, `"shadow"`, `"shadw"`, 1), "shadw"},
		{"bad window", `{"id":"w","algorithm":"fixed_window","limit":1,"window":"abc"}`, "window"},
		{"unknown algorithm", strings.Replace(ordersRule, "token_bucket", "magic", 1), "algorithm"},
		{"stranded floors", `{"id":"one","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"scope":"global","regions":{"a":1,"b":1},"min_share":0.1}`, "min_share"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rlctl(t, "rules", "validate", "-f", write(tc.name+".json", tc.doc)).must(t, exitFailure, tc.field)
		})
	}
	rlctl(t, "rules", "validate").must(t, exitUsage, "-f FILE")
	rlctl(t, "rules", "validate", "-f", filepath.Join(dir, "missing.json")).must(t, exitFailure, "no such file")
}

func TestUsageAndEnv(t *testing.T) {
	rlctl(t).must(t, exitUsage, "no command", "Exit codes")
	rlctl(t, "frobnicate").must(t, exitUsage, "unknown command")
	rlctl(t, "rules", "frob").must(t, exitUsage, "unknown command")
	rlctl(t, "-h").must(t, exitOK, "Exit codes: 0 ok, 1 failure or invalid rule, 2 usage error, 3 not found")
	rlctl(t, "rules", "list", "-h").must(t, exitOK, "Exit codes")
	rlctl(t, "rules", "list").must(t, exitUsage, "--etcd-endpoints")
	rlctl(t, "--etcd-endpoints", "http://x", "--admin-url", "http://y", "rules", "list").must(t, exitUsage, "not both")
	rlctl(t, "-o", "xml", "rules", "validate", "-f", "x").must(t, exitUsage, "table, json or yaml")
	rlctl(t, "rules", "get").must(t, exitUsage, "want ID")
	rlctl(t, "rules", "list", "--bogus").must(t, exitUsage, "bogus")

	f := newFixture(t)
	if _, err := f.store.Put(context.Background(), rules.Rule{ID: "e1", Algorithm: rules.TokenBucket, Capacity: 1, RefillPerSecond: 1}, 0); err != nil {
		t.Fatal(err)
	}
	t.Setenv("APPORTION_ETCD_ENDPOINTS", f.endpoints)
	t.Setenv("APPORTION_OUTPUT", "json")
	out := rlctl(t, "rules", "list").must(t, exitOK).stdout
	if !strings.HasPrefix(strings.TrimSpace(out), "[") {
		t.Fatalf("APPORTION_OUTPUT=json ignored:\n%s", out)
	}
	// The command line wins over the environment, before or after the command.
	rlctl(t, "-o", "table", "rules", "list").must(t, exitOK, "ALGORITHM")
	rlctl(t, "rules", "list", "-o", "table").must(t, exitOK, "ALGORITHM")
	// Command flags read the environment too.
	t.Setenv("APPORTION_IF_MATCH", "1")
	rlctl(t, "rules", "delete", "e1").must(t, exitConflict)

	// The admin API refuses a wrong token: exit 1 with a clear message.
	os.Unsetenv("APPORTION_ETCD_ENDPOINTS")
	rlctl(t, "--admin-url", f.adminURL, "--token", "wrong", "rules", "list").must(t, exitFailure, "unauthorized")
}

// fakeLimiter records the request and answers allowed with one status.
type fakeLimiter struct {
	ratelimitv1.UnimplementedRateLimiterServer
	mu  sync.Mutex
	got *ratelimitv1.CheckLimitRequest
}

func (f *fakeLimiter) CheckLimit(ctx context.Context, req *ratelimitv1.CheckLimitRequest) (*ratelimitv1.CheckLimitResponse, error) {
	f.mu.Lock()
	f.got = req
	f.mu.Unlock()
	return &ratelimitv1.CheckLimitResponse{
		Allowed: true, Limit: 20, Remaining: 17, RuleId: "orders-free",
		Statuses: []*ratelimitv1.RuleStatus{{RuleId: "orders-free", Allowed: true, Limit: 20, Remaining: 17}},
	}, nil
}

func TestCheck(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fake := &fakeLimiter{}
	srv := grpc.NewServer()
	ratelimitv1.RegisterRateLimiterServer(srv, fake)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	addr := lis.Addr().String()

	rlctl(t, "check", "--addr", addr, "--client-key", "user:42", "--resource", "POST /orders",
		"--cost", "3", "--attr", "tier=free", "--attr", "ip=10.0.0.1").
		must(t, exitOK, "ALLOWED rule=orders-free limit=20 remaining=17", "RULE")
	fake.mu.Lock()
	got := fake.got
	fake.mu.Unlock()
	if got.GetClientKey() != "user:42" || got.GetResource() != "POST /orders" || got.GetCost() != 3 ||
		got.GetAttributes()["tier"] != "free" || got.GetAttributes()["ip"] != "10.0.0.1" {
		t.Fatalf("server got %v", got)
	}
	out := rlctl(t, "-o", "json", "check", "--addr", addr, "--client-key", "k").must(t, exitOK).stdout
	var resp map[string]any
	if err := json.Unmarshal([]byte(out), &resp); err != nil || resp["allowed"] != true || resp["rule_id"] != "orders-free" {
		t.Fatalf("check -o json: %v\n%s", err, out)
	}
	rlctl(t, "check", "--addr", addr).must(t, exitUsage, "--client-key")
	rlctl(t, "check", "--addr", addr, "--client-key", "k", "--attr", "novalue").must(t, exitUsage, "k=v")
}
