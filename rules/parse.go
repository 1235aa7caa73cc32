package rules

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"
)

// Size limits of documents.
const (
	MaxRuleSize  = 64 << 10 // one rule document (an etcd value, an admin API body, a list item)
	MaxRulesSize = 32 << 20 // a whole rules file
)

// jsonFields are the JSON names of Rule's fields, which are matched exactly
// (encoding/json alone would accept "Capacity" for "capacity").
var jsonFields = func() map[string]bool {
	m := map[string]bool{}
	t := reflect.TypeFor[Rule]()
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		m[name] = true
	}
	return m
}()

// ParseRule decodes one JSON rule document strictly, normalizes and validates
// it. Refused, each with an error naming the field: unknown fields, field
// names in the wrong case, repeated fields, values of the wrong type;
// refused with an error saying so: invalid JSON (with line, column and byte
// offset), data after the document, documents over MaxRuleSize.
func ParseRule(data []byte) (Rule, error) {
	if len(data) > MaxRuleSize {
		return Rule{}, fmt.Errorf("%w: document is %d bytes, over the %d-byte (64 KiB) limit for one rule", ErrInvalid, len(data), MaxRuleSize)
	}
	if err := checkSyntax(data); err != nil {
		return Rule{}, err
	}
	return parseObject(data)
}

// parseObject decodes one syntactically valid JSON value as a rule.
func parseObject(data []byte) (Rule, error) {
	var r Rule
	if err := checkFields(data); err != nil {
		return r, err
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		return Rule{}, decodeError(r.ID, err)
	}
	r.Normalize()
	if err := r.Validate(); err != nil {
		return Rule{}, err
	}
	return r, nil
}

// checkSyntax refuses invalid JSON and trailing data, saying where.
func checkSyntax(data []byte) error {
	if len(bytes.TrimSpace(data)) == 0 {
		return fmt.Errorf("%w: empty document", ErrInvalid)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	var v json.RawMessage
	if err := dec.Decode(&v); err != nil {
		return syntaxError(data, err)
	}
	end := dec.InputOffset()
	if _, err := dec.Token(); err != io.EOF {
		off := end + int64(len(data[end:])-len(bytes.TrimLeft(data[end:], " \t\r\n")))
		line, col := position(data, off)
		return fmt.Errorf("%w: invalid JSON: data after the end of the document at line %d, column %d (byte offset %d)", ErrInvalid, line, col, off)
	}
	return nil
}

func syntaxError(data []byte, err error) error {
	var se *json.SyntaxError
	switch {
	case errors.As(err, &se):
		off := max(se.Offset-1, 0) // Offset counts the byte in error
		line, col := position(data, off)
		return fmt.Errorf("%w: invalid JSON at line %d, column %d (byte offset %d): %w", ErrInvalid, line, col, off, err)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("%w: invalid JSON: unexpected end of input at byte offset %d", ErrInvalid, len(data))
	}
	return fmt.Errorf("%w: invalid JSON: %w", ErrInvalid, err)
}

// position turns a byte offset into a 1-based line and column.
func position(data []byte, off int64) (line, col int) {
	off = min(max(off, 0), int64(len(data)))
	before := data[:off]
	line = bytes.Count(before, []byte("\n")) + 1
	col = int(off) - (bytes.LastIndexByte(before, '\n') + 1) + 1
	return line, col
}

// checkFields walks the top level of a syntactically valid rule object and
// refuses, naming the field: a value that is not an object, unknown or
// wrongly cased field names, repeated fields, and match or regions entries
// that are repeated or of the wrong type.
func checkFields(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	tok, _ := dec.Token()
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return &FieldError{Msg: fmt.Sprintf("a rule must be a JSON object, got %s", jsonKind(tok))}
	}
	id, unknown := "", ""
	obj := map[string]json.RawMessage{}
	for dec.More() {
		kt, _ := dec.Token()
		k, _ := kt.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return syntaxError(data, err)
		}
		if !jsonFields[k] {
			if unknown == "" {
				unknown = k // reported once the id is known
			}
			continue
		}
		if _, dup := obj[k]; dup {
			return &FieldError{RuleID: id, Field: k, Msg: "appears more than once"}
		}
		obj[k] = raw
		if k == "id" {
			_ = json.Unmarshal(raw, &id)
		}
	}
	if unknown != "" {
		msg := "unknown field; known fields: " + strings.Join(slices.Sorted(maps.Keys(jsonFields)), ", ")
		for f := range jsonFields {
			if strings.EqualFold(f, unknown) {
				msg = fmt.Sprintf("unknown field; did you mean %q? (names are case-sensitive)", f)
			}
		}
		return &FieldError{RuleID: id, Field: unknown, Msg: msg}
	}
	for _, name := range []string{"match", "regions"} {
		if raw, ok := obj[name]; ok {
			if err := checkMap(id, name, raw); err != nil {
				return err
			}
		}
	}
	return nil
}

