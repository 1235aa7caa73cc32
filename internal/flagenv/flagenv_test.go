package flagenv

import (
	"flag"
	"io"
	"testing"
)

func TestParse(t *testing.T) {
	env := map[string]string{"APPORTION_REDIS_ADDR": "env:1", "APPORTION_REGION": "eu", "APPORTION_MAX_COST": "x"}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	tests := []struct {
		name    string
		args    []string
		addr    string
		region  string
		wantErr bool
	}{
		{name: "env fills unset flags", args: nil, addr: "env:1", region: "eu"},
		{name: "command line wins", args: []string{"--redis-addr", "cli:2", "--max-cost", "3"}, addr: "cli:2", region: "eu"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			addr := fs.String("redis-addr", "default", "")
			region := fs.String("region", "", "")
			fs.Int("max-cost", 1, "")
			err := Parse(fs, tt.args, lookup)
			if tt.args == nil {
				// APPORTION_MAX_COST=x is not an int: the error names the variable.
				if err == nil || !contains(err.Error(), "APPORTION_MAX_COST") {
					t.Fatalf("want error naming APPORTION_MAX_COST, got %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if *addr != tt.addr || *region != tt.region {
				t.Fatalf("got addr=%q region=%q", *addr, *region)
			}
		})
	}
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

func TestName(t *testing.T) {
	if got := Name("etcd-endpoints"); got != "APPORTION_ETCD_ENDPOINTS" {
		t.Fatalf("got %s", got)
	}
}
