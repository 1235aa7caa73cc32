package backend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/redis/go-redis/v9"
)

func TestEtcdValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		e    Etcd
		want string // "" for valid
	}{
		{"plain", Etcd{Endpoints: "http://a:2379"}, ""},
		{"user and password", Etcd{Endpoints: "http://a:2379", Username: "u", Password: "p"}, ""},
		{"password without user", Etcd{Endpoints: "http://a:2379", Password: "p"}, "--etcd-username"},
		{"cert without key", Etcd{Endpoints: "https://a:2379", Cert: "c.pem"}, "--etcd-cert and --etcd-key"},
		{"CA with http", Etcd{Endpoints: "https://a:2379, http://b:2379", CA: "ca.pem"}, "https:// endpoints, got http://b:2379"},
		{"CA with a bare address", Etcd{Endpoints: "a:2379", CA: "ca.pem"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.e.Validate()
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("Validate() = %v, want %q", err, tc.want)
			}
			if _, cerr := tc.e.Config(time.Second); tc.want != "" && cerr == nil {
				t.Fatal("Config accepted what Validate refuses")
			}
		})
	}
	e := Etcd{Endpoints: " http://a:2379 ,, http://b:2379"}
	if got := e.EndpointList(); len(got) != 2 || got[0] != "http://a:2379" || got[1] != "http://b:2379" {
		t.Fatalf("EndpointList() = %q", got)
	}
}

func TestRedisSentinelOptions(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    Redis
		want string // "" for valid
	}{
		{"plain", Redis{Addr: "a:6379"}, ""},
		{"sentinel", Redis{Addr: "a:6379", SentinelAddrs: "s1:26379, s2:26379", MasterName: "m"}, ""},
		{"master name alone", Redis{Addr: "a:6379", MasterName: "m"}, "--redis-master-name needs --redis-sentinel-addrs"},
		{"sentinels alone", Redis{Addr: "a:6379", SentinelAddrs: "s1:26379"}, "--redis-sentinel-addrs needs --redis-master-name"},
		{"sentinel without port", Redis{SentinelAddrs: "s1:26379,s2", MasterName: "m"}, `--redis-sentinel-addrs: want HOST:PORT, got "s2"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := tc.r.Options()
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("Options() error = %v, want %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if o.MaxRetries != -1 || o.ReadTimeout != time.Second {
				t.Errorf("timeouts/retries not kept: %+v", o)
			}
			if tc.r.MasterName == "" {
				if o.MasterName != "" || len(o.Addrs) != 1 || o.Addrs[0] != "a:6379" {
					t.Errorf("plain: MasterName %q Addrs %q", o.MasterName, o.Addrs)
				}
				return
			}
			if o.MasterName != "m" || len(o.Addrs) != 2 || o.Addrs[0] != "s1:26379" || o.Addrs[1] != "s2:26379" {
				t.Errorf("sentinel: MasterName %q Addrs %q, want m and the two sentinels", o.MasterName, o.Addrs)
			}
		})
	}
}

// TestRedisAddrs: an address go-redis cannot dial is refused at start,
// naming the flag and the entry (before, "bogus" started a daemon that
// answered every check from the failure policy).
func TestRedisAddrs(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    Redis
		want string // "" for valid
		addr []string
	}{
		{"host and port", Redis{Addr: "redis.example:6379"}, "", []string{"redis.example:6379"}},
		{"IPv6", Redis{Addr: "[::1]:6379"}, "", []string{"[::1]:6379"}},
		{"cluster, blanks trimmed", Redis{Addr: " a:1, b:2 "}, "", []string{"a:1", "b:2"}},
		{"no port", Redis{Addr: "bogus"}, `--redis-addr: want HOST:PORT or unix:///PATH, got "bogus": missing port in address`, nil},
		{"empty port", Redis{Addr: "bogus:"}, `--redis-addr: want HOST:PORT or unix:///PATH, got "bogus:": the port must be a number from 1 to 65535`, nil},
		{"named port", Redis{Addr: "bogus:redis"}, `got "bogus:redis": the port must be a number`, nil},
		{"port 0", Redis{Addr: "a:0"}, `got "a:0": the port must be a number`, nil},
		{"port too large", Redis{Addr: "a:65536"}, `got "a:65536": the port must be a number`, nil},
		{"bare IPv6", Redis{Addr: "::1"}, `--redis-addr: want HOST:PORT or unix:///PATH, got "::1"`, nil},
		{"URL", Redis{Addr: "redis://a:6379"}, `--redis-addr: want HOST:PORT or unix:///PATH, got "redis://a:6379"`, nil},
		{"blank entry", Redis{Addr: "a:1,,b:2"}, `--redis-addr: want HOST:PORT or unix:///PATH, got a blank entry in "a:1,,b:2"`, nil},
		{"trailing comma", Redis{Addr: "a:1,"}, `got a blank entry in "a:1,"`, nil},
		{"empty", Redis{Addr: ""}, `--redis-addr: want HOST:PORT or unix:///PATH, got a blank entry in ""`, nil},
		{"one bad in a cluster", Redis{Addr: "a:1,b"}, `--redis-addr: want HOST:PORT or unix:///PATH, got "b"`, nil},
		{"sentinel without port", Redis{SentinelAddrs: "s1:26379,s2:x", MasterName: "m"}, `--redis-sentinel-addrs: want HOST:PORT, got "s2:x"`, nil},
		{"blank sentinel", Redis{SentinelAddrs: "s1:26379,", MasterName: "m"}, `--redis-sentinel-addrs: want HOST:PORT, got a blank entry`, nil},
		{"sentinels replace a bad --redis-addr", Redis{Addr: "bogus", SentinelAddrs: "s1:26379", MasterName: "m"}, "", []string{"s1:26379"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			verr := tc.r.Validate()
			o, err := tc.r.Options()
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) || verr == nil || verr.Error() != err.Error() {
					t.Fatalf("Options() error = %v, Validate() = %v; want %q", err, verr, tc.want)
				}
				return
			}
			if err != nil || verr != nil {
				t.Fatalf("Options() error = %v, Validate() = %v", err, verr)
			}
			if fmt.Sprint(o.Addrs) != fmt.Sprint(tc.addr) {
				t.Fatalf("Addrs = %q, want %q", o.Addrs, tc.addr)
			}
		})
	}
}

