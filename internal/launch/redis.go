package launch

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrNoRedisServer means redis-server is not on PATH.
var ErrNoRedisServer = errors.New("launch: redis-server not found on PATH; install it (Debian/Ubuntu: apt-get install redis-server, macOS: brew install redis)")

// Redis is a redis-server child process on a loopback port. It keeps nothing
// on disk (no RDB, no AOF) unless its extra arguments say otherwise, and is
// killed if the process that started it dies.
type Redis struct {
	Addr string // "127.0.0.1:PORT"
	Port int
	Dir  string // working directory; the log is redis-PORT.log in it

	args   []string
	cmd    *exec.Cmd
	exited chan struct{}
}

// RedisServerPath returns the redis-server binary, or ErrNoRedisServer.
func RedisServerPath() (string, error) {
	p, err := exec.LookPath("redis-server")
	if err != nil {
		return "", ErrNoRedisServer
	}
	return p, nil
}

// StartRedis starts redis-server on a free port with its working directory
// in dir (created if missing), with no persistence, and waits until that
// very process answers there. extraArgs are appended to the command line
// (e.g. "--cluster-enabled", "yes").
func StartRedis(dir string, extraArgs ...string) (*Redis, error) {
	return startRedisIn(dir, func() ([]string, error) { return extraArgs, nil })
}

// startRedisIn is StartRedis with the extra arguments made afresh for each
// attempt (a cluster node's bus port is picked free each time too).
func startRedisIn(dir string, extraArgs func() ([]string, error)) (*Redis, error) {
	if _, err := RedisServerPath(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("launch: redis dir: %w", err)
	}
	return retry(5, func() (*Redis, error) {
		port, err := FreePort()
		if err != nil {
			return nil, err
		}
		extra, err := extraArgs()
		if err != nil {
			return nil, err
		}
		r := &Redis{Addr: fmt.Sprintf("127.0.0.1:%d", port), Port: port, Dir: dir}
		r.args = append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--daemonize", "no", "--loglevel", "warning",
			"--logfile", filepath.Join(dir, fmt.Sprintf("redis-%d.log", port))}, extra...)
		if err := r.start(); err != nil {
			return nil, err
		}
		return r, nil
	})
}

func (r *Redis) start() error {
	bin, err := RedisServerPath()
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, r.args...)
	cmd.Dir = r.Dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // never outlive the starter
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("launch: start redis-server: %w", err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return fmt.Errorf("launch: redis-server on port %d exited early: %s", r.Port, r.logTail())
		default:
		}
		pid, err := RedisPID(r.Addr)
		if err == nil {
			if pid != cmd.Process.Pid {
				// The port was free a moment ago; another server took it.
				cmd.Process.Kill()
				<-exited
				return fmt.Errorf("launch: port %d answered by another redis-server (pid %d)", r.Port, pid)
			}
			r.cmd, r.exited = cmd, exited
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	cmd.Process.Kill()
	<-exited
	return fmt.Errorf("launch: redis-server on %s did not answer within 10s: %s", r.Addr, r.logTail())
}

func (r *Redis) logTail() string {
	b, _ := os.ReadFile(filepath.Join(r.Dir, fmt.Sprintf("redis-%d.log", r.Port)))
	s := strings.TrimSpace(string(b))
	if len(s) > 500 {
		s = s[len(s)-500:]
	}
	return s
}

// PID is the server's process id, or 0 while it is stopped.
func (r *Redis) PID() int {
	if r.cmd == nil {
		return 0
	}
	return r.cmd.Process.Pid
}

// Stop kills the server and waits for it to exit. Safe to call twice.
func (r *Redis) Stop() {
	if r.cmd == nil {
		return
	}
	r.cmd.Process.Kill()
	<-r.exited
	r.cmd = nil
}

// Restart starts the server again on the same port and arguments (empty,
// without persistence). The old listener may hold the port for a moment, so
// it retries for about a second.
func (r *Redis) Restart() error {
	r.Stop()
	if err := again(50, 20*time.Millisecond, r.start); err != nil {
		return fmt.Errorf("launch: restart redis-server: %w", err)
	}
	return nil
}

// RedisPID asks the server at addr for its process id (INFO server).
func RedisPID(addr string) (int, error) {
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 200 * time.Millisecond, ReadTimeout: time.Second,
		MaxRetries: -1, PoolSize: 1, DisableIdentity: true})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_id:"); ok {
			return strconv.Atoi(v)
		}
	}
	return 0, errors.New("launch: no process_id in INFO server")
}
