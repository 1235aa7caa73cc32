package envoyconfig

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// FuzzConvert: a configuration file is operator input that may come from
// anywhere (an imported repository, an admin API upload). Convert never
// panics; it refuses with an error that wraps ErrInvalid, or returns rules
// that each validate, with distinct ids, and the same rules for the same
// bytes.
func FuzzConvert(f *testing.F) {
	files, _ := filepath.Glob("testdata/envoyproxy/*.yaml")
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte("domain: d\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {unit: second, requests_per_unit: 5}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		rs, err := Convert(data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) || err.Error() == "" {
				t.Fatalf("error %v (%T) does not wrap ErrInvalid", err, err)
			}
			return
		}
		ids := map[string]bool{}
		for i := range rs {
			r := rs[i]
			if err := r.Validate(); err != nil {
				t.Fatalf("rule %d (%s) does not validate: %v", i, r.ID, err)
			}
			if ids[r.ID] {
				t.Fatalf("rule id %q twice", r.ID)
			}
			ids[r.ID] = true
		}
		again, err := Convert(data)
		if err != nil || !reflect.DeepEqual(rs, again) {
			t.Fatalf("a second conversion differs: %v", err)
		}
	})
}

// FuzzNodePath: node paths are read back from rules (etcd documents).
// ParseNodePath never panics, and what it accepts writes back (NodePath)
// to a path that parses to the same entries; Escape is reversed by
// Unescape for any string.
func FuzzNodePath(f *testing.F) {
	for _, s := range []string{"source_cluster=proxy|destination_cluster=mock", "foo|bar=banned", "k=%7C%3D%25%2A", "%", "a=%zz", "|", "=v"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if u, err := Unescape(Escape(s)); err != nil || u != s {
			t.Fatalf("Unescape(Escape(%q)) = %q, %v", s, u, err)
		}
		es, err := ParseNodePath(s)
		if err != nil {
			return
		}
		back, err := ParseNodePath(NodePath(es))
		if err != nil || !reflect.DeepEqual(es, back) {
			t.Fatalf("%q parses to %v, written back %q parses to %v, %v", s, es, NodePath(es), back, err)
		}
	})
}
