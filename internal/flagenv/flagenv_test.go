package flagenv

import (
	"flag"
	"io"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		args    []string
		addr    string
		region  string
		wantErr string
	}{
		{name: "env fills unset flags", env: map[string]string{"APPORTION_REDIS_ADDR": "env:1", "APPORTION_REGION": "eu"},
			addr: "env:1", region: "eu"},
		{name: "command line wins", env: map[string]string{"APPORTION_REDIS_ADDR": "env:1", "APPORTION_REGION": "eu"},
			args: []string{"--redis-addr", "cli:2"}, addr: "cli:2", region: "eu"},
		{name: "defaults without env", addr: "default"},
		{name: "bad env value names the variable", env: map[string]string{"APPORTION_MAX_COST": "x"},
			wantErr: "APPORTION_MAX_COST"},
		{name: "bad env value is ignored when the flag is given", env: map[string]string{"APPORTION_MAX_COST": "x"},
			args: []string{"--max-cost", "3"}, addr: "default"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lookup := func(k string) (string, bool) { v, ok := tt.env[k]; return v, ok }
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			addr := fs.String("redis-addr", "default", "")
			region := fs.String("region", "", "")
			fs.Int("max-cost", 1, "")
			err := Parse(fs, tt.args, lookup)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("want an error naming %s, got %v", tt.wantErr, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if *addr != tt.addr || *region != tt.region {
				t.Fatalf("got addr=%q region=%q, want %q %q", *addr, *region, tt.addr, tt.region)
			}
		})
	}
}

func TestName(t *testing.T) {
	if got := Name("etcd-endpoints"); got != "APPORTION_ETCD_ENDPOINTS" {
		t.Fatalf("got %s", got)
	}
}