// checkMap checks the entries of the match (string values) or regions
// (number values) object.
func checkMap(id, name string, raw json.RawMessage) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	tok, _ := dec.Token()
	if tok == nil {
		return nil // null
	}
	want := "an object of attribute names to values, e.g. {\"tier\": \"free\"}"
	if name == "regions" {
		want = "an object of region names to weights, e.g. {\"us-east\": 2, \"eu-west\": 1}"
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return &FieldError{RuleID: id, Field: name, Msg: fmt.Sprintf("must be %s, got %s", want, jsonKind(tok))}
	}
	seen := map[string]bool{}
	for dec.More() {
		kt, _ := dec.Token()
		k, _ := kt.(string)
		field := name + "." + k
		if seen[k] {
			return &FieldError{RuleID: id, Field: field, Msg: "appears more than once"}
		}
		seen[k] = true
		vt, _ := dec.Token()
		if d, ok := vt.(json.Delim); ok && (d == '{' || d == '[') {
			return &FieldError{RuleID: id, Field: field, Msg: fmt.Sprintf("must be a %s, got %s", map[string]string{"match": "string", "regions": "number"}[name], jsonKind(vt))}
		}
		switch vt.(type) {
		case string:
			if name == "regions" {
				return &FieldError{RuleID: id, Field: field, Msg: "weight must be a number, got a string"}
			}
		case json.Number:
			if name == "match" {
				return &FieldError{RuleID: id, Field: field, Msg: "must be a string, got a number (quote it)"}
			}
		default:
			return &FieldError{RuleID: id, Field: field, Msg: fmt.Sprintf("must be a %s, got %s", map[string]string{"match": "string", "regions": "number"}[name], jsonKind(vt))}
		}
	}
	return nil
}

func jsonKind(tok json.Token) string {
	switch v := tok.(type) {
	case json.Delim:
		if v == '[' {
			return "a list"
		}
		return "an object"
	case string:
		return "a string"
	case json.Number, float64:
		return "a number"
	case bool:
		return fmt.Sprintf("%v (in YAML, quote yes/no/true/false)", v)
	case nil:
		return "null"
	}
	return fmt.Sprintf("%T", tok)
}

