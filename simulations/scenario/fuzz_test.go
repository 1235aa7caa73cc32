package scenario

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
)

// FuzzParse: the scenario parser never panics; a refusal wraps ErrInvalid,
// names the file, says what is wrong and gives a line that is in the file;
// an accepted scenario is valid, and parsing is deterministic. (No encoder
// exists: a parsed scenario has its defaults filled in, so it is not written
// back.)
func FuzzParse(f *testing.F) {
	f.Add([]byte(good))
	f.Fuzz(func(t *testing.T, data []byte) {
		sc, err := Parse("f.yaml", data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %q does not wrap ErrInvalid", err)
			}
			if !strings.HasPrefix(err.Error(), "scenario: f.yaml: ") {
				t.Fatalf("error %q does not name the file", err)
			}
			var e *Error
			if errors.As(err, &e) {
				if strings.TrimSpace(e.Msg) == "" {
					t.Fatalf("error %q says nothing", err)
				}
				if lines := yamlLines(data); e.Line < 0 || e.Line > lines {
					t.Fatalf("error %q: line %d of a %d-line file", err, e.Line, lines)
				}
			}
			return
		}
		if err := sc.Validate(); err != nil {
			t.Fatalf("accepted scenario is not valid: %v", err)
		}
		again, err := Parse("f.yaml", data)
		if err != nil || !reflect.DeepEqual(again, sc) {
			t.Fatalf("second parse differs: %v", err)
		}
	})
}

// yamlLines counts data's lines as YAML does: "\r\n", "\r" and "\n" each
// end one.
func yamlLines(data []byte) int {
	d := bytes.ReplaceAll(data, []byte("\r\n"), []byte("\n"))
	return bytes.Count(d, []byte("\n")) + bytes.Count(d, []byte("\r")) + 1
}