// TestRedisUnixSocket: --redis-addr unix:///PATH is a standalone Redis on
// its socket (the dialer ignores go-redis's "tcp"); what cannot go with a
// socket is refused, naming the flag.
func TestRedisUnixSocket(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    Redis
		want string // "" for valid
	}{
		{"socket", Redis{Addr: "unix:///run/redis/redis.sock"}, ""},
		{"no path", Redis{Addr: "unix://"}, "unix:// needs the socket's path"},
		{"with a cluster", Redis{Addr: "unix:///run/redis.sock,b:6379"}, "a Unix socket is one standalone Redis"},
		{"with TLS", Redis{Addr: "unix:///run/redis.sock", TLS: true}, "TLS is for TCP"},
		{"sentinels win", Redis{Addr: "unix://", SentinelAddrs: "s1:26379", MasterName: "m"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := tc.r.Options()
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "--redis-addr") {
					t.Fatalf("Options() error = %v, want %q naming --redis-addr", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tc.r.MasterName != "" {
				if o.Dialer != nil {
					t.Fatal("a Sentinel client got the socket's dialer")
				}
				return
			}
			if len(o.Addrs) != 1 || o.Addrs[0] != "/run/redis/redis.sock" || o.Dialer == nil {
				t.Fatalf("Options() = %q, dialer set %v; want the path and a dialer", o.Addrs, o.Dialer != nil)
			}
		})
	}

	// The dialer reaches the socket whatever network go-redis asks for.
	dir := t.TempDir()
	path := filepath.Join(dir, "r.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		if c, err := l.Accept(); err == nil {
			c.Write([]byte("+PONG\r\n"))
			c.Close()
		}
	}()
	o, err := (&Redis{Addr: "unix://" + path}).Options()
	if err != nil {
		t.Fatal(err)
	}
	c, err := o.Dialer(context.Background(), "tcp", path)
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	defer c.Close()
	if _, ok := c.RemoteAddr().(*net.UnixAddr); !ok {
		t.Fatalf("dialed %T, want a Unix socket", c.RemoteAddr())
	}
}

