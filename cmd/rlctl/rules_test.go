package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/apportion/apportion/sync/agent"
	"github.com/apportion/apportion/sync/ledger"
	"sigs.k8s.io/yaml"
)

// backends are the global flags of the two ways to the store.
func (f *fixture) backends() map[string][]string {
	return map[string][]string{
		"etcd":  {"--etcd-endpoints", f.endpoints},
		"admin": {"--admin-url", f.adminURL, "--token", token},
	}
}

func with(global []string, args ...string) []string {
	return append(append([]string{}, global...), args...)
}

// skewRules is a file of two global rules, as the tester's.
func skewRules(capacity int) string {
	return fmt.Sprintf(`[
  {"id":"x-skew","algorithm":"token_bucket","capacity":%d,"refill_per_second":10,"scope":"global","regions":{"us-east":1,"eu-west":1},"min_share":0.1},
  {"id":"y-skew","algorithm":"token_bucket","capacity":%d,"refill_per_second":10,"scope":"global","regions":{"us-east":1,"eu-west":1},"min_share":0.1}
]`, capacity, capacity)
}

// Concurrent "rules put -f" without --if-match of files of global rules all
// succeed: a put the store turned conditional on the revision it checked is
// checked and stored again after a concurrent change, not failed (exit 4).
func TestRulesPutConcurrently(t *testing.T) {
	f := newFixture(t)
	const writers = 8
	var wg sync.WaitGroup
	results := make([]result, writers)
	for w := range writers {
		global := f.backends()[[]string{"etcd", "admin"}[w%2]]
		file := f.file(t, fmt.Sprintf("skew%d.json", w), skewRules(100+w))
		wg.Go(func() {
			var out, errb strings.Builder
			err := run(context.Background(), with(global, "rules", "put", "-f", file), &out, &errb)
			results[w] = result{out.String(), errb.String(), err, exitCode(err)}
		})
	}
	wg.Wait()
	for w, r := range results {
		if r.code != exitOK || strings.Count(r.stdout, "stored") != 2 {
			t.Errorf("writer %d: exit %d (%v)\n%s%s", w, r.code, r.err, r.stdout, r.stderr)
		}
	}
	if rs, _, err := f.store.List(context.Background()); err != nil || len(rs) != 2 {
		t.Fatalf("stored %v %v", rs, err)
	}
}

// rules put runs the whole-file check of rules validate before it stores
// anything: a file that validate refuses stores nothing.
func TestRulesPutValidatesTheWholeFileFirst(t *testing.T) {
	f := newFixture(t)
	multi := f.file(t, "multi.json", `[
  {"id":"first","algorithm":"token_bucket","capacity":10,"refill_per_second":1},
  {"id":"m2","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"scope":"global","regions":{"us-east":1,"eu-west":1},"min_share":0.5}
]`)
	for name, global := range f.backends() {
		t.Run(name, func(t *testing.T) {
			p := rlctl(t, with(global, "rules", "put", "-f", multi)...)
			if rs, _, _ := f.store.List(context.Background()); len(rs) != 0 {
				t.Fatalf("stored %v of a file validate refuses", rs)
			}
			p.must(t, exitFailure, "min_share", `rule "m2" (item 2)`)
			v := rlctl(t, "rules", "validate", "-f", multi).must(t, exitFailure)
			if p.err.Error() != v.err.Error() {
				t.Errorf("put and validate disagree:\nput:      %v\nvalidate: %v", p.err, v.err)
			}
			if p.stdout != "" {
				t.Errorf("stdout: %q", p.stdout)
			}
		})
	}
}

