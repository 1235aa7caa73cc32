package regional

import (
	"bytes"
	"encoding/json"
	"errors"
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
// means one thing to every reader. body is valid JSON (json.Decoder read
// it whole), so a byte scan of its object's keys is enough: no second
// decode on the check's path.
func exactFields(body []byte) (string, error) {
	sc := keyScan{b: body}
	seen := make([]bool, len(checkFields))
	err := sc.object(func(name string) error {
		i := slices.Index(checkFields, name)
		switch {
		case i < 0:
			return &fieldErr{name, fmt.Sprintf("%s: unknown field (the fields are %s, spelled exactly)", name, strings.Join(checkFields, ", "))}
		case seen[i]:
			return &fieldErr{name, name + ": given twice"}
		}
		seen[i] = true
		if name != "attributes" || sc.peek() != '{' {
			return sc.value()
		}
		attrs := map[string]bool{}
		return sc.object(func(k string) error {
			if attrs[k] {
				return &fieldErr{name, fmt.Sprintf("attributes: %q given twice", k)}
			}
			attrs[k] = true
			return sc.value()
		})
	})
	var fe *fieldErr
	if errors.As(err, &fe) {
		return fe.field, errors.New(fe.msg)
	}
	if err != nil {
		return "", fmt.Errorf("invalid JSON: %v", err)
	}
	return "", nil
}

type fieldErr struct{ field, msg string }

func (e *fieldErr) Error() string { return e.msg }

// keyScan reads the keys of JSON objects from valid JSON, skipping values.
type keyScan struct {
	b []byte
	i int
}

var errScan = errors.New("unexpected end of the body")

func (s *keyScan) ws() {
	for s.i < len(s.b) && (s.b[s.i] == ' ' || s.b[s.i] == '\t' || s.b[s.i] == '\n' || s.b[s.i] == '\r') {
		s.i++
	}
}

func (s *keyScan) peek() byte {
	s.ws()
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

// object reads an object, calling key with each key, decoded, when the
// scan is at its value.
func (s *keyScan) object(key func(string) error) error {
	if s.peek() != '{' {
		return errScan
	}
	s.i++
	if s.peek() == '}' {
		s.i++
		return nil
	}
	for {
		raw, err := s.str()
		if err != nil {
			return err
		}
		k := string(raw[1 : len(raw)-1])
		if bytes.IndexByte(raw, '\\') >= 0 { // an escape: decode it as encoding/json did
			if err := json.Unmarshal(raw, &k); err != nil {
				return err
			}
		}
		if s.peek() != ':' {
			return errScan
		}
		s.i++
		if err := key(k); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case '}':
			s.i++
			return nil
		default:
			return errScan
		}
	}
}

// str reads a string and returns it with its quotes, escapes as written.
func (s *keyScan) str() ([]byte, error) {
	if s.peek() != '"' {
		return nil, errScan
	}
	start := s.i
	for s.i++; s.i < len(s.b); s.i++ {
		switch s.b[s.i] {
		case '\\':
			s.i++
		case '"':
			s.i++
			return s.b[start:s.i], nil
		}
	}
	return nil, errScan
}

// value skips one value.
func (s *keyScan) value() error {
	switch s.peek() {
	case '"':
		_, err := s.str()
		return err
	case '{', '[':
		depth := 0
		for ; s.i < len(s.b); s.i++ {
			switch s.b[s.i] {
			case '"':
				if _, err := s.str(); err != nil {
					return err
				}
				s.i--
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					s.i++
					return nil
				}
			}
		}
		return errScan
	}
	for s.i < len(s.b) && !bytes.ContainsRune([]byte(",}] \t\n\r"), rune(s.b[s.i])) { // a number, true, false, null
		s.i++
	}
	return nil
}
