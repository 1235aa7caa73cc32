package envoy

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/envoyconfig"
)

// envoyData reads a configuration of envoyproxy/ratelimit (see
// rules/envoyconfig/testdata/envoyproxy/README.md).
func envoyData(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "rules", "envoyconfig", "testdata", "envoyproxy", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// exampleWithoutQuota is envoyproxy/ratelimit's example configuration
// without its two quota_mode descriptors (the last ones), which the import
// refuses.
func exampleWithoutQuota(t testing.TB) []byte {
	t.Helper()
	b := envoyData(t, "examples_example.yaml")
	i := strings.Index(string(b), "  - key: service\n")
	if i < 0 {
		t.Fatal("examples_example.yaml: no service descriptor")
	}
	return b[:i]
}

func importRules(t testing.TB, files ...[]byte) []rules.Rule {
	t.Helper()
	var out []rules.Rule
	for _, f := range files {
		rs, err := envoyconfig.Convert(f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, rs...)
	}
	return out
}

func treesOf(t *testing.T, rs []rules.Rule) *trees {
	t.Helper()
	ix, err := rules.NewIndex(rs)
	if err != nil {
		t.Fatal(err)
	}
	return buildTrees(ix)
}

func entries(kv ...string) []envoyconfig.Entry {
	var out []envoyconfig.Entry
	for i := 0; i+1 < len(kv); i += 2 {
		out = append(out, envoyconfig.Entry{Key: kv[i], Value: kv[i+1]})
	}
	return out
}

// TestResolveAsEnvoy resolves the descriptors of envoyproxy/ratelimit's
// configuration tests (test/config/config_test.go: TestBasicConfig,
// TestWildcardConfig) against the imported rules, with the limits its tests
// expect (nil there: no node here).
func TestResolveAsEnvoy(t *testing.T) {
	tr := treesOf(t, importRules(t, envoyData(t, "test_config_basic_config.yaml")))
	wild := treesOf(t, importRules(t, envoyData(t, "test_config_wildcard.yaml")))
	mongo := treesOf(t, importRules(t, envoyData(t, "examples_config.yaml"), envoyData(t, "integration_reload.yaml")))
	type want struct {
		kind   nodeKind // kindNone: no node
		limit  int64
		window time.Duration
		name   string
	}
	tests := []struct {
		tr      *trees
		domain  string
		entries []envoyconfig.Entry
		want    want
	}{
		{tr, "foo_domain", nil, want{}},
		{tr, "test-domain", nil, want{}},
		{tr, "test-domain", entries("key1", "something"), want{}},
		{tr, "test-domain", entries("key1", "value1"), want{}},
		{tr, "test-domain", entries("key2", "value2", "subkey", "subvalue"), want{}},
		{tr, "test-domain", entries("key5", "value5", "subkey5", "subvalue"), want{}},
		{tr, "test-domain", entries("key1", "value1", "subkey1", "something"), want{kindBucket, 5, time.Second, ""}},
		{tr, "test-domain", entries("key1", "value1", "subkey1", "subvalue1"), want{kindBucket, 10, time.Second, ""}},
		{tr, "test-domain", entries("key2", "something"), want{kindBucket, 20, time.Minute, ""}},
		{tr, "test-domain", entries("key2", "value2"), want{kindBucket, 30, time.Minute, ""}},
		{tr, "test-domain", entries("key2", "value3"), want{}}, // listed without a limit: no fallback to key2
		{tr, "test-domain", entries("key3", "foo"), want{kindBucket, 1, time.Hour, ""}},
		{tr, "test-domain", entries("key4", "foo"), want{kindBucket, 1, 24 * time.Hour, "key4_rate_limit"}},
		{tr, "test-domain", entries("key6", "foo"), want{kindUnlimited, 1, time.Second, ""}},
		{tr, "test-domain", entries("key7", "unspecified_value"), want{kindBucket, 70, time.Minute, ""}},
		{tr, "test-domain", entries("key5", "value5", "subkey5", "subvalue5"), want{kindBucket, 25, 24 * time.Hour, ""}},
		{tr, "test-domain", entries("key5", "value5"), want{kindBucket, 15, 24 * time.Hour, ""}},
		{wild, "test-domain", entries("noVal", "foo1"), want{kindBucket, 20, time.Minute, ""}},
		{wild, "test-domain", entries("wild", "foo1"), want{kindBucket, 20, time.Minute, ""}},
		{wild, "test-domain", entries("wild", "foo"), want{kindBucket, 20, time.Minute, ""}},
		{wild, "test-domain", entries("nestedWild", "val1", "wild", "goo2"), want{kindBucket, 20, time.Minute, ""}},
		{wild, "test-domain", entries("wild", "bar"), want{}},
		{wild, "test-domain", entries("noWild", "foo1"), want{}},
		{wild, "test-domain", entries("midWild", "barab"), want{kindBucket, 20, time.Minute, ""}},
		{wild, "test-domain", entries("midWild", "bar123b"), want{kindBucket, 20, time.Minute, ""}},
		{wild, "test-domain", entries("midWild", "barb"), want{kindBucket, 20, time.Minute, ""}},
		{wild, "test-domain", entries("midWild", "bara"), want{}},
		{wild, "test-domain", entries("midWild", "xbarb"), want{}},
		{wild, "test-domain", entries("multiWild", "foo123bar456baz"), want{kindBucket, 10, time.Minute, ""}},
		{wild, "test-domain", entries("multiWild", "foobarbaz"), want{kindBucket, 10, time.Minute, ""}},
		{wild, "test-domain", entries("multiWild", "foo123baz"), want{}},
		{wild, "test-domain", entries("multiWild", "bar456baz"), want{}},
		// examples/ratelimit/config/config.yaml and the integration test's reload.yaml
		{mongo, "mongo_cps", entries("database", "users"), want{kindBucket, 500, time.Second, ""}},
		{mongo, "mongo_cps", entries("database", "default"), want{kindBucket, 500, time.Second, ""}},
		{mongo, "mongo_cps", entries("database", "other"), want{}},
		{mongo, "reload", entries("key1", "foo"), want{kindBucket, 50, time.Second, ""}},
		{mongo, "reload", entries("block", "foo"), want{kindZero, 1, time.Second, ""}},
		{mongo, "reload", entries("one_per_minute", "foo"), want{kindBucket, 1, time.Minute, ""}},
	}
	for _, tc := range tests {
		n := tc.tr.resolve(tc.domain, tc.entries)
		var got want
		if n != nil {
			got = want{n.kind, n.rule.Limit, time.Duration(n.rule.Window), n.name}
		}
		if got != tc.want {
			t.Errorf("%s %v: got %+v, want %+v", tc.domain, tc.entries, got, tc.want)
		}
	}
}

func TestResolveExample(t *testing.T) {
	tr := treesOf(t, importRules(t, exampleWithoutQuota(t)))
	tests := []struct {
		entries  []envoyconfig.Entry
		id, name string
		replaces []string
		kind     nodeKind
	}{
		{entries("foo", "x"), "rl.foo", "", nil, kindBucket},
		{entries("foo", "x", "bar", "bkthomps"), "rl.foo.bar_bkthomps", "bkthomps", nil, kindBucket},
		{entries("foo", "x", "bar", "banned"), "rl.foo.bar_banned", "banned_limit", nil, kindZero},
		{entries("foo", "x", "bar", "other"), "rl.foo.bar", "", nil, kindBucket},
		{entries("foo", "x", "bay", "y"), "rl.foo.bay", "", nil, kindUnlimited},
		{entries("source_cluster", "proxy", "destination_cluster", "override"), "rl.source_cluster_proxy.destination_cluster_override", "", []string{"banned_limit"}, kindBucket},
		{entries("category", "account"), "rl.category_account", "", []string{"bkthomps", "fake_name"}, kindBucket},
		{entries("qux", "q"), "rl.qux", "", nil, kindUnlimited},
	}
	for _, tc := range tests {
		n := tr.resolve("rl", tc.entries)
		if n == nil {
			t.Errorf("%v: no node, want %s", tc.entries, tc.id)
			continue
		}
		if n.rule.ID != tc.id || n.name != tc.name || strings.Join(n.replaces, ",") != strings.Join(tc.replaces, ",") || n.kind != tc.kind {
			t.Errorf("%v: %s name %q replaces %v kind %v, want %s %q %v %v", tc.entries, n.rule.ID, n.name, n.replaces, n.kind, tc.id, tc.name, tc.replaces, tc.kind)
		}
	}
	if n := tr.resolve("rl", entries("source_cluster", "proxy", "destination_cluster", "not_bkthomps")); n != nil {
		t.Errorf("unknown destination: %s, want no node", n.rule.ID)
	}
}
