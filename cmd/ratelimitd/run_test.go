package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// TestMain lets a test run this binary as a real ratelimitd child process.
func TestMain(m *testing.M) {
	if os.Getenv("RATELIMITD_TEST_CHILD") == "1" {
		main()
		return
	}
	os.Exit(m.Run())
}

var readyRE = regexp.MustCompile(`ready grpc=(\S+) http=(\S+).*`)

type server struct {
	grpc, http string
	readyLine  string
	stderr     *testutil.SyncBuffer
	stop       func() error
}

// startInProcess runs run() and waits for its ready line.
func startInProcess(t *testing.T, args ...string) *server {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stdout, stderr := &testutil.SyncBuffer{}, &testutil.SyncBuffer{}
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, stdout, stderr) }()
	var m []string
	testutil.WaitFor(t, 10*time.Second, "the ready line", func() bool {
		select {
		case err := <-done:
			t.Fatalf("run returned before ready: %v\nstderr:\n%s", err, stderr)
		default:
		}
		m = readyRE.FindStringSubmatch(stdout.String())
		return m != nil
	})
	var once sync.Once
	var stopErr error
	s := &server{grpc: m[1], http: m[2], stderr: stderr, readyLine: m[0]}
	s.stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case stopErr = <-done:
			case <-time.After(15 * time.Second):
				stopErr = fmt.Errorf("run did not return within 15s of cancel")
			}
		})
		return stopErr
	}
	t.Cleanup(func() { s.stop() })
	return s
}

// startChild runs ratelimitd as a separate process.
func startChild(t *testing.T, args ...string) *server {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "RATELIMITD_TEST_CHILD=1")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := &testutil.SyncBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if readyRE.MatchString(sc.Text()) {
				lines <- sc.Text()
			}
		}
	}()
	var line string
	select {
	case line = <-lines:
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("child did not print its ready line; stderr:\n%s", stderr)
	}
	m := readyRE.FindStringSubmatch(line)
	s := &server{grpc: m[1], http: m[2], stderr: stderr}
	var once sync.Once
	s.stop = func() error {
		var err error
		once.Do(func() {
			cmd.Process.Signal(syscall.SIGTERM)
			err = cmd.Wait()
		})
		return err
	}
	t.Cleanup(func() { s.stop() })
	return s
}

func writeRules(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func dial(t *testing.T, addr string) ratelimitv1.RateLimiterClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return ratelimitv1.NewRateLimiterClient(conn)
}

func integration(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server and enforcers")
	}
}

