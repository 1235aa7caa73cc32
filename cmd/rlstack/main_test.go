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
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/cmd/internal/stack"
	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/rules/admin"
	"github.com/creack/pty"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// faultsRE is the summary's fault control line; its group the URL.
var faultsRE = regexp.MustCompile(`^faults \(.*GET (http://127\.0\.0\.1:\d+/faults) shows them\):$`)

// checkFaults: the fault control the summary names answers with the three
// regions, none cut, every agent running (the stack's own test,
// TestFaultControl, drives each fault).
func checkFaults(t *testing.T, url string) {
	t.Helper()
	if url == "" {
		t.Fatal("the summary has no fault control line")
	}
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st stack.FaultState
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s %v", url, resp.Status, err)
	}
	if len(st.Regions) != 3 || st.Regions[0].Cut || !st.Regions[0].Agent {
		t.Fatalf("GET %s: %+v, want three regions, none cut, agents running", url, st)
	}
}

// TestMain lets the test run this binary as a real rlstack process.
func TestMain(m *testing.M) {
	if os.Getenv("RLSTACK_TEST_CHILD") == "1" {
		main()
		return
	}
	os.Exit(m.Run())
}

// regionRE is a row of the address table: region grpc http redis nats agent.
var regionRE = regexp.MustCompile(`^(us-east|eu-west|ap-south)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+:\d+)\s*$`)

// children lists the pids whose parent is pid.
func children(pid int) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(f) > 1 {
			if ppid, _ := strconv.Atoi(f[1]); ppid == pid {
				out = append(out, child)
			}
		}
	}
	return out
}

func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(f) > 0 && f[0] != "Z"
}

// The run command brings the stack up; every region answers a CheckLimit;
// SIGINT (Ctrl-C) stops it and leaves no process and no temp dir behind.
func TestStackStartsAnswersAndStopsClean(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "RLSTACK_TEST_CHILD=1")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	grpcAddrs := map[string]string{}
	agentAddrs := map[string]string{}
	var tmpDir, limitsShow, faults string
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	timeout := time.After(90 * time.Second)
wait:
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("rlstack exited before it was ready: %s", stderr.String())
			}
			if m := regionRE.FindStringSubmatch(l); m != nil {
				grpcAddrs[m[1]] = m[2]
				agentAddrs[m[1]] = m[6]
			}
			if strings.Contains(l, " limits show ") {
				limitsShow = l
			}
			if m := faultsRE.FindStringSubmatch(l); m != nil {
				faults = m[1]
			}
			if strings.Contains(l, "\x1b") {
				t.Errorf("terminal control sequence in piped output: %q", l)
			}
			if strings.HasPrefix(l, "temp dir: ") {
				tmpDir = strings.TrimPrefix(l, "temp dir: ")
			}
			if strings.Contains(l, "Ctrl-C stops everything") {
				break wait
			}
		case <-timeout:
			t.Fatalf("rlstack not ready within 90s: %s", stderr.String())
		}
	}
	// Not a terminal: the live view comes as plain lines, no redraw.
	viewed := time.After(30 * time.Second)
view:
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("rlstack exited: %s", stderr.String())
			}
			if strings.Contains(l, "\x1b") {
				t.Fatalf("terminal control sequence in piped output: %q", l)
			}
			if strings.Contains(l, "checks/s") {
				break view
			}
		case <-viewed:
			t.Fatal("no live view line within 30s")
		}
	}
	go func() {
		for range lines {
		}
	}()
	if len(grpcAddrs) != 3 {
		t.Fatalf("want 3 regions in the summary, got %v", grpcAddrs)
	}
	checkLimitsShowLine(t, limitsShow, agentAddrs)
	checkFaults(t, faults)
	for region, addr := range grpcAddrs {
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := ratelimitv1.NewRateLimiterClient(cc).CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{
			ClientKey: "user:42", Resource: "POST /orders", Attributes: map[string]string{"tier": "free"}})
		cancel()
		cc.Close()
		if err != nil || !resp.Allowed || resp.RuleId != "orders-free" {
			t.Fatalf("%s (%s): %v %v", region, addr, resp, err)
		}
	}
	kids := children(cmd.Process.Pid)
	if len(kids) < 3 {
		t.Fatalf("want at least 3 child processes (one redis-server per region), got %v", kids)
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("rlstack exit after SIGINT: %v\n%s", err, stderr.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatal("rlstack did not stop within 60s of SIGINT")
	}
	for _, k := range kids {
		if alive(k) {
			t.Errorf("child process %d is still running after rlstack exited", k)
		}
	}
	if tmpDir == "" {
		t.Fatal("rlstack did not print its temp dir")
	}
	if _, err := os.Stat(tmpDir); !os.IsNotExist(err) {
		t.Errorf("temp dir %s is still there (%v)", tmpDir, err)
	}
}

