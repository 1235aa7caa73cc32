//go:build linux

package enforcerd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
)

// captureStderr redirects the process's file descriptor 2 (where go-redis's
// default logger writes, whatever writer Run is given) into a buffer until
// the returned func restores it and returns what was written.
func captureStderr(t *testing.T) (restore func() string) {
	t.Helper()
	saved, err := syscall.Dup(2)
	if err != nil {
		t.Fatal(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Dup3(int(w.Fd()), 2, 0); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	copied := make(chan struct{})
	go func() { io.Copy(&buf, r); close(copied) }()
	var once sync.Once
	var out string
	restore = func() string {
		once.Do(func() {
			syscall.Dup3(saved, 2, 0)
			syscall.Close(saved)
			w.Close()
			<-copied
			r.Close()
			out = buf.String()
		})
		return out
	}
	t.Cleanup(func() { restore() })
	return restore
}

// TestRedisDownNoRawRedisLines: while Redis refuses, go-redis's pool fails
// a dial for every look the breaker lets through; its messages are debug
// records of the daemon's log (here JSON), not raw "redis: ..." lines on
// the process's stderr (about 1,000 in 30 s before, breaking a JSON log
// stream).
func TestRedisDownNoRawRedisLines(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: runs ratelimitd")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := l.Addr().String()
	l.Close()
	rulesFile := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(rulesFile, []byte("- id: orders\n  match: {resource: POST /orders}\n  algorithm: token_bucket\n  capacity: 5\n  refill_per_second: 1\n  failure_mode: open\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	restore := captureStderr(t)
	run := startRun(t, "--region", "us-east", "--redis-addr", closed, "--rules", rulesFile,
		"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--timeout", "50ms", "--warmup-timeout", "200ms",
		"--log-level", "debug", "--log-format", "json")
	client := run.client(t)
	checks := 0
	for end := time.Now().Add(time.Second); time.Now().Before(end); checks++ {
		resp, err := client.CheckLimit(context.Background(), &ratelimitv1.CheckLimitRequest{ClientKey: "user:1", Resource: "POST /orders"})
		if err != nil {
			t.Fatal(err)
		}
		if !resp.FailOpen {
			t.Fatalf("check %d answered by Redis at %s, which is closed", checks, closed)
		}
	}
	if err := run.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	raw := restore()

	var rawLines []string
	for _, line := range strings.Split(raw, "\n") {
		if strings.HasPrefix(line, "redis: ") {
			rawLines = append(rawLines, line)
		}
	}
	if len(rawLines) > 0 {
		t.Errorf("%d raw go-redis lines on stderr during %d checks, e.g. %q", len(rawLines), checks, rawLines[0])
	}
	// The daemon's log stays JSON, with go-redis's messages in it at debug.
	dials := 0
	sc := bufio.NewScanner(strings.NewReader(run.stderr.String()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var rec map[string]any
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("not a JSON record in the log: %q", sc.Text())
		}
		if msg, _ := rec["msg"].(string); strings.Contains(msg, "failed to dial") && strings.Contains(msg, closed) {
			if rec["level"] != "DEBUG" || rec["component"] != "go-redis" {
				t.Fatalf("go-redis's message logged as %v", rec)
			}
			dials++
		}
	}
	if dials == 0 {
		t.Errorf("no debug record of go-redis's failed dials in the log:\n%.2000s", run.stderr.String())
	}
	t.Logf("%d checks, %d go-redis dial failures logged at debug", checks, dials)
}