// TestRedisLogger: go-redis's messages become one slog record each, at
// Debug (none below Debug), through the logger InstallRedisLogger put in
// go-redis's place, instead of raw "redis: ..." lines on stderr.
func TestRedisLogger(t *testing.T) {
	records := func(b *bytes.Buffer) []map[string]any {
		t.Helper()
		var out []map[string]any
		for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
			if line == "" {
				continue
			}
			var m map[string]any
			if err := json.Unmarshal([]byte(line), &m); err != nil {
				t.Fatalf("not a JSON record: %q", line)
			}
			out = append(out, m)
		}
		return out
	}
	newLog := func(level slog.Level) (*slog.Logger, *bytes.Buffer) {
		b := &bytes.Buffer{}
		return slog.New(slog.NewJSONHandler(b, &slog.HandlerOptions{Level: level})), b
	}

	log, b := newLog(slog.LevelDebug)
	redisLogger{log}.Printf(context.Background(), "redis: connection pool: failed to dial after %d attempts: %v", 1,
		errors.New("dial tcp 127.0.0.1:26501: connect: connection refused"))
	got := records(b)
	want := "redis: connection pool: failed to dial after 1 attempts: dial tcp 127.0.0.1:26501: connect: connection refused"
	if len(got) != 1 || got[0]["level"] != "DEBUG" || got[0]["msg"] != want {
		t.Fatalf("records %v, want one at DEBUG with msg %q", got, want)
	}
	info, ib := newLog(slog.LevelInfo)
	redisLogger{info}.Printf(context.Background(), "redis: %s", "x")
	if ib.Len() != 0 {
		t.Fatalf("logged below its level: %q", ib)
	}

	// Installed: go-redis's own pool logs through it, the newest installed
	// first; uninstalled, the previous one gets the messages, then none.
	first, fb := newLog(slog.LevelDebug)
	second, sb := newLog(slog.LevelDebug)
	undoFirst := InstallRedisLogger(first)
	undoSecond := InstallRedisLogger(second)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := l.Addr().String()
	l.Close()
	rc := redis.NewClient(&redis.Options{Addr: closed, DialerRetries: 1, MaxRetries: -1})
	defer rc.Close()
	if err := rc.Ping(context.Background()).Err(); err == nil {
		t.Fatalf("ping %s answered", closed)
	}
	if r := records(sb); len(r) == 0 || r[0]["level"] != "DEBUG" || !strings.Contains(r[0]["msg"].(string), "failed to dial") ||
		!strings.Contains(r[0]["msg"].(string), closed) {
		t.Fatalf("go-redis's dial failure: %v, want a DEBUG record naming %s", r, closed)
	}
	if fb.Len() != 0 {
		t.Fatalf("an older logger got the message: %q", fb)
	}
	undoSecond()
	undoSecond() // twice is once
	installedRedisLog{}.Printf(context.Background(), "redis: to the first")
	if r := records(fb); len(r) != 1 || r[0]["msg"] != "redis: to the first" {
		t.Fatalf("after uninstalling the second: %v", r)
	}
	undoFirst()
	n := sb.Len() + fb.Len()
	installedRedisLog{}.Printf(context.Background(), "redis: to nobody")
	if sb.Len()+fb.Len() != n {
		t.Fatal("an uninstalled logger got a message")
	}
}

// TestRedisCallDeadline: a call through the options' client gives up at its
// context's deadline, not at the 1 s read timeout: the agent's store writes
// are bounded by StoreTimeout (the ledger's lease arithmetic relies on it).
func TestRedisCallDeadline(t *testing.T) {
	r := testutil.StartRedis(t)
	o, err := (&Redis{Addr: r.Addr}).Options()
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewUniversalClient(o)
	defer c.Close()
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	admin := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer admin.Close()
	if err := admin.Do(ctx, "CLIENT", "PAUSE", 3000, "WRITE").Err(); err != nil {
		t.Fatal(err)
	}
	defer admin.Do(ctx, "CLIENT", "UNPAUSE")
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = c.Set(cctx, "k", "v", 0).Err()
	if d := time.Since(start); err == nil || d > 700*time.Millisecond {
		t.Fatalf("a write to a paused Redis returned after %v (err %v), want an error at the 100 ms deadline, well before the 1 s read timeout", d, err)
	}
}
