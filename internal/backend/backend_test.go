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
