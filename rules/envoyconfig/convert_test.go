package envoyconfig

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
)

func load(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "envoyproxy", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRefusedAsEnvoyRefuses converts the configurations envoyproxy/ratelimit's
// own tests expect it to refuse (test/config/config_test.go), and a few more:
// each is refused with an error that names the field and its line.
func TestRefusedAsEnvoyRefuses(t *testing.T) {
	tests := []struct {
		file string
		want []string // in the message; envoyproxy/ratelimit's own wording where it has one
	}{
		{"test_config_empty_domain.yaml", []string{"domain: required (config file cannot have empty domain)"}},
		{"test_config_empty_key.yaml", []string{"line 3: descriptors[0].key: required (descriptor has empty key)"}},
		{"test_config_duplicate_key.yaml", []string{"line 6: descriptors[1]: duplicate descriptor composite key 'test-domain.key1_value1' (also descriptors[0])"}},
		{"test_config_bad_limit_unit.yaml", []string{"line 6: descriptors[0].rate_limit.unit: invalid rate limit unit 'foo'; use second, minute"}},
		{"test_config_replaces_self.yaml", []string{"descriptors[0].descriptors[0].rate_limit.replaces[0].name: replaces should not contain name of same descriptor"}},
		{"test_config_replaces_empty.yaml", []string{"descriptors[0].descriptors[0].rate_limit.replaces[0].name: should not have an empty replaces entry"}},
		{"test_config_bad_yaml.yaml", []string{"invalid YAML"}},
		{"test_config_misspelled_key.yaml", []string{"line 5: descriptors[0].ratelimit: unknown field; did you mean \"rate_limit\"?"}},
		{"test_config_misspelled_key2.yaml", []string{"line 7: descriptors[0].rate_limit.requestsperunit: unknown field; did you mean \"requests_per_unit\"?"}},
		{"test_config_non_string_key.yaml", []string{"line 1: key 0.25 is not a string"}},
		{"test_config_non_map_list.yaml", []string{"line 3: descriptors[0]: must be a mapping (a descriptor), got str \"a\""}},
		{"test_config_unlimited_with_unit.yaml", []string{"line 6: descriptors[0].rate_limit.unit: should not specify rate limit unit when unlimited"}},
		// Accepted by envoyproxy/ratelimit, but not reproducible here: refused, naming the field.
		{"examples_example.yaml", []string{"line 94: descriptors[5].metadata: not supported by the import", "--ignore-metadata"}},
	}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			_, err := Convert(load(t, tc.file))
			if err == nil {
				t.Fatal("accepted")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("%v does not match ErrInvalid", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestRefusedInline(t *testing.T) {
	tests := []struct{ name, yaml, want string }{
		{"empty file", "", "empty configuration"},
		{"a list", "- a\n", "must be a mapping (a configuration file), got a list"},
		{"unknown top-level field", "domain: d\ndescriptor: []\n", "line 2: descriptor: unknown field; did you mean \"descriptors\"?"},
		{"unit outside rate_limit", "domain: d\ndescriptors:\n- key: k\n  unit: second\n", "descriptors[0].unit: unknown field here; \"unit\" belongs under rate_limit"},
		{"negative requests_per_unit", "domain: d\ndescriptors:\n- key: k\n  rate_limit: {unit: second, requests_per_unit: -1}\n", "descriptors[0].rate_limit.requests_per_unit: must be a whole number from 0 to 4294967295, got int \"-1\""},
		{"quoted requests_per_unit", "domain: d\ndescriptors:\n- key: k\n  rate_limit: {unit: second, requests_per_unit: \"5\"}\n", "got str \"5\""},
		{"no unit", "domain: d\ndescriptors:\n- key: k\n  rate_limit: {requests_per_unit: 5}\n", "descriptors[0].rate_limit.unit: required"},
		{"shadow_mode not a boolean", "domain: d\ndescriptors:\n- key: k\n  shadow_mode: maybe\n", "descriptors[0].shadow_mode: must be true or false"},
		{"repeated field", "domain: d\ndomain: e\n", "line 2: domain: appears more than once"},
		{"domain with a star", "domain: \"a*\"\n", "domain: \"a*\" contains \"*\""},
		{"two documents", "domain: a\n---\ndomain: b\n", "several YAML documents"},
		{"share_threshold without a wildcard", "domain: d\ndescriptors:\n- key: k\n  value: a\n  share_threshold: true\n  rate_limit: {unit: second, requests_per_unit: 1}\n",
			"descriptors[0].share_threshold: share_threshold can only be used with wildcard values (containing '*'), but found key 'k_a'"},
		{"metadata", "domain: d\ndescriptors:\n- key: k\n  metadata: {a: b}\n", "descriptors[0].metadata: not supported"},
		{"descriptors not a list", "domain: d\ndescriptors: {key: k}\n", "descriptors: must be a list of descriptors, got a mapping"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Convert([]byte(tc.yaml))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestConvertBasicConfig(t *testing.T) {
	rs, err := Convert(load(t, "test_config_basic_config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	type want struct {
		node, limitKind, name string
		limit                 int64
		window                time.Duration
	}
	wants := map[string]want{
		"test-domain.key1_value1.subkey1":           {"key1=value1|subkey1", "", "", 5, time.Second},
		"test-domain.key1_value1.subkey1_subvalue1": {"key1=value1|subkey1=subvalue1", "", "", 10, time.Second},
		"test-domain.key2":                          {"key2", "", "", 20, time.Minute},
		"test-domain.key2_value2":                   {"key2=value2", "", "", 30, time.Minute},
		"test-domain.key2_value3":                   {"key2=value3", LimitNone, "", 1, time.Second},
		"test-domain.key3":                          {"key3", "", "", 1, time.Hour},
		"test-domain.key4":                          {"key4", "", "key4_rate_limit", 1, 24 * time.Hour},
		"test-domain.key5_value5":                   {"key5=value5", "", "", 15, 24 * time.Hour},
		"test-domain.key5_value5.subkey5_subvalue5": {"key5=value5|subkey5=subvalue5", "", "", 25, 24 * time.Hour},
		"test-domain.key6":                          {"key6", LimitUnlimited, "", 1, time.Second},
		"test-domain.key7":                          {"key7", "", "", 70, time.Minute},
	}
	if len(rs) != len(wants) {
		t.Errorf("%d rules, want %d", len(rs), len(wants))
	}
	for _, r := range rs {
		w, ok := wants[r.ID]
		if !ok {
			t.Errorf("unexpected rule %q", r.ID)
			continue
		}
		if r.Match[AttrDomain] != "test-domain" || r.Match[AttrNode] != w.node || r.Match[AttrLimit] != w.limitKind || r.Match[AttrName] != w.name {
			t.Errorf("%s: match %v, want node %q, envoy.limit %q, envoy.name %q", r.ID, r.Match, w.node, w.limitKind, w.name)
		}
		if r.Algorithm != rules.FixedWindow || r.Limit != w.limit || time.Duration(r.Window) != w.window || !reflect.DeepEqual(r.Key, []string{AttrDescriptor}) {
			t.Errorf("%s: %s %d per %v key %v, want fixed_window %d per %v keyed by %s", r.ID, r.Algorithm, r.Limit, time.Duration(r.Window), r.Key, w.limit, w.window, AttrDescriptor)
		}
		if err := r.Validate(); err != nil {
			t.Errorf("%s: %v", r.ID, err)
		}
	}
	// The rules are a valid rule set, and survive a round trip through the rules format.
	if _, err := rules.NewIndex(rs); err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		b, err := rules.MarshalRule(r)
		if err != nil {
			t.Fatal(err)
		}
		back, err := rules.ParseRule(b)
		if err != nil || !reflect.DeepEqual(back, r) {
			t.Errorf("%s: round trip: %v %v", r.ID, back, err)
		}
	}
}

func TestConvertExampleIgnoringMetadata(t *testing.T) {
	rs, err := Convert(load(t, "examples_example.yaml"), IgnoreMetadata())
	if err != nil {
		t.Fatal(err)
	}
	quota := map[string]string{}
	for _, r := range rs {
		quota[r.ID] = r.Match[AttrQuota]
	}
	if quota["rl.service_service_1"] != "true" || quota["rl.service_service_2"] != "true" || quota["rl.foo"] != "" || len(rs) != 17 {
		t.Errorf("%d rules, quota marks %v", len(rs), quota)
	}
}

func TestConvertShareThreshold(t *testing.T) {
	rs, err := Convert(load(t, "test_config_share_threshold.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	share := map[string]string{}
	for _, r := range rs {
		share[r.Match[AttrNode]] = r.Match[AttrShare]
	}
	want := map[string]string{
		"files=files/%2A":                       "0",
		"nested=parent|files=nested/%2A":        "1",
		"files=top/%2A|files=nested/%2A":        "0,1",
		"path=path/%2A|file=file/%2A|type":      "0",
		"user=user/%2A|resource=res/%2A|action": "0,1",
		"file=test1":                            "",
		"tenant=t%2Aprod|resource=res%2Av2":     "0,1",
	}
	for node, w := range want {
		if got, ok := share[node]; !ok || got != w {
			t.Errorf("%s: envoy.share %q (present %v), want %q", node, got, ok, w)
		}
	}
}

func TestConvertShadowReplacesWildcard(t *testing.T) {
	rs, err := Convert(load(t, "test_config_shadowmode_config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	shadow := map[string]bool{}
	for _, r := range rs {
		shadow[r.ID] = r.Shadow
	}
	if !shadow["test-domain.key1_value1.subkey1_subvalue1"] || !shadow["test-domain.key2"] || shadow["test-domain.key2_value2"] || shadow["test-domain.key1_value1.subkey1"] {
		t.Errorf("shadow flags %v", shadow)
	}

	rs, err = Convert(load(t, "test_config_wildcard.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	nodes := map[string]string{}
	for _, r := range rs {
		nodes[r.ID] = r.Match[AttrNode]
	}
	if nodes["test-domain.wild_foo-"] != "wild=foo%2A" || nodes["test-domain.multiWild_foo-bar-baz"] != "multiWild=foo%2Abar%2Abaz" || nodes["test-domain.nestedWild_val1.wild_goo-"] != "nestedWild=val1|wild=goo%2A" {
		t.Errorf("wildcard nodes %v", nodes)
	}

	rs, err = Convert([]byte(`domain: rl
descriptors:
  - key: category
    value: account
    rate_limit:
      replaces: [{name: bkthomps}, {name: "fake|name"}]
      unit: minute
      requests_per_unit: 4
  - key: banned
    rate_limit: {name: banned_limit, unit: Minute, requests_per_unit: 0}
`))
	if err != nil {
		t.Fatal(err)
	}
	if m := rs[0].Match; m[AttrReplaces] != "bkthomps|fake%7Cname" || m[AttrName] != "" {
		t.Errorf("replaces: %v", m)
	}
	if m := rs[1].Match; m[AttrName] != "banned_limit" || m[AttrLimit] != LimitZero || time.Duration(rs[1].Window) != time.Minute {
		t.Errorf("zero limit: %v %v", m, rs[1].Window)
	}
}

func TestPaths(t *testing.T) {
	path := []Entry{{"source_cluster", "proxy"}, {"destination|cluster", "a=b*%c"}, {"key_only", ""}}
	s := NodePath(path)
	if s != "source_cluster=proxy|destination%7Ccluster=a%3Db%2A%25c|key_only" {
		t.Errorf("NodePath = %q", s)
	}
	back, err := ParseNodePath(s)
	if err != nil || !reflect.DeepEqual(back, path) {
		t.Errorf("ParseNodePath = %v, %v", back, err)
	}
	for _, bad := range []string{"", "a|", "a=%zz", "a=%2"} {
		if _, err := ParseNodePath(bad); err == nil {
			t.Errorf("ParseNodePath(%q) accepted", bad)
		}
	}
	if id := Identity([]Entry{{"key1", "foo"}}, 256); id != "key1=foo" {
		t.Errorf("Identity = %q", id)
	}
	if id := Identity([]Entry{{"k", ""}, {"source_cluster", "proxy"}}, 256); id != "k=|source_cluster=proxy" {
		t.Errorf("Identity = %q", id)
	}
	long := Identity([]Entry{{"k", strings.Repeat("v", 300)}}, 256)
	if !strings.HasPrefix(long, "sha256:") || len(long) != 71 {
		t.Errorf("long identity %q", long)
	}
}