// decodeError turns an error of json.Decoder into a FieldError.
func decodeError(id string, err error) error {
	var te *json.UnmarshalTypeError
	var de *durationError
	switch {
	case errors.As(err, &de):
		return &FieldError{RuleID: id, Field: "window", Msg: de.msg}
	case errors.As(err, &te):
		field := te.Field
		if field == "" {
			return &FieldError{RuleID: id, Msg: fmt.Sprintf("a rule must be a JSON object, got %s", te.Value)}
		}
		want := map[string]string{
			"id": "a string", "algorithm": "a string", "scope": "a string", "failure_mode": "a string", "priority": "a string",
			"capacity": "an integer", "limit": "an integer", "local_batch": "an integer", "split": "an integer",
			"refill_per_second": "a number", "min_share": "a number", "shadow": "true or false",
			"key": "a list of strings, e.g. [\"client_key\"]", "match": "an object of strings", "regions": "an object of numbers",
		}[field]
		if want == "" {
			want = te.Type.String()
		}
		if k := te.Type.Kind(); (k == reflect.Int64 || k == reflect.Int) && strings.HasPrefix(te.Value, "number ") {
			return &FieldError{RuleID: id, Field: field, Msg: fmt.Sprintf("must be an integer within range, written as digits (1000, not 1e3 or 1000.0), got %s", strings.TrimPrefix(te.Value, "number "))}
		}
		if k := te.Type.Kind(); k == reflect.Float64 && strings.HasPrefix(te.Value, "number ") {
			// A JSON number a float64 cannot hold (1e400).
			return &FieldError{RuleID: id, Field: field, Msg: fmt.Sprintf("must be a finite number, got %s (out of range)", strings.TrimPrefix(te.Value, "number "))}
		}
		return &FieldError{RuleID: id, Field: field, Msg: fmt.Sprintf("must be %s, got %s", want, te.Value)}
	}
	const unknown = "json: unknown field "
	if msg := err.Error(); strings.HasPrefix(msg, unknown) {
		name, uerr := strconv.Unquote(strings.TrimPrefix(msg, unknown))
		if uerr != nil {
			name = strings.TrimPrefix(msg, unknown)
		}
		return &FieldError{RuleID: id, Field: name, Msg: "unknown field"}
	}
	return fmt.Errorf("%w: %w", ErrInvalid, err)
}

// ParseRules decodes a JSON or YAML list of rule documents (or an object
// {"rules": [...]}), normalizes and validates every rule, and refuses
// duplicate ids. A document whose first non-blank character is '[' or '{' is
// JSON; anything else is YAML, converted to JSON first so that both formats
// meet the same strict checks. A YAML stream of several documents is refused. An error names the item (1-based), the rule id when
// known, and the field. An empty document is refused (a half-written file
// must not remove every limit); an empty list is a valid, empty rule set.
func ParseRules(data []byte) ([]Rule, error) {
	if len(data) > MaxRulesSize {
		return nil, fmt.Errorf("%w: rules document is %d bytes, over the %d-byte (32 MiB) limit", ErrInvalid, len(data), MaxRulesSize)
	}
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) == 0 {
		return nil, fmt.Errorf("%w: empty rules document; write [] for an empty rule set", ErrInvalid)
	}
	js := data
	if c := trimmed[0]; c == '[' || c == '{' {
		// JSON; strictly, though YAML flow style would accept more.
		if err := checkSyntax(data); err != nil {
			return nil, err
		}
	} else {
		conv, err := YAMLToJSON(data)
		if err != nil {
			return nil, err
		}
		js = conv
	}

	items, err := splitList(js)
	if err != nil {
		return nil, err
	}
	out := make([]Rule, 0, len(items))
	byID := make(map[string]int, len(items))
	for i, raw := range items {
		item := i + 1
		if len(raw) > MaxRuleSize {
			return nil, &FieldError{Item: item, Msg: fmt.Sprintf("rule document is %d bytes, over the %d-byte (64 KiB) limit", len(raw), MaxRuleSize)}
		}
		r, err := parseObject(raw)
		if err != nil {
			var fe *FieldError
			if errors.As(err, &fe) {
				fe.Item = item
				if fe.RuleID == "" {
					var probe struct {
						ID string `json:"id"`
					}
					if json.Unmarshal(raw, &probe) == nil && checkName(probe.ID, MaxIDLen) == "" {
						fe.RuleID = probe.ID
					}
				}
				return nil, err
			}
			return nil, fmt.Errorf("item %d: %w", item, err)
		}
		if prev, dup := byID[r.ID]; dup {
			return nil, &FieldError{RuleID: r.ID, Item: item, Field: "id", Msg: fmt.Sprintf("duplicate id, also used by item %d", prev)}
		}
		byID[r.ID] = item
		out = append(out, r)
	}
	return out, nil
}

