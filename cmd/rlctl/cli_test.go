package main

import (
	"context"
	"encoding/json"
	"net"
	"strings"
	"testing"

	"github.com/apportion/apportion/internal/version"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"google.golang.org/grpc"
	"sigs.k8s.io/yaml"
)

// TestHelp: help on every command exits 0 and ends with the exit codes.
func TestHelp(t *testing.T) {
	for _, args := range [][]string{
		{"help"}, {"--help"}, {"-h"},
		{"rules", "--help"}, {"help", "rules"}, {"rules", "put", "--help"}, {"rules", "get", "-h"},
		{"rules", "list", "--help"}, {"rules", "delete", "--help"}, {"rules", "validate", "--help"},
		{"rules", "shadow", "--help"}, {"limits", "--help"}, {"limits", "show", "--help"},
		{"limits", "set", "--help"}, {"check", "--help"}, {"completion", "--help"}, {"version", "--help"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			r := rlctl(t, args...).must(t, exitOK, "Usage:", "Exit codes: 0 ok", "5 rejected", "APPORTION_")
			if r.stdout == "" {
				t.Errorf("help not on stdout")
			}
		})
	}
	// The global flags are listed everywhere; the deprecated --prefix is not.
	out := rlctl(t, "rules", "get", "--help").must(t, exitOK, "--etcd-endpoints", "--etcd-prefix", "-o, --output", "--timeout").stdout
	if strings.Contains(out, "--prefix ") {
		t.Errorf("deprecated --prefix shown in help:\n%s", out)
	}
	// A group's usage names its commands, not itself as a command.
	out = rlctl(t, "rules", "--help").must(t, exitOK, "rlctl rules [command]").stdout
	if strings.Contains(out, "rlctl rules [flags]") {
		t.Errorf("group usage offers to run the group alone:\n%s", out)
	}
}

func TestUnknownCommandSuggests(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"rulse", "list"}, []string{`unknown command "rulse" for "rlctl"`, "Did you mean this?", "rules"}},
		{[]string{"rules", "lst"}, []string{`unknown command "lst" for "rlctl rules"`, "list"}},
		{[]string{"limits", "sho", "x"}, []string{"Did you mean this?", "show"}},
		{[]string{"chek"}, []string{"check"}},
		{[]string{"rules"}, []string{"no command given", "Available Commands"}},
		{[]string{"limits"}, []string{"no command given", "show"}},
		{[]string{"rules", "get", "--bogus"}, []string{"unknown flag: --bogus", "rlctl rules get --help"}},
		{[]string{"help", "rulse"}, []string{`unknown command "rulse" for "rlctl"`, "rules"}},
		{[]string{"help", "rules", "frob"}, []string{`unknown command "frob" for "rlctl rules"`}},
		{[]string{"completion", "tcsh"}, []string{`unknown command "tcsh" for "rlctl completion"`}},
		{[]string{"completion"}, []string{"no command given", "bash"}},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			rlctl(t, tc.args...).must(t, exitUsage, tc.want...)
		})
	}
	// Singular and short aliases, as kubectl users type them.
	rlctl(t, "rule", "ls").must(t, exitUsage, "--etcd-endpoints") // found; no store given
}

func TestCompletion(t *testing.T) {
	for _, shell := range []string{"bash", "zsh", "fish", "powershell"} {
		out := rlctl(t, "completion", shell).must(t, exitOK).stdout
		if len(out) < 500 || !strings.Contains(out, "rlctl") {
			t.Errorf("completion %s: %d bytes:\n%.300s", shell, len(out), out)
		}
	}
	// What the shell scripts ask: commands, flag values, rule IDs from the store.
	rlctl(t, "__complete", "ru").must(t, exitOK, "rules")
	rlctl(t, "__complete", "rules", "g").must(t, exitOK, "get")
	rlctl(t, "__complete", "-o", "").must(t, exitOK, "table", "json", "yaml")
	rlctl(t, "__complete", "rules", "shadow", "x", "").must(t, exitOK, "on", "off")

	f := newFixture(t)
	for _, id := range []string{"orders-free", "orders-paid", "login"} {
		if _, err := f.store.Put(context.Background(), rules.Rule{ID: id, Algorithm: rules.TokenBucket, Capacity: 1, RefillPerSecond: 1}, 0); err != nil {
			t.Fatal(err)
		}
	}
	out := rlctl(t, "__complete", "--etcd-endpoints", f.endpoints, "rules", "get", "ord").must(t, exitOK).stdout
	if !strings.Contains(out, "orders-free\n") || !strings.Contains(out, "orders-paid\n") || strings.Contains(out, "login") {
		t.Errorf("rule IDs completed:\n%s", out)
	}
	t.Setenv("APPORTION_ETCD_ENDPOINTS", f.endpoints)
	rlctl(t, "__complete", "limits", "show", "").must(t, exitOK, "login", "orders-free")
}

