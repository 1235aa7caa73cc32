package backend

import (
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