// --if-match is a revision, above 0: 0 and negative values are usage
// errors (0 would read as "not given" and store with no condition), from
// the command line or the environment.
func TestIfMatchMustBeARevision(t *testing.T) {
	f := newFixture(t)
	global := []string{"--etcd-endpoints", f.endpoints}
	one := f.file(t, "one.json", ordersRule)
	rlctl(t, with(global, "rules", "put", "-f", one)...).must(t, exitOK)
	_, rev, _ := f.store.Get(context.Background(), "orders-free")
	for _, v := range []string{"0", "-5", "-1"} {
		for _, args := range [][]string{
			{"rules", "put", "-f", one, "--if-match", v},
			{"rules", "delete", "orders-free", "--if-match", v},
			{"limits", "set", "orders-free", "--rate", "3", "--if-match", v},
		} {
			t.Run(strings.Join(args, " "), func(t *testing.T) {
				rlctl(t, with(global, args...)...).must(t, exitUsage, "--if-match "+v+": a revision is above 0")
			})
		}
	}
	t.Setenv("APPORTION_IF_MATCH", "0")
	rlctl(t, with(global, "rules", "put", "-f", one)...).must(t, exitUsage, "APPORTION_IF_MATCH", "above 0")
	if _, now, _ := f.store.Get(context.Background(), "orders-free"); now != rev {
		t.Fatalf("the rule changed: revision %d -> %d", rev, now)
	}
}

// A global rule deleted and put again under its id with another split is
// refused naming the field, where a real sync agent registry holds the
// rule's split (through etcd and through the admin API), and under the
// agents' --registry-prefix; the same split goes back.
func TestRulesPutRefusesASplitTheAgentsRegistered(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	spec := func(r rules.Rule) agent.Spec {
		return agent.Spec{Units: ledger.DefaultConfig().Units, MinShare: r.MinShare, Regions: ledger.Regions(r.Regions)}
	}
	orders, err := rules.ParseRule([]byte(ordersRule))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := agent.NewEtcdRegistry(f.client, "", ledger.DefaultConfig()).Start(ctx, orders.ID, spec(orders), "us-east"); err != nil {
		t.Fatal(err)
	}
	moved := strings.Replace(ordersRule, `"ap-south": 1`, `"sa-east": 1`, 1)
	floor := strings.Replace(ordersRule, `"min_share": 0.1`, `"min_share": 0.2`, 1)
	for name, global := range f.backends() {
		t.Run(name, func(t *testing.T) {
			rlctl(t, with(global, "rules", "put", "-f", f.file(t, "o.json", ordersRule))...).must(t, exitOK)
			rlctl(t, with(global, "rules", "delete", "orders-free")...).must(t, exitOK)
			r := rlctl(t, with(global, "rules", "put", "-f", f.file(t, "moved.json", moved))...).
				must(t, exitFailure, "regions:", "still registered by the sync agents", "new rule id")
			if msg := r.err.Error(); strings.Count(msg, "regions:") != 1 || strings.Count(msg, `rule "orders-free"`) != 1 {
				t.Errorf("the error names the field or the rule more than once: %s", msg)
			}
			rlctl(t, with(global, "rules", "put", "-f", f.file(t, "floor.json", floor))...).must(t, exitFailure, "min_share:", "new rule id")
			rlctl(t, with(global, "rules", "put", "-f", f.file(t, "o.json", ordersRule))...).must(t, exitOK, "stored")
			rlctl(t, with(global, "rules", "delete", "orders-free")...).must(t, exitOK)
		})
	}
	// Agents run with --registry-prefix: so does rlctl.
	if _, _, err := agent.NewEtcdRegistry(f.client, "/team-a/registry/", ledger.DefaultConfig()).Start(ctx, "team-a", spec(orders), "us-east"); err != nil {
		t.Fatal(err)
	}
	teamA := f.file(t, "team-a.json", strings.Replace(moved, "orders-free", "team-a", 1))
	global := []string{"--etcd-endpoints", f.endpoints, "--registry-prefix", "/team-a/registry/"}
	rlctl(t, with(global, "rules", "put", "-f", teamA)...).must(t, exitFailure, "regions:", "/team-a/registry/team-a")
	t.Setenv("APPORTION_REGISTRY_PREFIX", "/team-a/registry/")
	rlctl(t, "--etcd-endpoints", f.endpoints, "rules", "put", "-f", teamA).must(t, exitFailure, "regions:")
	rlctl(t, "--etcd-endpoints", f.endpoints, "--registry-prefix", "nope", "rules", "list").must(t, exitUsage, "--registry-prefix")
}

