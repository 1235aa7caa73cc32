package backend

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