// 200 concurrent callers on one key with capacity 100, across two enforcer
// processes sharing one Redis, get at most 100 + refill x elapsed.
func TestTwoProcessesShareOneRedis(t *testing.T) {
	integration(t)
	r := testutil.StartRedis(t)
	rulesPath := filepath.Join(t.TempDir(), "rules.yaml")
	writeRules(t, rulesPath, `
- id: hot
  algorithm: token_bucket
  capacity: 100
  refill_per_second: 1
`)
	args := []string{"--region", "us-east", "--redis-addr", r.Addr, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--rules", rulesPath, "--timeout", "2s"}
	a, b := startChild(t, args...), startChild(t, args...)
	clients := []ratelimitv1.RateLimiterClient{dial(t, a.grpc), dial(t, b.grpc)}
	var mu sync.Mutex
	allowed, failOpen := 0, 0
	start := time.Now()
	var wg sync.WaitGroup
	for g := 0; g < 200; g++ {
		wg.Add(1)
		go func(c ratelimitv1.RateLimiterClient) {
			defer wg.Done()
			for i := 0; i < 3; i++ {
				resp, err := c.CheckLimit(context.Background(), &ratelimitv1.CheckLimitRequest{ClientKey: "user:hot", Resource: "GET /"})
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if resp.Allowed {
					allowed++
				}
				if resp.FailOpen {
					failOpen++
				}
				mu.Unlock()
			}
		}(clients[g%2])
	}
	wg.Wait()
	elapsed := time.Since(start)
	bound := 100 + int(elapsed.Seconds()*1) + 1
	t.Logf("allowed %d of 600 in %v (bound %d)", allowed, elapsed, bound)
	if failOpen > 0 {
		t.Fatalf("%d answers came from the failure policy", failOpen)
	}
	if allowed > bound || allowed < 100 {
		t.Fatalf("allowed %d, want between 100 and %d", allowed, bound)
	}
	for _, s := range []*server{a, b} {
		if err := s.stop(); err != nil {
			t.Fatalf("child exit: %v\nstderr:\n%s", err, s.stderr)
		}
	}
}

type checkReply struct {
	Allowed      bool   `json:"allowed"`
	Limit        int64  `json:"limit"`
	Remaining    int64  `json:"remaining"`
	RetryAfterMs int64  `json:"retry_after_ms"`
	ResetAfterMs int64  `json:"reset_after_ms"`
	RuleID       string `json:"rule_id"`
	FailOpen     bool   `json:"fail_open"`
	Error        string `json:"error"`
	Field        string `json:"field"`
	Statuses     []struct {
		RuleID string `json:"rule_id"`
	} `json:"statuses"`
}

func post(t *testing.T, addr, body string) (*http.Response, checkReply) {
	t.Helper()
	resp, err := http.Post("http://"+addr+"/v1/check", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r checkReply
	b, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("reply %q: %v", b, err)
	}
	return resp, r
}

func TestHTTPAndRuleReload(t *testing.T) {
	testutil.CheckGoroutines(t)
	integration(t)
	r := testutil.StartRedis(t)
	rulesPath := filepath.Join(t.TempDir(), "rules.json")
	writeRules(t, rulesPath, `[{"id":"orders","match":{"resource":"POST /orders"},"algorithm":"token_bucket","capacity":2,"refill_per_second":0.5}]`)
	s := startInProcess(t, "--region", "eu-west", "--redis-addr", r.Addr, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--rules", rulesPath, "--rules-poll", "20ms", "--timeout", "1s")

	t.Run("allowed then 429 with headers", func(t *testing.T) {
		body := `{"client_key":"user:42","resource":"POST /orders","cost":1}`
		resp, rep := post(t, s.http, body)
		if resp.StatusCode != 200 || !rep.Allowed || rep.Limit != 2 || rep.Remaining != 1 || rep.RuleID != "orders" {
			t.Fatalf("first: %d %+v", resp.StatusCode, rep)
		}
		for _, h := range []string{"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "RateLimit-Policy", "RateLimit"} {
			if resp.Header.Get(h) == "" {
				t.Errorf("missing header %s", h)
			}
		}
		if got := resp.Header.Get("RateLimit-Policy"); got != `"orders";q=2;w=4` {
			t.Errorf("RateLimit-Policy = %q", got)
		}
		post(t, s.http, body)
		resp, rep = post(t, s.http, body)
		if resp.StatusCode != http.StatusTooManyRequests || rep.Allowed {
			t.Fatalf("third: %d %+v", resp.StatusCode, rep)
		}
		if ra := resp.Header.Get("Retry-After"); ra != "2" {
			t.Errorf("Retry-After = %q, want 2 (whole seconds, rounded up, of %d ms)", ra, rep.RetryAfterMs)
		}
	})

	t.Run("bad input is 400 naming the field", func(t *testing.T) {
		cases := map[string]string{
			`{"client_key":"","resource":"x"}`:                  "client_key",
			`{"client_key":"a","cost":-1}`:                      "cost",
			`{"client_key":"a","cost":1000000}`:                 "cost",
			`{"client_key":"a","bogus":1}`:                      "bogus",
			`{"client_key":5}`:                                  "client_key",
			`{"client_key":"` + strings.Repeat("x", 300) + `"}`: "client_key",
			"{\"client_key\":\"a\xff\"}":                        "client_key",
			`{"client_key":"a\ud800"}`:                          "client_key",
			`{"client_key":`:                                    "",
		}
		for body, field := range cases {
			resp, rep := post(t, s.http, body)
			if resp.StatusCode != 400 || rep.Field != field || rep.Error == "" {
				t.Errorf("%.40q: status %d field %q error %q, want 400 naming %q", body, resp.StatusCode, rep.Field, rep.Error, field)
			}
		}
	})

	t.Run("a changed rule file applies without a restart", func(t *testing.T) {
		writeRules(t, rulesPath, `[{"id":"orders","match":{"resource":"POST /orders"},"algorithm":"token_bucket","capacity":7,"refill_per_second":0.5}]`)
		testutil.WaitFor(t, 5*time.Second, "the new capacity", func() bool {
			_, rep := post(t, s.http, `{"client_key":"other","resource":"POST /orders"}`)
			return rep.Limit == 7
		})
	})

	t.Run("a bad rule file is refused and the old rules stay", func(t *testing.T) {
		writeRules(t, rulesPath, `[{"id":"orders","algorithm":"token_bukket","capacity":1,"refill_per_second":1}]`)
		testutil.WaitFor(t, 5*time.Second, "the reload error in the log", func() bool {
			return strings.Contains(s.stderr.String(), "algorithm")
		})
		_, rep := post(t, s.http, `{"client_key":"third","resource":"POST /orders"}`)
		if rep.Limit != 7 || rep.RuleID != "orders" {
			t.Fatalf("after a bad file: %+v, want the old rule (limit 7)", rep)
		}
	})

	t.Run("metrics health ready", func(t *testing.T) {
		for path, want := range map[string]string{"/metrics": "apportion_checks_total", "/healthz": "ok", "/readyz": "ready"} {
			resp, err := http.Get("http://" + s.http + path)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || !strings.Contains(string(b), want) {
				t.Errorf("%s: %d %.200s", path, resp.StatusCode, b)
			}
		}
	})

	if err := s.stop(); err != nil {
		t.Fatalf("graceful stop: %v", err)
	}
}

func TestFlagErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"no region", []string{"--rules", "x"}, "--region"},
		{"no rules", []string{"--region", "r"}, "--rules"},
		{"both sources", []string{"--region", "r", "--rules", "x", "--etcd-endpoints", "y"}, "exclusive"},
		{"missing rules file", []string{"--region", "r", "--rules", "/nonexistent/rules.json", "--redis-addr", "127.0.0.1:1"}, "rules"},
		{"redis cert without key", []string{"--region", "r", "--rules", "x", "--redis-cert", "c.pem"}, "--redis-cert"},
		{"redis CA missing", []string{"--region", "r", "--rules", "x", "--redis-ca", "/nonexistent/ca.pem"}, "--redis-ca"},
		{"tls cert without key", []string{"--region", "r", "--rules", "x", "--tls-cert", "c.pem"}, "--tls-cert and --tls-key"},
		{"client CA without TLS", []string{"--region", "r", "--rules", "x", "--tls-client-ca", "ca.pem"}, "--tls-client-ca needs --tls-cert"},
		{"unreadable TLS files", []string{"--region", "r", "--rules", "x", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"}, "tls:"},
		{"zero read timeout", []string{"--region", "r", "--rules", "x", "--http-read-timeout", "0s"}, "must be positive"},
		{"zero admin store timeout", []string{"--region", "r", "--etcd-endpoints", "x", "--admin-store-timeout", "0s"}, "--admin-store-timeout"},
		{"no Redis pipeline", []string{"--region", "r", "--rules", "x", "--redis-pipelines", "0"}, "--redis-pipelines"},
		{"negative stream workers", []string{"--region", "r", "--rules", "x", "--grpc-stream-workers", "-1"}, "--grpc-stream-workers"},
		{"negative GC percent", []string{"--region", "r", "--rules", "x", "--gc-percent", "-5"}, "--gc-percent"},
		{"redis addr without port", []string{"--region", "r", "--rules", "x", "--redis-addr", "bogus"}, `--redis-addr: want HOST:PORT or unix:///PATH, got "bogus": missing port in address`},
		{"redis addr with a blank entry", []string{"--region", "r", "--rules", "x", "--redis-addr", "a:1,,b:2"}, `--redis-addr: want HOST:PORT or unix:///PATH, got a blank entry in "a:1,,b:2"`},
		{"unwritable CPU profile", []string{"--region", "r", "--rules", "x", "--cpu-profile", "/nonexistent/dir/cpu.out"}, "cpu profile"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := run(context.Background(), tt.args, io.Discard, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want an error naming %q", err, tt.want)
			}
		})
	}
}