// splitList returns the items of a JSON list, or of the list under "rules".
func splitList(js []byte) ([]json.RawMessage, error) {
	trimmed := bytes.TrimSpace(js)
	if len(trimmed) > 0 && trimmed[0] == '{' {
		var wrapper map[string]json.RawMessage
		if err := json.Unmarshal(trimmed, &wrapper); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		if _, ok := wrapper["rules"]; !ok {
			if _, isRule := wrapper["id"]; isRule {
				return nil, &FieldError{Msg: "expected a list of rules, got a single rule; write it as a list ([{...}] or \"- id: ...\") or under \"rules\""}
			}
		}
		for k := range wrapper {
			if k != "rules" {
				return nil, &FieldError{Field: k, Msg: "unknown field; a rules document is a list of rules, or an object with only \"rules\""}
			}
		}
		if err := checkNoDuplicateKeys(trimmed); err != nil {
			return nil, err
		}
		trimmed = bytes.TrimSpace(wrapper["rules"])
	}
	if len(trimmed) == 0 || trimmed[0] != '[' {
		return nil, &FieldError{Field: "rules", Msg: "must be a list of rule documents"}
	}
	var items []json.RawMessage
	if err := json.Unmarshal(trimmed, &items); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return items, nil
}

func checkNoDuplicateKeys(obj []byte) error {
	dec := json.NewDecoder(bytes.NewReader(obj))
	dec.Token()
	seen := map[string]bool{}
	for dec.More() {
		kt, _ := dec.Token()
		k, _ := kt.(string)
		if seen[k] {
			return &FieldError{Field: k, Msg: "appears more than once"}
		}
		seen[k] = true
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return fmt.Errorf("%w: %w", ErrInvalid, err)
		}
	}
	return nil
}

// YAMLToJSON converts one YAML document to JSON with the checks ParseRules
// makes of YAML before its own: a stream of several documents ("---") and
// repeated keys are refused (errors wrap ErrInvalid), where a plain
// conversion would keep the first document and the last of a key's values.
func YAMLToJSON(data []byte) ([]byte, error) {
	if err := checkSingleYAMLDoc(data); err != nil {
		return nil, err
	}
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return nil, fmt.Errorf("%w: invalid YAML: %w", ErrInvalid, err)
	}
	return js, nil
}

// checkSingleYAMLDoc refuses a YAML stream of several documents ("---"
// separators): the converter would read the first and silently drop the rest.
func checkSingleYAMLDoc(data []byte) error {
	content, ended := false, false
	for n, line := range strings.Split(string(data), "\n") {
		line = strings.TrimRight(line, "\r")
		rest := ""
		switch {
		case line == "...":
			ended = ended || content
			continue
		case line == "---" || strings.HasPrefix(line, "--- ") || strings.HasPrefix(line, "---\t"):
			ended = ended || content
			rest = strings.TrimSpace(line[3:])
		default:
			rest = strings.TrimSpace(line)
			if strings.HasPrefix(line, "%") {
				rest = "" // a directive
			}
		}
		if rest == "" || strings.HasPrefix(rest, "#") {
			continue
		}
		if ended {
			return fmt.Errorf("%w: line %d: several YAML documents (separated by \"---\"); put all rules in one list", ErrInvalid, n+1)
		}
		content = true
	}
	return nil
}

// MarshalRule normalizes and validates r and returns its canonical JSON:
// fields in a fixed order, map keys sorted, zero values left out, windows in
// their shortest form. ParseRule(MarshalRule(r)) gives back the normalized r.
func MarshalRule(r Rule) ([]byte, error) {
	r = r.Clone()
	r.Normalize()
	if err := r.Validate(); err != nil {
		return nil, err
	}
	return json.Marshal(r)
}

// LoadFile reads and parses a rules file (JSON or YAML, see ParseRules).
func LoadFile(path string) ([]Rule, error) {
	data, err := readLimited(path)
	if err != nil {
		return nil, err
	}
	rs, err := ParseRules(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return rs, nil
}

func readLimited(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("rules: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxRulesSize+1))
	if err != nil {
		return nil, fmt.Errorf("rules: %s: %w", path, err)
	}
	return data, nil
}
