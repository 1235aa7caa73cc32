package main

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// TestMain lets the test run this binary as a real rlstack process.
func TestMain(m *testing.M) {
	if os.Getenv("RLSTACK_TEST_CHILD") == "1" {
		main()
		return
	}
	os.Exit(m.Run())
}

var regionRE = regexp.MustCompile(`^(us-east|eu-west|ap-south)\s+(\S+)\s+(\S+)\s+(\S+)`)

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
	cmd := exec.Command(os.Args[0], "--view=false")
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
	var tmpDir string
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
	go func() {
		for range lines {
		}
	}()
	if len(grpcAddrs) != 3 {
		t.Fatalf("want 3 regions in the summary, got %v", grpcAddrs)
	}
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