// Graceful shutdown finishes in-flight checks: Redis is made slow (DEBUG
// SLEEP 0.7 s, under the enforcer's 1 s Redis read timeout), checks are in
// flight when the enforcer is told to stop, and every one of them still gets
// a store answer before run returns.
func TestGracefulShutdownFinishesInFlightChecks(t *testing.T) {
	integration(t)
	r := testutil.StartRedis(t, "--enable-debug-command", "yes")
	rulesPath := filepath.Join(t.TempDir(), "rules.json")
	writeRules(t, rulesPath, `[{"id":"r","algorithm":"token_bucket","capacity":1000,"refill_per_second":1000}]`)
	s := startInProcess(t, "--region", "us-east", "--redis-addr", r.Addr, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--rules", rulesPath, "--timeout", "5s")
	c := dial(t, s.grpc)
	if _, err := c.CheckLimit(context.Background(), &ratelimitv1.CheckLimitRequest{ClientKey: "warm"}); err != nil {
		t.Fatal(err)
	}
	admin := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer admin.Close()
	sleeping := make(chan error, 1)
	go func() { sleeping <- admin.Do(context.Background(), "DEBUG", "SLEEP", "0.7").Err() }()
	// Wait until Redis is inside DEBUG SLEEP: a PING on another connection blocks.
	probe := redis.NewClient(&redis.Options{Addr: r.Addr, ReadTimeout: 50 * time.Millisecond, MaxRetries: -1})
	defer probe.Close()
	testutil.WaitFor(t, 5*time.Second, "Redis to be busy", func() bool { return probe.Ping(context.Background()).Err() != nil })

	const n = 20
	type answer struct {
		resp *ratelimitv1.CheckLimitResponse
		err  error
	}
	answers := make(chan answer, n)
	for i := 0; i < n; i++ {
		go func(i int) {
			resp, err := c.CheckLimit(context.Background(), &ratelimitv1.CheckLimitRequest{ClientKey: fmt.Sprintf("k%d", i)})
			answers <- answer{resp, err}
		}(i)
	}
	// They cannot finish before Redis wakes up: wait until the enforcer has
	// all of them in flight, then stop it.
	inFlight := regexp.MustCompile(`(?m)^apportion_checks_in_flight\{region="us-east"\} (\d+)`)
	testutil.WaitFor(t, 5*time.Second, "the checks to be in flight", func() bool {
		resp, err := http.Get("http://" + s.http + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		m := inFlight.FindSubmatch(b)
		return m != nil && string(m[1]) == fmt.Sprint(n)
	})
	stopped := make(chan error, 1)
	go func() { stopped <- s.stop() }()
	for i := 0; i < n; i++ {
		a := <-answers
		if a.err != nil {
			t.Fatalf("an in-flight check failed during shutdown: %v", a.err)
		}
		if !a.resp.Allowed || a.resp.FailOpen {
			t.Fatalf("an in-flight check was not answered by the store: %+v", a.resp)
		}
	}
	if err := <-stopped; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if err := <-sleeping; err != nil {
		t.Fatalf("DEBUG SLEEP: %v", err)
	}
}
