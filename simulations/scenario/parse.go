package scenario

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"

	yaml "go.yaml.in/yaml/v3"
)

// Load reads and parses a scenario file.
func Load(path string) (*Scenario, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("scenario: %w", err)
	}
	return Parse(path, b)
}

var lineRE = regexp.MustCompile(`line (\d+): `)

// Parse decodes and validates a scenario; name is used in error messages.
func Parse(name string, data []byte) (*Scenario, error) {
	var sc Scenario
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&sc); err != nil {
		msg := err.Error()
		var te *yaml.TypeError
		if errors.As(err, &te) && len(te.Errors) > 0 {
			msg = te.Errors[0]
		}
		msg = strings.TrimPrefix(msg, "yaml: ")
		line := 0
		if m := lineRE.FindStringSubmatch(msg); m != nil {
			line, _ = strconv.Atoi(m[1])
			msg = strings.Replace(msg, m[0], "", 1)
		}
		if strings.Contains(msg, " not found in type ") {
			f := strings.TrimPrefix(msg, "field ")
			f = f[:strings.Index(f, " not found")]
			msg = fmt.Sprintf("unknown field %q", f)
		}
		return nil, &Error{File: name, Line: line, Msg: msg}
	}
	var root yaml.Node
	_ = yaml.Unmarshal(data, &root)
	sc.defaults()
	if err := sc.Validate(); err != nil {
		var e *Error
		if errors.As(err, &e) {
			e.File = name
			if e.Line == 0 {
				e.Line = lineOf(&root, e.Field)
			}
		}
		return nil, err
	}
	return &sc, nil
}

// lineOf finds the line of a dotted path (a.b[2].c) in the document.
func lineOf(root *yaml.Node, path string) int {
	n := root
	if n.Kind == yaml.DocumentNode && len(n.Content) > 0 {
		n = n.Content[0]
	}
	line := n.Line
	for _, part := range splitPath(path) {
		next := (*yaml.Node)(nil)
		switch {
		case n.Kind == yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				if n.Content[i].Value == part {
					line = n.Content[i].Line
					next = n.Content[i+1]
					break
				}
			}
		case n.Kind == yaml.SequenceNode:
			if i, err := strconv.Atoi(part); err == nil && i >= 0 && i < len(n.Content) {
				next = n.Content[i]
				line = next.Line
			}
		}
		if next == nil {
			return line
		}
		n = next
	}
	return line
}

func splitPath(p string) []string {
	var out []string
	for _, s := range strings.Split(p, ".") {
		for s != "" {
			i := strings.IndexByte(s, '[')
			if i < 0 {
				out = append(out, s)
				break
			}
			if i > 0 {
				out = append(out, s[:i])
			}
			j := strings.IndexByte(s, ']')
			if j < i {
				out = append(out, s[i+1:])
				break
			}
			out = append(out, s[i+1:j])
			s = s[j+1:]
		}
	}
	return out
}
