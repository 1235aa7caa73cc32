package rules

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// checkParseError asserts what every refusal of the parser promises: it
// wraps ErrInvalid, says it comes from rules, and a FieldError's message
// names its field.
func checkParseError(t *testing.T, err error) {
	t.Helper()
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("error %q does not wrap ErrInvalid", err)
	}
	if !strings.Contains(err.Error(), "rules: ") {
		t.Fatalf("error %q does not say it is about rules", err)
	}
	var fe *FieldError
	if errors.As(err, &fe) && fe.Field != "" && !strings.Contains(err.Error(), fe.Field) {
		t.Fatalf("error %q does not name its field %q", err, fe.Field)
	}
}

// checkCanonical asserts that a parsed rule is valid and survives its
// canonical encoding: MarshalRule then ParseRule gives it back, and
// encoding again gives the same bytes.
func checkCanonical(t *testing.T, r Rule) {
	t.Helper()
	if err := r.Validate(); err != nil {
		t.Fatalf("parsed rule %+v is not valid: %v", r, err)
	}
	b, err := MarshalRule(r)
	if err != nil {
		t.Fatalf("parsed rule %+v does not encode: %v", r, err)
	}
	back, err := ParseRule(b)
	if err != nil {
		t.Fatalf("canonical form %s of a parsed rule is refused: %v", b, err)
	}
	if !reflect.DeepEqual(back, r) {
		t.Fatalf("round trip through %s:\n got %+v\nwant %+v", b, back, r)
	}
	if again, _ := MarshalRule(back); string(again) != string(b) {
		t.Fatalf("canonical form is not stable:\n%s\n%s", b, again)
	}
}

// FuzzParseRule: one rule document (an etcd value, an admin API body).
func FuzzParseRule(f *testing.F) {
	f.Add([]byte(exampleRule))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := ParseRule(data)
		if err != nil {
			checkParseError(t, err)
			return
		}
		checkCanonical(t, r)
	})
}

// FuzzParseRules: a rules file, JSON or YAML. What it accepts, written back
// as a JSON list and as YAML, parses to the same rules.
func FuzzParseRules(f *testing.F) {
	f.Add([]byte(yamlRules))
	f.Add([]byte("[" + exampleRule + "]"))
	f.Fuzz(func(t *testing.T, data []byte) {
		rs, err := ParseRules(data)
		if err != nil {
			checkParseError(t, err)
			return
		}
		ids := map[string]bool{}
		for _, r := range rs {
			if ids[r.ID] {
				t.Fatalf("duplicate id %q accepted", r.ID)
			}
			ids[r.ID] = true
			checkCanonical(t, r)
		}
		js, err := json.Marshal(rs)
		if err != nil {
			t.Fatal(err)
		}
		back, err := ParseRules(js)
		if err != nil {
			t.Fatalf("rules written back as JSON %s are refused: %v", js, err)
		}
		if len(rs) == 0 && len(back) == 0 {
			return
		}
		if !reflect.DeepEqual(back, rs) {
			t.Fatalf("JSON round trip:\n got %+v\nwant %+v", back, rs)
		}
		ym, err := yaml.JSONToYAML(js)
		if err != nil {
			t.Fatal(err)
		}
		if back, err = ParseRules(ym); err != nil {
			t.Fatalf("rules written back as YAML:\n%s\nare refused: %v", ym, err)
		}
		if !reflect.DeepEqual(back, rs) {
			t.Fatalf("YAML round trip:\n got %+v\nwant %+v", back, rs)
		}
	})
}
