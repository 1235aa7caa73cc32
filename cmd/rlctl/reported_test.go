package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
)

// A rule file of one YAML rule meets the checks of a list (rules.ParseRules):
// a second document after "---" (valid or broken) and a repeated key are
// refused, naming the file and what is wrong, by validate and by put
// (which then stores nothing), where they were dropped or overwritten.
func TestRuleFileSingleYAMLIsStrict(t *testing.T) {
	f := newFixture(t)
	const m1 = "id: m1\nalgorithm: fixed_window\nlimit: 3\nwindow: 1m\n"
	for _, tc := range []struct{ name, doc, want string }{
		{"second document", m1 + "---\nid: m2\nalgorithm: fixed_window\nlimit: 3\nwindow: 1m\n", "several YAML documents"},
		{"broken second document", m1 + "---\n: : [oops\n", "several YAML documents"},
		{"repeated key", "id: m1\nalgorithm: fixed_window\nlimit: 3\nlimit: 300\nwindow: 1m\n", `key "limit" already set`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			file := f.file(t, strings.ReplaceAll(tc.name, " ", "-")+".yaml", tc.doc)
			rlctl(t, "rules", "validate", "-f", file).must(t, exitFailure, file+": ", tc.want)
			for name, global := range f.backends() {
				rlctl(t, with(global, "rules", "put", "-f", file)...).must(t, exitFailure, file+": ", tc.want)
				if rs, _, _ := f.store.List(context.Background()); len(rs) != 0 {
					t.Fatalf("%s: stored %v from a refused file", name, rs)
				}
			}
		})
	}
	// One document, with comments, a leading "---" and an end marker: still one rule.
	ok := f.file(t, "ok.yaml", "# a rule\n---\n"+m1+"...\n")
	rlctl(t, "rules", "validate", "-f", ok).must(t, exitOK, "ok: 1 valid rule(s): m1")
}

// rules list says how to remove an invalid document: rlctl's commands for
// the keys it can name, the etcdctl del line with the full key for those it
// cannot (an id with "/", an empty id), whose rlctl commands are refused.
func TestRulesListSaysHowToRemoveInvalidDocuments(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	bad := `{"id":"x","algorithm":"token_bucket","capacity":-1,"refill_per_second":1}`
	for _, id := range []string{"a/nested", "", "a b", "badcap"} {
		if _, err := f.client.Put(ctx, etcdstore.DefaultPrefix+id, bad); err != nil {
			t.Fatal(err)
		}
	}
	for name, global := range f.backends() {
		t.Run(name, func(t *testing.T) {
			out := rlctl(t, with(global, "rules", "list")...).must(t, exitOK, "4 stored document(s) are not valid rules").stdout
			for prefix, want := range map[string]string{
				`a/nested `: `remove it with etcdctl del '/ratelimit/rules/a/nested'`,
				`"" `:       `remove it with etcdctl del '/ratelimit/rules/'`,
				`"a b" `:    `rules put cannot fix it: remove it with rules delete 'a b'`,
				`badcap `:   `fix it with rules put -f, or remove it with rules delete badcap`,
			} {
				if row := rowStarting(out, prefix); !strings.Contains(row, want) {
					t.Errorf("row of %s: %q, want %q\n%s", prefix, row, want, out)
				}
			}
			if strings.Contains(rowStarting(out, "a/nested "), "rules delete") || strings.Contains(rowStarting(out, `"" `), "rules delete") {
				t.Errorf("a key rlctl cannot name is sent to rlctl:\n%s", out)
			}
			res := rlctl(t, with(global, "rules", "list", "-o", "json")...).must(t, exitOK)
			if !strings.Contains(res.stderr, `"a/nested" (revision`) || !strings.Contains(res.stderr, `etcdctl del '/ratelimit/rules/a/nested'`) {
				t.Errorf("stderr of -o json:\n%s", res.stderr)
			}
		})
	}
	// The commands rlctl names work, and rlctl refuses the keys it sends to etcdctl.
	rlctl(t, "--etcd-endpoints", f.endpoints, "rules", "delete", "a b").must(t, exitOK, "deleted a b")
	rlctl(t, "--etcd-endpoints", f.endpoints, "rules", "delete", "a/nested").must(t, exitFailure, "must not contain")
	if resp, err := f.client.Get(ctx, etcdstore.DefaultPrefix+"a b"); err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("a b still stored: %v %v", resp, err)
	}
	// Another --etcd-prefix: the key named is under it.
	if _, err := f.client.Put(ctx, "/team-a/rules/t/x", bad); err != nil {
		t.Fatal(err)
	}
	rlctl(t, "--etcd-endpoints", f.endpoints, "--etcd-prefix", "/team-a/rules/", "rules", "list").must(t, exitOK, `etcdctl del '/team-a/rules/t/x'`)
}

