package enforcerd

import (
	"bufio"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
)

// TestAdminAudit: the admin API leaves a trace of failed authentication,
// 1000 requests with a wrong token are counted in
// apportion_admin_requests_total{result="unauthorized"} and logged once
// (rate-limited) with the caller's address; the lines of a rule stored and
// deleted name the caller's address too.
func TestAdminAudit(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts etcd")
	}
	et := testutil.StartEtcd(t)
	o, err := parseFlags([]string{"--region", "us-east", "--etcd-endpoints", et.Endpoint,
		"--admin-addr", "127.0.0.1:0", "--admin-token", "s3cret"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testutil.SyncBuffer{}
	reg := prometheus.NewRegistry()
	rs, err := newSource(o, slog.New(slog.NewJSONHandler(logs, nil)), reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rs.close)
	srv := httptest.NewServer(rs.admin)
	t.Cleanup(srv.Close)

	const doc = `{"id":"orders","match":{"resource":"POST /orders"},"algorithm":"token_bucket","capacity":20,"refill_per_second":10}`
	do := func(method, path, token, body string) int {
		t.Helper()
		req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	lines := func(msg string) []map[string]any {
		var out []map[string]any
		sc := bufio.NewScanner(strings.NewReader(logs.String()))
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil && m["msg"] == msg {
				out = append(out, m)
			}
		}
		return out
	}
	count := func(result string) float64 {
		v, _ := testutil.Metric(t, reg, metricAdminRequests, map[string]string{"result": result})
		return v
	}

	for i := range 1000 {
		method, token := http.MethodPut, "guessed-9f2c"
		if i%2 == 1 {
			method, token = http.MethodGet, ""
		}
		if code := do(method, "/rules/orders", token, doc); code != http.StatusUnauthorized {
			t.Fatalf("%s with token %q: %d, want 401", method, token, code)
		}
	}
	if got := count("unauthorized"); got != 1000 {
		t.Errorf("apportion_admin_requests_total{result=\"unauthorized\"} = %v after 1000 refused requests, want 1000", got)
	}
	warns := lines("admin: request refused: missing or wrong bearer token")
	if len(warns) != 1 {
		t.Fatalf("%d warnings of refused requests, want 1 (rate-limited):\n%s", len(warns), logs)
	}
	if a, _ := warns[0]["remote_addr"].(string); warns[0]["level"] != "WARN" || !strings.HasPrefix(a, "127.0.0.1:") {
		t.Errorf("warning %v: want level WARN and the caller's remote_addr", warns[0])
	}
	if strings.Contains(logs.String(), "guessed-9f2c") {
		t.Errorf("the log shows the token sent: %s", logs)
	}

	if code := do(http.MethodPut, "/rules/orders", "s3cret", doc); code != http.StatusOK {
		t.Fatalf("PUT with the token: %d", code)
	}
	if code := do(http.MethodDelete, "/rules/orders", "s3cret", ""); code != http.StatusNoContent {
		t.Fatalf("DELETE with the token: %d", code)
	}
	for _, msg := range []string{"admin: rule stored", "admin: rule deleted"} {
		l := lines(msg)
		if len(l) != 1 {
			t.Fatalf("%d lines %q, want 1:\n%s", len(l), msg, logs)
		}
		if a, _ := l[0]["remote_addr"].(string); !strings.HasPrefix(a, "127.0.0.1:") {
			t.Errorf("line %v: want the caller's remote_addr", l[0])
		}
	}
	if got := count("ok"); got != 2 {
		t.Errorf("apportion_admin_requests_total{result=\"ok\"} = %v, want 2", got)
	}
	if code := do(http.MethodDelete, "/rules/orders", "s3cret", ""); code != http.StatusNotFound {
		t.Fatalf("DELETE of a deleted rule: %d, want 404", code)
	}
	if got := count("invalid"); got != 1 {
		t.Errorf("apportion_admin_requests_total{result=\"invalid\"} = %v, want 1", got)
	}
}
