package agentd

import (
	"context"
	"errors"
	"flag"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/sync/wire"
)

var readyLine = regexp.MustCompile(`ready region=(\S+) http=(\S+)\n`)

type runningCommand struct {
	http   string
	cancel context.CancelFunc
	done   chan error
}

func startCommand(t *testing.T, args ...string) *runningCommand {
	t.Helper()
	return startCommandLog(t, io.Discard, args...)
}

// startCommandLog is startCommand with the command's log (stderr) going to
// stderr.
func startCommandLog(t *testing.T, stderr io.Writer, args ...string) *runningCommand {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &testutil.SyncBuffer{}
	rc := &runningCommand{cancel: cancel, done: make(chan error, 1)}
	go func() { rc.done <- RunCommand(ctx, args, out, stderr) }()
	testutil.WaitFor(t, 20*time.Second, "the ready line", func() bool {
		select {
		case err := <-rc.done:
			t.Fatalf("RunCommand returned early: %v", err)
		default:
		}
		return readyLine.MatchString(out.String())
	})
	rc.http = readyLine.FindStringSubmatch(out.String())[2]
	t.Cleanup(func() { rc.stop(t) })
	return rc
}

func (rc *runningCommand) stop(t *testing.T) {
	rc.cancel()
	select {
	case err, ok := <-rc.done:
		if ok && err != nil {
			t.Errorf("RunCommand: %v", err)
		}
		if ok {
			close(rc.done)
		}
	case <-time.After(20 * time.Second):
		t.Errorf("RunCommand did not stop")
	}
}