// rules list shows the stored documents that are not valid rules (the
// runbook of ApportionInvalidRuleDocuments sends the operator there): a
// row with status invalid and the error, and in -o json|yaml a separate
// field; the exit code stays 0.
func TestRulesListShowsInvalidDocuments(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	rlctl(t, "--etcd-endpoints", f.endpoints, "rules", "put", "-f", f.file(t, "one.json", ordersRule)).must(t, exitOK)
	for id, doc := range map[string]string{
		"badcap":  `{"id":"badcap","algorithm":"token_bucket","capacity":-1,"refill_per_second":1}`,
		"notjson": `not json at all`,
	} {
		if _, err := f.client.Put(ctx, etcdstore.DefaultPrefix+id, doc); err != nil {
			t.Fatal(err)
		}
	}
	for name, global := range f.backends() {
		t.Run(name, func(t *testing.T) {
			out := rlctl(t, with(global, "rules", "list")...).must(t, exitOK, "orders-free", "2 stored document(s) are not valid rules", "STATUS").stdout
			for _, line := range strings.Split(out, "\n") {
				if strings.HasPrefix(line, "badcap ") && !(strings.Contains(line, " invalid ") && strings.Contains(line, "capacity: must be at least 1")) ||
					strings.HasPrefix(line, "notjson ") && !(strings.Contains(line, " invalid ") && strings.Contains(line, "invalid JSON")) {
					t.Errorf("row %q", line)
				}
			}
			if !strings.Contains(out, "\nbadcap ") || !strings.Contains(out, "\nnotjson ") {
				t.Errorf("rules list:\n%s", out)
			}
			// -o json|yaml: the list of rules as before, the invalid
			// documents named on stderr.
			for _, format := range []string{"json", "yaml"} {
				res := rlctl(t, with(global, "rules", "list", "-o", format)...).must(t, exitOK)
				var l []rules.Rule
				err := yaml.Unmarshal([]byte(res.stdout), &l) // YAML reads JSON too
				if err != nil || len(l) != 1 || l[0].ID != "orders-free" ||
					!strings.Contains(res.stderr, `"badcap" (revision `) || !strings.Contains(res.stderr, "capacity: must be at least 1") ||
					!strings.Contains(res.stderr, `"notjson" (revision `) {
					t.Errorf("rules list -o %s: %v\nstdout:\n%s\nstderr:\n%s", format, err, res.stdout, res.stderr)
				}
			}
		})
	}
}

// retryLimiter rejects with retry_after_ms -1: waiting cannot help.
type retryLimiter struct {
	ratelimitv1.UnimplementedRateLimiterServer
}

func (retryLimiter) CheckLimit(context.Context, *ratelimitv1.CheckLimitRequest) (*ratelimitv1.CheckLimitResponse, error) {
	return &ratelimitv1.CheckLimitResponse{Allowed: false, Limit: 3, RuleId: "x", RetryAfterMs: -1,
		Statuses: []*ratelimitv1.RuleStatus{{RuleId: "x", Limit: 3, RetryAfterMs: -1}}}, nil
}

