package version

import (
	"runtime/debug"
	"strings"
	"testing"
)

func TestDerive(t *testing.T) {
	vcs := func(rev, modified string) []debug.BuildSetting {
		return []debug.BuildSetting{{Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified}}
	}
	for _, tc := range []struct {
		name   string
		linked string
		bi     *debug.BuildInfo
		want   string
	}{
		{"linker wins", "v1.2.3", &debug.BuildInfo{Main: debug.Module{Version: "v0.9.0"}}, "v1.2.3"},
		{"go install @version", "", &debug.BuildInfo{Main: debug.Module{Version: "v0.9.0"}}, "v0.9.0"},
		{"checkout", "", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: vcs("0123456789abcdef0123", "false")}, "devel+0123456789ab"},
		{"modified checkout", "", &debug.BuildInfo{Settings: vcs("abc", "true")}, "devel+abc+dirty"},
		{"no VCS", "", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, "devel"},
		{"no build info", "", nil, "devel"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := derive(tc.linked, tc.bi); got != tc.want {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestLine(t *testing.T) {
	l := Line("rlctl")
	if !strings.HasPrefix(l, "rlctl "+String()+" (go") {
		t.Fatalf("Line = %q", l)
	}
}

func TestRequested(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want bool
	}{
		{[]string{"--version"}, true},
		{[]string{"--region", "x", "-version"}, true},
		{[]string{"--version=true"}, true},
		{[]string{"--version=false"}, false},
		{[]string{"--region", "version"}, false},
		{[]string{"--", "--version"}, false},
		{nil, false},
	} {
		if got := Requested(tc.args); got != tc.want {
			t.Errorf("Requested(%q) = %v, want %v", tc.args, got, tc.want)
		}
	}
}