func TestVersion(t *testing.T) {
	want := "rlctl " + version.String() + " ("
	for _, args := range [][]string{{"--version"}, {"version"}} {
		if out := rlctl(t, args...).must(t, exitOK).stdout; !strings.HasPrefix(out, want) {
			t.Errorf("%v: %q, want prefix %q", args, out, want)
		}
	}
}

// TestOutputYAML: -o yaml prints the same documents as -o json, and a rule
// got as YAML can be put back unchanged.
func TestOutputYAML(t *testing.T) {
	f := newFixture(t)
	global := []string{"--etcd-endpoints", f.endpoints}
	cmd := func(args ...string) result { return rlctl(t, append(append([]string{}, global...), args...)...) }
	cmd("rules", "put", "-f", f.file(t, "one.json", ordersRule), "-o", "yaml").must(t, exitOK, "- id: orders-free", "revision:")

	y := cmd("rules", "get", "orders-free", "-o", "yaml").must(t, exitOK).stdout
	j := cmd("rules", "get", "orders-free", "-o", "json").must(t, exitOK).stdout
	var fromYAML, fromJSON rules.Rule
	if err := yaml.Unmarshal([]byte(y), &fromYAML); err != nil {
		t.Fatalf("%v\n%s", err, y)
	}
	if err := json.Unmarshal([]byte(j), &fromJSON); err != nil {
		t.Fatal(err)
	}
	if !sameRules([]rules.Rule{fromYAML}, []rules.Rule{fromJSON}) || fromYAML.Regions["us-east"] != 2 {
		t.Fatalf("yaml and json differ:\n%s\n%s", y, j)
	}
	if !strings.Contains(y, "refill_per_second: 10") {
		t.Errorf("yaml does not use the rule's field names:\n%s", y)
	}
	_, rev, _ := f.store.Get(context.Background(), "orders-free")
	cmd("rules", "put", "-f", f.file(t, "back.yaml", y), "--if-match", itoa(rev)).must(t, exitOK, "stored")

	list := cmd("rules", "list", "-o", "yaml").must(t, exitOK).stdout
	if !strings.HasPrefix(list, "- ") || !strings.Contains(list, "id: orders-free") {
		t.Errorf("rules list -o yaml:\n%s", list)
	}
	// The list goes back with rules put -f.
	cmd("rules", "put", "-f", f.file(t, "list.yaml", list)).must(t, exitOK, "orders-free", "stored")
	cmd("rules", "validate", "-f", f.file(t, "l.yaml", listYAML), "-o", "yaml").must(t, exitOK, "valid: true", "- login")
	cmd("limits", "show", "orders-free", "-o", "yaml").must(t, exitOK, "regions:", "static_rate: 5")
	cmd("rules", "shadow", "orders-free", "on", "-o", "yaml").must(t, exitOK, "shadow: true", "changed: true")
	cmd("rules", "delete", "orders-free", "-o", "yaml").must(t, exitOK, "deleted: true")
	// Empty lists are lists, not null.
	if out := cmd("rules", "list", "-o", "yaml").must(t, exitOK).stdout; strings.TrimSpace(out) != "[]" {
		t.Errorf("empty list as yaml: %q", out)
	}
}