// rowStarting returns the first line of out that starts with prefix.
func rowStarting(out, prefix string) string {
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, prefix) {
			return line
		}
	}
	return ""
}

// limits show of a global window rule shows the limit per window and each
// region's static share and floor per window, the figures the store
// enforces (floor(limit x units / 10^6) of the region's units), in the
// table and in JSON; no rate of 0.
func TestLimitsShowWindowRule(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	for _, r := range []rules.Rule{
		{ID: "win", Algorithm: rules.FixedWindow, Limit: 100, Window: rules.Duration(60e9), Scope: rules.Global,
			Regions: map[string]float64{"us-east": 2, "eu-west": 1, "ap-south": 1}, MinShare: 0.2},
		{ID: "slide", Algorithm: rules.SlidingWindow, Limit: 10, Window: rules.Duration(1e9), Scope: rules.Global,
			Regions: map[string]float64{"a": 1, "b": 1, "c": 1}, MinShare: 0.5},
		{ID: "log", Algorithm: rules.SlidingLog, Limit: 90, Window: rules.Duration(1e9), Scope: rules.Global,
			Regions: map[string]float64{"a": 1, "b": 2}},
	} {
		if _, err := f.store.Put(ctx, r, 0); err != nil {
			t.Fatal(err)
		}
	}
	global := []string{"--etcd-endpoints", f.endpoints}
	out := rlctl(t, with(global, "limits", "show", "win")...).must(t, exitOK, "global limit: 100 per window of 1m, min_share 0.2", "STATIC /WINDOW", "FLOOR /WINDOW").stdout
	if strings.Contains(out, "RATE") || strings.Contains(out, "rate 0") {
		t.Errorf("a rate for a window rule:\n%s", out)
	}
	for _, row := range [][]string{{"ap-south", "1", "25", "5"}, {"eu-west", "1", "25", "5"}, {"us-east", "2", "50", "10"}} {
		if !hasRow(out, row...) {
			t.Errorf("no row %v:\n%s", row, out)
		}
	}
	// 10 per second over three equal regions, half of it floors: each
	// region's units (about a third, and a sixth) rounded down to whole
	// requests, 3 and 1, not 3.33 and 1.67.
	out = rlctl(t, with(global, "limits", "show", "slide")...).must(t, exitOK).stdout
	if !hasRow(out, "a", "1", "3", "1") || !hasRow(out, "b", "1", "3", "1") || !hasRow(out, "c", "1", "3", "1") {
		t.Errorf("sliding_window:\n%s", out)
	}
	out = rlctl(t, with(global, "limits", "show", "log")...).must(t, exitOK, "not coordinated").stdout
	if !strings.Contains(rowStarting(out, "b "), " 60 ") {
		t.Errorf("sliding_log static share:\n%s", out)
	}

	js := rlctl(t, with(global, "limits", "show", "win", "-o", "json")...).must(t, exitOK).stdout
	var v map[string]any
	if err := json.Unmarshal([]byte(js), &v); err != nil {
		t.Fatal(err)
	}
	if v["limit"] != 100.0 || v["window"] != "1m" || v["rate"] != nil || v["burst"] != nil {
		t.Errorf("window rule's limit in JSON:\n%s", js)
	}
	got := map[string]string{}
	for _, r := range v["regions"].([]any) {
		m := r.(map[string]any)
		if _, ok := m["floor_rate"]; ok {
			t.Errorf("floor_rate for a window rule:\n%s", js)
		}
		got[m["region"].(string)] = fmt.Sprint(m["static_per_window"], "/", m["floor_per_window"])
	}
	if want := map[string]string{"ap-south": "25/5", "eu-west": "25/5", "us-east": "50/10"}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("static/floor per window %v, want %v\n%s", got, want, js)
	}
	// A token bucket keeps its fields.
	if _, err := f.store.Put(ctx, rules.Rule{ID: "tb", Algorithm: rules.TokenBucket, Capacity: 40, RefillPerSecond: 20, Scope: rules.Global,
		Regions: map[string]float64{"a": 1, "b": 1}}, 0); err != nil {
		t.Fatal(err)
	}
	js = rlctl(t, with(global, "limits", "show", "tb", "-o", "json")...).must(t, exitOK, `"rate": 20`, `"burst": 40`, `"static_rate": 10`, `"static_burst": 20`, `"floor_rate": 0`).stdout
	if strings.Contains(js, "per_window") {
		t.Errorf("window fields for a token bucket:\n%s", js)
	}
}

