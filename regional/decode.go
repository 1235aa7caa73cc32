package regional

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"
)

// checkFields are the JSON names of Request's fields.
var checkFields = []string{"client_key", "resource", "cost", "attributes"}

// hasSurrogateEscape reports whether body may hold a \uD800-\uDFFF escape
// (a cheap test: most bodies have no \u escape at all).
func hasSurrogateEscape(body []byte) bool {
	for {
		i := bytes.Index(body, []byte(`\u`))
		if i < 0 || i+2 >= len(body) {
			return false
		}
		if c := body[i+2]; c == 'd' || c == 'D' {
			return true
		}
		body = body[i+2:]
	}
}

// invalidString returns a RequestError naming the field of the first JSON
// string in body that is not valid UTF-8: invalid bytes, or an escape of a
// UTF-16 surrogate that is not part of a pair (\ud800, \udfff), which
// encoding/json would silently turn into U+FFFD. A bad string in an
// attributes entry names "attributes", as the enforcer does. It returns nil
// when every string it can read is valid.
func invalidString(body []byte) *RequestError {
	dec := json.NewDecoder(bytes.NewReader(body))
	type frame struct{ obj, wantKey bool }
	var stack []frame
	top := "" // the top-level field being read
	for {
		start := dec.InputOffset()
		tok, err := dec.Token()
		if err != nil {
			return nil
		}
		switch t := tok.(type) {
		case json.Delim:
			if t == '{' || t == '[' {
				if n := len(stack); n > 0 && stack[n-1].obj {
					stack[n-1].wantKey = true
				}
				stack = append(stack, frame{obj: t == '{', wantKey: t == '{'})
				continue
			}
			if len(stack) > 0 {
				stack = stack[:len(stack)-1]
			}
			continue
		case string:
			isKey := len(stack) > 0 && stack[len(stack)-1].obj && stack[len(stack)-1].wantKey
			if isKey && len(stack) == 1 {
				top = t
				for _, f := range checkFields {
					if strings.EqualFold(f, t) {
						top = f
					}
				}
			}
			raw := body[start:dec.InputOffset()]
			if q := bytes.IndexByte(raw, '"'); q >= 0 {
				raw = raw[q:]
			}
			if msg := badJSONString(raw); msg != "" {
				switch {
				case len(stack) == 1 && isKey:
					return &RequestError{Field: "", Msg: "a field name " + msg}
				case top == "attributes":
					return &RequestError{Field: top, Msg: "contains a string that " + msg}
				}
				return &RequestError{Field: top, Msg: msg}
			}
		}
		if n := len(stack); n > 0 && stack[n-1].obj {
			stack[n-1].wantKey = !stack[n-1].wantKey
		}
	}
}

// badJSONString says why the quoted JSON string raw is not valid UTF-8, or
// returns "".
func badJSONString(raw []byte) string {
	if !utf8.Valid(raw) {
		return "is not valid UTF-8"
	}
	for i := 0; i+1 < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		if raw[i+1] != 'u' {
			i++ // \" \\ \n ...
			continue
		}
		r, ok := hex4(raw[i+2:])
		switch {
		case !ok:
			return "" // not a valid escape: the decoder says so
		case r >= 0xd800 && r < 0xdc00: // high surrogate: a low one must follow
			if lo, ok := hex4(raw[min(i+8, len(raw)):]); ok && i+7 < len(raw) && raw[i+6] == '\\' && raw[i+7] == 'u' && lo >= 0xdc00 && lo <= 0xdfff {
				i += 11
				continue
			}
			fallthrough
		case r >= 0xdc00 && r <= 0xdfff:
			return fmt.Sprintf("is not valid UTF-8: the escape %s is an unpaired UTF-16 surrogate", raw[i:i+6])
		}
		i += 5
	}
	return ""
}

// hex4 reads four hex digits.
func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range b[:4] {
		var d byte
		switch {
		case '0' <= c && c <= '9':
			d = c - '0'
		case 'a' <= c && c <= 'f':
			d = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			d = c - 'A' + 10
		default:
			return 0, false
		}
		r = r<<4 | rune(d)
	}
	return r, true
}

// exactFields refuses what encoding/json lets through in a body it decoded:
// a field named in another case ("CLIENT_KEY" would fill client_key) and a
// field or an attribute given twice (the last would win), so that a body
// means one thing to every reader.
func exactFields(body []byte) (string, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	if _, err := dec.Token(); err != nil { // '{', decoded once already
		return "", fmt.Errorf("invalid JSON: %v", err)
	}
	seen := make([]bool, len(checkFields))
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return "", fmt.Errorf("invalid JSON: %v", err)
		}
		name, _ := t.(string)
		i := slices.Index(checkFields, name)
		switch {
		case i < 0:
			return name, fmt.Errorf("%s: unknown field (the fields are %s, spelled exactly)", name, strings.Join(checkFields, ", "))
		case seen[i]:
			return name, fmt.Errorf("%s: given twice", name)
		}
		seen[i] = true
		if name == "attributes" {
			if attr, err := uniqueKeys(dec); err != nil {
				return name, err
			} else if attr != "" {
				return name, fmt.Errorf("attributes: %q given twice", attr)
			}
			continue
		}
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return name, fmt.Errorf("invalid JSON: %v", err)
		}
	}
	return "", nil
}

// uniqueKeys reads the next value from dec and returns a key it gives
// twice, when it is an object ("" when none, or not an object).
func uniqueKeys(dec *json.Decoder) (string, error) {
	var raw json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		return "", fmt.Errorf("invalid JSON: %v", err)
	}
	inner := json.NewDecoder(bytes.NewReader(raw))
	if t, err := inner.Token(); err != nil || t != json.Delim('{') {
		return "", nil // null; another type was refused when decoding
	}
	seen := map[string]bool{}
	for inner.More() {
		t, err := inner.Token()
		if err != nil {
			return "", fmt.Errorf("invalid JSON: %v", err)
		}
		k, _ := t.(string)
		if seen[k] {
			return k, nil
		}
		seen[k] = true
		var skip json.RawMessage
		if err := inner.Decode(&skip); err != nil {
			return "", fmt.Errorf("invalid JSON: %v", err)
		}
	}
	return "", nil
}