// TestEtcdPrefix: --etcd-prefix as the daemons name it; --prefix and
// APPORTION_PREFIX still work, with a deprecation note on stderr.
func TestEtcdPrefix(t *testing.T) {
	f := newFixture(t)
	ec := func() *etcdstore.Store {
		s, err := etcdstore.New(f.client, etcdstore.WithPrefix("/team-a/rules/"))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}()
	if _, err := ec.Put(context.Background(), rules.Rule{ID: "team-a-only", Algorithm: rules.TokenBucket, Capacity: 1, RefillPerSecond: 1}, 0); err != nil {
		t.Fatal(err)
	}
	base := []string{"--etcd-endpoints", f.endpoints, "rules", "list"}
	if out := rlctl(t, base...).must(t, exitOK).stdout; strings.Contains(out, "team-a-only") {
		t.Fatalf("default prefix lists another prefix's rule:\n%s", out)
	}
	r := rlctl(t, append(base, "--etcd-prefix", "/team-a/rules/")...).must(t, exitOK, "team-a-only")
	if r.stderr != "" {
		t.Errorf("stderr: %s", r.stderr)
	}
	r = rlctl(t, append(base, "--prefix", "/team-a/rules/")...).must(t, exitOK, "team-a-only")
	if !strings.Contains(r.stderr, "--prefix (APPORTION_PREFIX) is deprecated, use --etcd-prefix") {
		t.Errorf("no deprecation note: %q", r.stderr)
	}
	t.Setenv("APPORTION_PREFIX", "/team-a/rules/")
	rlctl(t, base...).must(t, exitOK, "team-a-only", "deprecated")
	// The command line wins over either variable, and the new variable over the old.
	if out := rlctl(t, append(base, "--etcd-prefix", etcdstore.DefaultPrefix)...).must(t, exitOK).stdout; strings.Contains(out, "team-a-only") {
		t.Errorf("--etcd-prefix lost to APPORTION_PREFIX:\n%s", out)
	}
	t.Setenv("APPORTION_ETCD_PREFIX", etcdstore.DefaultPrefix)
	if out := rlctl(t, base...).must(t, exitOK).stdout; strings.Contains(out, "team-a-only") {
		t.Errorf("APPORTION_ETCD_PREFIX lost to APPORTION_PREFIX:\n%s", out)
	}
	rlctl(t, append(base, "--etcd-prefix", "no-slash")...).must(t, exitUsage, "--etcd-prefix")
}

// rejectingLimiter rejects every request.
type rejectingLimiter struct {
	ratelimitv1.UnimplementedRateLimiterServer
}

func (rejectingLimiter) CheckLimit(context.Context, *ratelimitv1.CheckLimitRequest) (*ratelimitv1.CheckLimitResponse, error) {
	return &ratelimitv1.CheckLimitResponse{
		Allowed: false, Limit: 20, Remaining: 0, RuleId: "orders-free", RetryAfterMs: 450,
		Statuses: []*ratelimitv1.RuleStatus{{RuleId: "orders-free", Allowed: false, Limit: 20, RetryAfterMs: 450}},
	}, nil
}

func serveLimiter(t *testing.T, srv ratelimitv1.RateLimiterServer) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	ratelimitv1.RegisterRateLimiterServer(gs, srv)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	t.Cleanup(func() {
		gs.Stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return lis.Addr().String()
}

// TestCheckRejectedExitCode: a rejected check prints the answer and exits
// 5, apart from a failure (1); an allowed one exits 0.
func TestCheckRejectedExitCode(t *testing.T) {
	rej := serveLimiter(t, rejectingLimiter{})
	res := rlctl(t, "check", "--addr", rej, "--client-key", "user:42").
		must(t, exitRejected, "REJECTED rule=orders-free limit=20 remaining=0 retry_after_ms=450", "RULE")
	if !strings.Contains(res.err.Error(), "rejected by rule orders-free") {
		t.Errorf("error: %v", res.err)
	}
	for _, o := range []string{"json", "yaml"} {
		out := rlctl(t, "-o", o, "check", "--addr", rej, "--client-key", "k").must(t, exitRejected).stdout
		var resp map[string]any
		if err := yaml.Unmarshal([]byte(out), &resp); err != nil || resp["allowed"] != false || resp["rule_id"] != "orders-free" {
			t.Errorf("-o %s: %v\n%s", o, err, out)
		}
	}
	ok := serveLimiter(t, &fakeLimiter{})
	rlctl(t, "check", "--addr", ok, "--client-key", "k").must(t, exitOK, "ALLOWED")
	out := rlctl(t, "check", "--addr", ok, "--client-key", "k", "-o", "yaml").must(t, exitOK, "allowed: true").stdout
	if strings.Contains(out, "{") {
		t.Errorf("-o yaml printed JSON:\n%s", out)
	}
}