// checkLimitsShowLine checks the ready `rlctl limits show` line of the
// summary: it names every region's sync agent, each address answers as that
// region's agent, and the admin URL and token it gives list the rule.
func checkLimitsShowLine(t *testing.T, line string, agents map[string]string) {
	t.Helper()
	m := regexp.MustCompile(`rlctl --admin-url (\S+) --token (\S+) limits show (\S+) --agents (\S+)`).FindStringSubmatch(line)
	if m == nil {
		t.Fatalf("no ready rlctl limits show line: %q", line)
	}
	adminURL, token, rule, list := m[1], m[2], m[3], m[4]
	if rule != stack.GlobalRule {
		t.Errorf("limits show %s, want %s", rule, stack.GlobalRule)
	}
	var want []string
	for _, name := range stack.DefaultRegions[:len(agents)] {
		want = append(want, name+"=http://"+agents[name])
	}
	if list != strings.Join(want, ",") {
		t.Errorf("--agents %s, want the address table's %s", list, strings.Join(want, ","))
	}
	for region, addr := range agents {
		resp, err := http.Get(fmt.Sprintf("http://%s/v1/shares?rule=%s&limit=1", addr, rule))
		if err != nil {
			t.Fatalf("agent of %s at %s: %v", region, addr, err)
		}
		var body struct{ Region string }
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil || body.Region != region {
			t.Errorf("agent at %s: HTTP %s, region %q (%v), want the agent of %s", addr, resp.Status, body.Region, err, region)
		}
	}
	ac, err := admin.NewClient(adminURL, token, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, _, err := ac.Get(ctx, rule); err != nil {
		t.Errorf("admin API of the line: %v", err)
	}
}

// ansiRE matches the terminal control sequences Screen writes.
var ansiRE = regexp.MustCompile(`\x1b\[[0-9;?]*[A-Za-z]`)

// On a terminal (a pseudo-terminal here) rlstack draws one screen and
// redraws it in place: every frame starts at the top left with the
// addresses, the agents' and a ready limits show line included, and the
// live figures below; Ctrl-C restores the cursor and stops cleanly.
func TestStackRedrawsOnTerminal(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	cmd := exec.Command(os.Args[0], "--regions", "2")
	cmd.Env = append(os.Environ(), "RLSTACK_TEST_CHILD=1", "TERM=xterm")
	ptmx, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 40, Cols: 240})
	if err != nil {
		t.Fatal(err)
	}
	defer ptmx.Close()
	defer cmd.Process.Kill()
	var out testutil.SyncBuffer
	copied := make(chan struct{})
	go func() {
		io.Copy(&out, ptmx) // until the child closes the terminal (EIO)
		close(copied)
	}()
	// The first draw, then two redraws with figures: 4 homes with the clear.
	testutil.WaitFor(t, 90*time.Second, "rlstack to redraw its screen twice", func() bool {
		return strings.Count(out.String(), "\x1b[H") >= 4
	})
	raw := out.String()
	frames := strings.Split(raw, "\x1b[H")
	if !strings.HasPrefix(frames[0], "starting the local stack") || strings.Contains(frames[0], "apportion local stack:") {
		t.Errorf("before the first screen: %q", frames[0])
	}
	var last string
	complete := 0
	for _, f := range frames[1:] {
		if strings.HasSuffix(f, "\x1b[J") {
			complete++
			last = f
		}
	}
	if complete < 2 {
		t.Fatalf("%d complete frames in:\n%q", complete, raw)
	}
	// Pinned: each frame draws the address table again, none scrolls.
	if n := strings.Count(raw, "apportion local stack:"); n != complete && n != complete+1 {
		t.Errorf("address header %d times for %d frames", n, complete)
	}
	screen := strings.ReplaceAll(ansiRE.ReplaceAllString(last, ""), "\r", "")
	t.Logf("last screen:\n%s", screen)
	agents := map[string]string{}
	var limitsShow string
	for _, l := range strings.Split(screen, "\n") {
		if m := regionRE.FindStringSubmatch(l); m != nil {
			agents[m[1]] = m[6]
		}
		if strings.Contains(l, " limits show ") {
			limitsShow = l
		}
	}
	if len(agents) != 2 {
		t.Fatalf("want 2 regions with agents in the address table, got %v", agents)
	}
	for _, want := range []string{"sync agent", "checks/s", "share of " + stack.GlobalRule, stack.StopHint} {
		if !strings.Contains(screen, want) {
			t.Errorf("screen lacks %q", want)
		}
	}
	checkLimitsShowLine(t, limitsShow, agents)

	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("rlstack exit after SIGINT: %v\n%q", err, out.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatal("rlstack did not stop within 60s of SIGINT")
	}
	ptmx.Close()
	<-copied
	tail := out.String()[len(raw):]
	if !strings.Contains(tail, "\x1b[?25h") || !strings.Contains(tail, "stopping ...") {
		t.Errorf("after Ctrl-C: cursor not restored or no stopping line: %q", tail)
	}
}
