package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/envoyconfig"
)

func envoyFile(name string) string {
	return filepath.Join("..", "..", "rules", "envoyconfig", "testdata", "envoyproxy", name)
}

func TestImportEnvoy(t *testing.T) {
	basic, another := envoyFile("integration_basic.yaml"), envoyFile("integration_another.yaml")
	var want []rules.Rule
	for _, f := range []string{basic, another} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		rs, err := envoyconfig.Convert(b)
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, rs...)
	}
	for _, output := range []string{"table", "json"} {
		t.Run("-o "+output, func(t *testing.T) {
			var out, errOut bytes.Buffer
			if err := run(context.Background(), []string{"-o", output, "import", "envoy", basic, another}, &out, &errOut); err != nil {
				t.Fatalf("%v (%s)", err, errOut.String())
			}
			got, err := rules.ParseRules(out.Bytes()) // what rules put -f and ratelimitd --rules read
			if err != nil {
				t.Fatalf("output does not parse as rules: %v\n%s", err, out.String())
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("rules %v, want %v", got, want)
			}
		})
	}

	path := filepath.Join(t.TempDir(), "rules.yaml")
	var out bytes.Buffer
	if err := run(context.Background(), []string{"import", "envoy", "--write", path, basic}, &out, &out); err != nil {
		t.Fatal(err)
	}
	if rs, err := rules.LoadFile(path); err != nil || len(rs) != 3 || !strings.Contains(out.String(), "wrote "+path) {
		t.Errorf("--write: %d rules, %v; output %q", len(rs), err, out.String())
	}

	out.Reset()
	if err := run(context.Background(), []string{"import", "envoy", "--ignore-metadata", envoyFile("examples_example.yaml")}, &out, &out); err != nil {
		t.Fatalf("--ignore-metadata: %v", err)
	}
	if rs, err := rules.ParseRules(out.Bytes()); err != nil || len(rs) != 17 {
		t.Errorf("--ignore-metadata: %d rules, %v", len(rs), err)
	}

	tests := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"no file", []string{"import", "envoy"}, exitUsage, "give one or more"},
		{"refused", []string{"import", "envoy", envoyFile("test_config_bad_limit_unit.yaml")}, exitFailure,
			"test_config_bad_limit_unit.yaml: envoyconfig: line 6: descriptors[0].rate_limit.unit: invalid rate limit unit 'foo'"},
		{"same domain twice", []string{"import", "envoy", basic, basic}, exitFailure, `rule "basic.key1" also comes from`},
		{"missing file", []string{"import", "envoy", "nope.yaml"}, exitFailure, "nope.yaml"},
		{"metadata", []string{"import", "envoy", envoyFile("examples_example.yaml")}, exitFailure, "descriptors[5].metadata: not supported"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			err := run(context.Background(), tc.args, &out, &out)
			if exitCode(err) != tc.code || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v (exit %d), want exit %d and %q", err, exitCode(err), tc.code, tc.want)
			}
			if tc.code == exitFailure && out.Len() != 0 {
				t.Errorf("wrote %q on failure", out.String())
			}
		})
	}
}