func (rc *runningCommand) get(path string) (int, string) {
	resp, err := http.Get("http://" + rc.http + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestRunCommand(t *testing.T) {
	testutil.CheckGoroutines(t)
	if testing.Short() {
		t.Skip("integration test")
	}
	r := testutil.StartRedis(t)
	ns := testutil.StartNATS(t)
	e := testutil.StartEtcd(t)
	t.Setenv("APPORTION_REGION", "us-east") // every flag also reads the environment
	t.Setenv("APPORTION_REPORT_SEED_FILE", testSeedFile(t, "us-east"))
	rc := startCommand(t, "--redis-addr", r.Addr, "--nats-url", ns.ClientURL(), "--etcd-endpoints", e.Endpoint,
		"--http-addr", "127.0.0.1:0", "--interval", "50ms", "--http-read-timeout", "500ms")
	testutil.WaitFor(t, 20*time.Second, "/readyz 200", func() bool { c, _ := rc.get("/readyz"); return c == 200 })
	if c, _ := rc.get("/healthz"); c != 200 {
		t.Fatalf("/healthz %d", c)
	}
	_, body := rc.get("/metrics")
	for _, name := range []string{
		`apportion_sync_reports_total{direction="sent",region="us-east"}`,
		`apportion_sync_report_bytes_total{direction="received",region="us-east"}`,
		"apportion_sync_peers_seen", "apportion_sync_keys_coordinated", "apportion_sync_gifts_total",
		"apportion_sync_fenced", "apportion_sync_reclaims_total", "apportion_sync_tick_duration_seconds_bucket",
		`apportion_sync_leader{region="us-east"} 1`,
		// Every rejection reason is a series from the start.
		`apportion_sync_reports_rejected_total{reason="bad_signature",region="us-east"} 0`,
		`apportion_sync_reports_rejected_total{reason="unsigned",region="us-east"} 0`,
		`apportion_sync_reports_rejected_total{reason="replayed",region="us-east"} 0`,
		`apportion_sync_reports_rejected_total{reason="implausible",region="us-east"} 0`,
	} {
		if !strings.Contains(body, name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}

	// A client that sends its body slowly is cut off after the read timeout.
	c, err := net.Dial("tcp", rc.http)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	io.WriteString(c, "POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
	closed := make(chan struct{})
	go func() { io.Copy(io.Discard, c); close(closed) }()
	for trickling := true; trickling; {
		select {
		case <-closed:
			trickling = false
		case <-time.After(100 * time.Millisecond):
			c.Write([]byte("x"))
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Fatalf("the agent's HTTP server still holds a slow body after %v (--http-read-timeout 500ms)", d)
		}
	}
	t.Logf("a slow body was cut off after %v (--http-read-timeout 500ms)", time.Since(start))
}

func TestRunCommandFlags(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no region", []string{"--etcd-endpoints", "http://127.0.0.1:1"}, "--region is required"},
		{"no etcd", []string{"--region", "a"}, "--etcd-endpoints is required"},
		{"bad region", []string{"--region", "a.b", "--etcd-endpoints", "x"}, "--region"},
		{"bad log level", []string{"--region", "a", "--etcd-endpoints", "x", "--log-level", "loud"}, "--log-level"},
		{"bad lease", []string{"--region", "a", "--etcd-endpoints", "x", "--lease", "100ms"}, "--lease must exceed --interval"},
		{"bad record hold", []string{"--region", "a", "--etcd-endpoints", "x", "--record-hold", "-1s"}, "--record-hold"},
		{"bad max usage keys", []string{"--region", "a", "--etcd-endpoints", "x", "--max-usage-keys", "0"}, "--max-usage-keys"},
		{"bad demand band", []string{"--region", "a", "--etcd-endpoints", "x", "--demand-band", "1"}, "--demand-band 1"},
		{"bad gift band", []string{"--region", "a", "--etcd-endpoints", "x", "--gift-band", "-0.1"}, "--gift-band -0.1"},
		{"gift wait too long", []string{"--region", "a", "--etcd-endpoints", "x", "--gift-wait", "1m"}, "--gift-wait 1m0s must be in [0, 255 intervals] (25.5s)"},
		{"negative heartbeat", []string{"--region", "a", "--etcd-endpoints", "x", "--heartbeat", "-1s"}, "--heartbeat -1s"},
		{"witness lease below the lease", []string{"--region", "a", "--etcd-endpoints", "x", "--witness-lease", "1s"}, "--witness-lease 1s must be 0 or at least --lease 3s"},
		{"bad wire version", []string{"--region", "a", "--etcd-endpoints", "x", "--wire-version", "4"}, "--wire-version 4"},
		{"bad demand half-life", []string{"--region", "a", "--etcd-endpoints", "x", "--demand-half-life", "-1s"}, "--demand-half-life"},
		{"redis cert without key", []string{"--region", "a", "--etcd-endpoints", "x", "--redis-cert", "c.pem"}, "--redis-cert"},
		{"extra args", []string{"--region", "a", "--etcd-endpoints", "x", "more"}, "unexpected arguments"},
		{"zero HTTP timeout", []string{"--region", "a", "--etcd-endpoints", "x", "--http-idle-timeout", "0s"}, "must be positive"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := RunCommand(context.Background(), tc.args, io.Discard, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestRunCommandStandby(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	r := testutil.StartRedis(t)
	ns := testutil.StartNATS(t)
	e := testutil.StartEtcd(t)
	args := []string{"--region", "a", "--redis-addr", r.Addr, "--nats-url", ns.ClientURL(), "--etcd-endpoints", e.Endpoint,
		"--http-addr", "127.0.0.1:0", "--standby", "--report-seed-file", testSeedFile(t, "a")}
	p1 := startCommand(t, args...)
	p2 := startCommand(t, args...)
	leader := func(rc *runningCommand) bool {
		_, body := rc.get("/metrics")
		return strings.Contains(body, `apportion_sync_leader{region="a"} 1`)
	}
	testutil.WaitFor(t, 20*time.Second, "one leader", func() bool { return leader(p1) != leader(p2) })
	first, second := p1, p2
	if leader(p2) {
		first, second = p2, p1
	}
	if c, body := second.get("/readyz"); c != http.StatusOK || !strings.Contains(body, "standby") {
		t.Fatalf("standby /readyz %d %q, want 200 standby (ready to take over)", c, body)
	}
	first.stop(t)
	testutil.WaitFor(t, 20*time.Second, "the standby to take over", func() bool { return leader(second) })
}

// testSeedFile writes a new report signing seed for region to a file and
// returns its path.
func testSeedFile(t testing.TB, region string) string {
	t.Helper()
	seed, _, err := wire.GenerateSeed()
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), region+".nk")
	if err := os.WriteFile(p, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestFlagDefaultsShown: syncagent -h shows --record-hold's real default
// (1h, which 0 also means), where it showed none: the flag's default was
// the zero that the agent reads as 1h.
func TestFlagDefaultsShown(t *testing.T) {
	var help strings.Builder
	if err := RunCommand(context.Background(), []string{"-h"}, io.Discard, &help); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("-h: %v", err)
	}
	_, after, ok := strings.Cut(help.String(), "-record-hold duration")
	if !ok {
		t.Fatalf("no --record-hold in:\n%s", help.String())
	}
	line, _, _ := strings.Cut(strings.TrimPrefix(after, "\n"), "\n")
	if !strings.Contains(line, "(default 1h0m0s)") {
		t.Errorf("--record-hold's help %q shows no default of 1h", line)
	}
	o, err := parseFlags([]string{"--region", "a", "--etcd-endpoints", "x"}, io.Discard)
	if err != nil || o.recordHold != time.Hour {
		t.Errorf("--record-hold parses to %v (%v), want 1h", o.recordHold, err)
	}
}