// The small messages the tester met.
func TestSmallMessages(t *testing.T) {
	f := newFixture(t)
	global := []string{"--etcd-endpoints", f.endpoints}
	rlctl(t, with(global, "rules", "put", "-f", f.file(t, "one.json", ordersRule))...).must(t, exitOK)

	t.Run("non-ASCII id", func(t *testing.T) {
		// The character, and its stated byte offset.
		r := rlctl(t, "rules", "validate", "-f", f.file(t, "id.json", `{"id":"ordérs","algorithm":"token_bucket","capacity":1,"refill_per_second":1}`)).
			must(t, exitFailure, `has character 'é' (U+00E9) at byte offset 3`)
		if strings.Contains(r.err.Error(), "Ã") {
			t.Errorf("a byte printed as a character: %v", r.err)
		}
	})
	t.Run("field error through the admin API", func(t *testing.T) {
		g := f.backends()["admin"]
		moved := strings.Replace(ordersRule, `"ap-south": 1`, `"sa-east": 1`, 1)
		r := rlctl(t, with(g, "rules", "put", "-f", f.file(t, "moved.json", moved))...).must(t, exitFailure, "regions:")
		if msg := r.err.Error(); strings.Count(msg, "regions:") != 1 || strings.Count(msg, "rules:") != 1 || strings.Count(msg, `"orders-free"`) != 1 {
			t.Errorf("wrapped twice: %s", msg)
		}
	})
	t.Run("limits set --rate 0", func(t *testing.T) {
		// A wrong value, not a missing flag.
		for _, args := range [][]string{{"--rate", "0"}, {"--rate", "-2"}, {"--burst", "0"}} {
			r := rlctl(t, with(global, append([]string{"limits", "set", "orders-free"}, args...)...)...).must(t, exitUsage, args[0]+" "+args[1]+": the ")
			if strings.Contains(r.err.Error(), "give --rate") {
				t.Errorf("%v: %v", args, r.err)
			}
		}
		rlctl(t, with(global, "limits", "set", "orders-free")...).must(t, exitUsage, "give --rate N and/or --burst N")
	})
	t.Run("failed conditional put", func(t *testing.T) {
		// No empty table on stdout.
		for name, g := range f.backends() {
			r := rlctl(t, with(g, "rules", "put", "--create", "-f", f.file(t, "one.json", ordersRule))...).must(t, exitConflict, "exists")
			if r.stdout != "" {
				t.Errorf("%s: a put that stored nothing printed %q", name, r.stdout)
			}
		}
	})
	t.Run("etcd endpoints from the environment", func(t *testing.T) {
		t.Setenv("APPORTION_ETCD_ENDPOINTS", f.endpoints)
		rlctl(t, "--admin-url", f.adminURL, "rules", "list").
			must(t, exitUsage, "not both", "--etcd-endpoints (from APPORTION_ETCD_ENDPOINTS in the environment)", "unset APPORTION_ETCD_ENDPOINTS")
		rlctl(t, "--admin-url", f.adminURL, "--token", token, "--etcd-endpoints", "", "rules", "list").must(t, exitOK, "orders-free")
	})
	t.Run("check: waiting cannot help", func(t *testing.T) {
		addr := serveLimiter(t, retryLimiter{})
		r := rlctl(t, "check", "--addr", addr, "--client-key", "k", "--cost", "5").must(t, exitRejected, "waiting cannot help")
		if strings.Contains(r.err.Error(), "-1 ms") {
			t.Errorf("check: %v", r.err)
		}
	})
}

// A file too large for --timeout is refused saying the time ran out for the
// file, not that etcd did not answer: etcd answered every rule before it.
func TestRulesPutLargeFileTimeout(t *testing.T) {
	f := newFixture(t)
	var b strings.Builder
	b.WriteString("[")
	const n = 20000 // more than etcd stores in 500 ms on a quiet machine (3,000 once all went in)
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `{"id":"r%05d","match":{"resource":"GET /r%d"},"algorithm":"token_bucket","capacity":10,"refill_per_second":1}`, i, i)
	}
	b.WriteString("]")
	file := f.file(t, "large.json", b.String())
	p := rlctl(t, "--etcd-endpoints", f.endpoints, "--timeout", "500ms", "rules", "put", "-f", file)
	rs, _, err := f.store.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) == 0 || len(rs) == n {
		t.Fatalf("%d of %d rules stored in 500ms: want some, not all (%v)", len(rs), n, p.err)
	}
	t.Logf("%d of %d rules stored in 500ms", len(rs), n)
	p.must(t, exitFailure, fmt.Sprintf("of %d rules stored when --timeout (500ms) ran out", n), "etcd answered every one before it", "raise --timeout to at least")
	// The count is of the rules etcd confirmed: the one whose answer the
	// deadline cut off may be stored too.
	var said int
	if _, err := fmt.Sscanf(p.err.Error()[strings.Index(p.err.Error(), ": ")+2:], "%d of", &said); err != nil || said != len(rs) && said != len(rs)-1 {
		t.Fatalf("the error says %d stored (%v), etcd holds %d: %v", said, err, len(rs), p.err)
	}
	if strings.Contains(p.err.Error(), "did not answer") {
		t.Fatalf("the error blames etcd: %v", p.err)
	}
}
