// Package testutil starts real servers for tests: redis-server processes on
// free ports, embedded NATS and embedded etcd. Every helper registers its
// cleanup with tb.Cleanup, so a test leaves nothing running.
package testutil

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Redis is a redis-server process started for one test.
type Redis struct {
	Addr string
	Port int
	Dir  string
	cmd  *exec.Cmd
	args []string
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(tb testing.TB) int {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("testutil: free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// RedisServerPath returns the redis-server binary or fails the test with a
// message that says how to install it. It never skips.
func RedisServerPath(tb testing.TB) string {
	tb.Helper()
	p, err := exec.LookPath("redis-server")
	if err != nil {
		tb.Fatalf("testutil: redis-server not found on PATH; install it (Debian/Ubuntu: apt-get install redis-server, macOS: brew install redis)")
	}
	return p
}

// StartRedis starts a redis-server on a free port, with no persistence, and
// stops it when the test ends.
func StartRedis(tb testing.TB, extraArgs ...string) *Redis {
	tb.Helper()
	RedisServerPath(tb)
	dir := tb.TempDir()
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		port := FreePort(tb)
		r := &Redis{Addr: fmt.Sprintf("127.0.0.1:%d", port), Port: port, Dir: dir}
		r.args = append([]string{"--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--daemonize", "no", "--loglevel", "warning"}, extraArgs...)
		if err := r.start(); err != nil {
			lastErr = err
			continue
		}
		tb.Cleanup(r.Stop)
		return r
	}
	tb.Fatalf("testutil: start redis-server: %v", lastErr)
	return nil
}

func (r *Redis) start() error {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, r.args...)
	cmd.Dir = r.Dir
	logf, err := os.Create(filepath.Join(r.Dir, fmt.Sprintf("redis-%d.log", r.Port)))
	if err != nil {
		return err
	}
	cmd.Stdout = logf
	cmd.Stderr = logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return err
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); logf.Close(); close(exited) }()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			b, _ := os.ReadFile(logf.Name())
			return fmt.Errorf("redis-server exited early: %s", strings.TrimSpace(string(b)))
		default:
		}
		if pingRedis(r.Addr) == nil {
			// The port was free a moment ago; make sure the server answering
			// is this process, not one that took the port in between.
			if pid, err := redisPID(r.Addr); err != nil || pid != cmd.Process.Pid {
				cmd.Process.Kill()
				<-exited
				return fmt.Errorf("port %d answered by another process (pid %d, %v)", r.Port, pid, err)
			}
			r.cmd = cmd
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	cmd.Process.Kill()
	<-exited
	return fmt.Errorf("redis-server on %s did not answer PING within 10s", r.Addr)
}

// Stop kills the server and waits for it to exit. Safe to call twice.
func (r *Redis) Stop() {
	if r.cmd == nil {
		return
	}
	r.cmd.Process.Kill()
	// Wait is done by the goroutine started in start; poll until the port is closed.
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && pingRedis(r.Addr) == nil {
		time.Sleep(5 * time.Millisecond)
	}
	r.cmd = nil
}

// Restart starts the server again on the same port (empty: no persistence).
func (r *Redis) Restart(tb testing.TB) {
	tb.Helper()
	r.Stop()
	var err error
	for i := 0; i < 50; i++ {
		if err = r.start(); err == nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	tb.Fatalf("testutil: restart redis-server: %v", err)
}

// pingRedis speaks just enough RESP to check that a server answers.
func pingRedis(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if !strings.HasPrefix(line, "+PONG") {
		return fmt.Errorf("unexpected reply %q", line)
	}
	return nil
}

// redisPID asks the server at addr for its process id (INFO server).
func redisPID(addr string) (int, error) {
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("INFO server\r\n")); err != nil {
		return 0, err
	}
	br := bufio.NewReader(c)
	var n int
	head, err := br.ReadString('\n')
	if err != nil {
		return 0, err
	}
	if _, err := fmt.Sscanf(head, "$%d", &n); err != nil || n < 0 {
		return 0, fmt.Errorf("unexpected INFO reply %q", head)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(br, body); err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_id:"); ok {
			var pid int
			_, err := fmt.Sscan(v, &pid)
			return pid, err
		}
	}
	return 0, fmt.Errorf("no process_id in INFO server")
}

// WaitFor polls cond every few milliseconds until it returns true or the
// timeout passes, then fails the test with msg.
func WaitFor(tb testing.TB, timeout time.Duration, msg string, cond func() bool) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		if cond() {
			return
		}
		select {
		case <-ctx.Done():
			tb.Fatalf("testutil: timed out after %v waiting for %s", timeout, msg)
		case <-t.C:
		}
	}
}