// etcd that does not answer: the error names the endpoints, says etcd did
// not answer in time and which flag sets the time.
func TestEtcdUnreachableNamesTheEndpoints(t *testing.T) {
	dead := deadURL(t)
	rlctl(t, "--etcd-endpoints", dead, "--timeout", "300ms", "rules", "list").
		must(t, exitFailure, "etcd at "+dead+" (--etcd-endpoints) did not answer within 300ms (--timeout)")
	t.Setenv("APPORTION_TIMEOUT", "200ms")
	rlctl(t, "--etcd-endpoints", dead, "rules", "get", "x").
		must(t, exitFailure, dead, "did not answer within 200ms (--timeout (from APPORTION_TIMEOUT in the environment))")
}

// A rules prefix and a registry prefix of which one holds the other are
// refused, naming both flags and values; identical ones too.
func TestOverlappingPrefixesAreRefused(t *testing.T) {
	f := newFixture(t)
	for _, tc := range []struct{ rules, registry string }{
		{"/ratelimit/", etcdstore.DefaultRegistryPrefix},
		{etcdstore.DefaultPrefix, "/ratelimit/rules/registry/"},
		{"/same/", "/same/"},
	} {
		rlctl(t, "--etcd-endpoints", f.endpoints, "--etcd-prefix", tc.rules, "--registry-prefix", tc.registry, "rules", "list").
			must(t, exitUsage, fmt.Sprintf("--etcd-prefix %q and --registry-prefix %q overlap", tc.rules, tc.registry))
	}
	t.Setenv("APPORTION_ETCD_PREFIX", "/ratelimit/")
	rlctl(t, "--etcd-endpoints", f.endpoints, "rules", "list").
		must(t, exitUsage, `--etcd-prefix (from APPORTION_ETCD_PREFIX in the environment) "/ratelimit/" and --registry-prefix "/ratelimit/registry/" overlap`)
	// Siblings are fine.
	rlctl(t, "--etcd-endpoints", f.endpoints, "--etcd-prefix", "/ratelimit/rules2/", "rules", "list").must(t, exitOK)
}

// An argument that no rule id can be is a usage error naming it and the
// characters allowed, not "not found".
func TestInvalidRuleIDArgument(t *testing.T) {
	f := newFixture(t)
	for name, global := range f.backends() {
		t.Run(name, func(t *testing.T) {
			for _, args := range [][]string{
				{"rules", "get", "a b"},
				{"rules", "shadow", "a b", "on"},
				{"rules", "delete", "a b"},
				{"limits", "show", "a b"},
				{"limits", "set", "a b", "--rate", "1"},
			} {
				rlctl(t, with(global, args...)...).must(t, exitUsage, `invalid rule id: "a b" has character ' '`, "use only the ASCII letters, digits, '_', '.' and '-'")
			}
			rlctl(t, with(global, "rules", "get", "..")...).must(t, exitUsage, `invalid rule id: ".." is not allowed`, "letters, digits")
			rlctl(t, with(global, "rules", "get", "")...).must(t, exitUsage, `invalid rule id "": required`)
			rlctl(t, with(global, "rules", "get", strings.Repeat("x", 129))...).must(t, exitUsage, "over the limit of 128")
			rlctl(t, with(global, "rules", "get", "nope")...).must(t, exitNotFound)
		})
	}
}
