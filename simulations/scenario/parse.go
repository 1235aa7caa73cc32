package scenario

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
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

var (
	lineRE = regexp.MustCompile(`line (\d+): `)
	// typeRE matches the message of a yaml.TypeError's entry (the line
	// removed): the node's tag, its value (cut at 7 characters and "..."
	// when longer than 10; absent for a list or a mapping) and the Go type.
	typeRE    = regexp.MustCompile("^cannot unmarshal (!!\\w+)(?: `(.*)`)? into (\\S+)$")
	unknownRE = regexp.MustCompile(`^field (\S+) not found in type `)
)

// Parse decodes and validates a scenario; name is used in error messages.
// The file holds one YAML document. An explicit 0 never stands for a
// default: it is refused where 0 is not a meaningful value (sample, the
// rule's rate and burst, sync durations but the margin, an agent restart's
// for, keys.zipf_s), and sync.margin 0 is 0. Only demand cost 0 means 1,
// as in a CheckLimit request, and seed 0 means 1, as --seed 0 does.
func Parse(name string, data []byte) (*Scenario, error) {
	var sc Scenario
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&sc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, &Error{File: name, Msg: "the file is empty: no YAML document (a scenario needs at least name, duration, regions, rule and demand)"}
		}
		var root yaml.Node
		_ = yaml.Unmarshal(data, &root) // to name the field of a type error
		e := decodeError(&root, err)
		e.File = name
		return nil, e
	}
	for {
		var extra yaml.Node
		err := dec.Decode(&extra)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			msg, line := splitLine(strings.TrimPrefix(err.Error(), "yaml: "))
			return nil, &Error{File: name, Line: line, Msg: "after the scenario's YAML document: " + msg}
		}
		if n := docContent(&extra); n != nil && !isNull(n) {
			return nil, &Error{File: name, Line: n.Line, Msg: "a second YAML document (after ---): a scenario file holds one document"}
		}
	}
	var root yaml.Node
	_ = yaml.Unmarshal(data, &root)
	fail := func(err error) error {
		var e *Error
		if errors.As(err, &e) {
			e.File = name
			if e.Line == 0 {
				e.Line = lineOf(&root, e.Field)
			}
			for _, p := range e.see {
				if l := lineOf(&root, p); l > 0 {
					e.Msg = strings.Replace(e.Msg, p, fmt.Sprintf("%s (line %d)", p, l), 1)
				}
			}
		}
		return err
	}
	set := func(path string) bool {
		n := nodeAt(&root, path)
		return n != nil && !isNull(n)
	}
	if err := sc.checkWritten(&root, set); err != nil {
		return nil, fail(err)
	}
	sc.defaults(set)
	if err := sc.Validate(); err != nil {
		return nil, fail(err)
	}
	sc.src = &source{file: name, root: &root}
	return &sc, nil
}

// splitLine takes a leading "line N: " off a message.
func splitLine(msg string) (string, int) {
	m := lineRE.FindStringSubmatchIndex(msg)
	if m == nil {
		return msg, 0
	}
	line, _ := strconv.Atoi(msg[m[2]:m[3]])
	return msg[:m[0]] + msg[m[1]:], line
}

// decodeError turns a decoding error into an *Error naming the line and,
// where it can be found in root, the field.
func decodeError(root *yaml.Node, err error) *Error {
	var de *durationError
	if errors.As(err, &de) {
		field, _ := pathAt(root, de.line, "", de.value)
		return &Error{Line: de.line, Field: field, Msg: fmt.Sprintf("bad duration %q (use e.g. 250ms, 60s, 1h)", de.value)}
	}
	msg := err.Error()
	var te *yaml.TypeError
	if errors.As(err, &te) && len(te.Errors) > 0 {
		msg = te.Errors[0]
	}
	msg, line := splitLine(strings.TrimPrefix(msg, "yaml: "))
	e := &Error{Line: line, Msg: msg}
	if m := unknownRE.FindStringSubmatch(msg); m != nil {
		e.Msg = fmt.Sprintf("unknown field %q", m[1])
		e.Field = keyParent(root, line, m[1])
	} else if m := typeRE.FindStringSubmatch(msg); m != nil {
		tag, value, goType := m[1], m[2], m[3]
		var n *yaml.Node
		e.Field, n = pathAt(root, line, tag, value)
		if n != nil && n.Kind == yaml.ScalarNode {
			value = n.Value // not cut
		}
		e.Msg = typeMsg(tag, value, goType)
	}
	return e
}

// typeMsg says what a field of goType wants, and what it got.
func typeMsg(tag, value, goType string) string {
	var got string
	switch tag {
	case "!!seq":
		got = "a list"
	case "!!map":
		got = "a mapping"
	case "!!str":
		got = strconv.Quote(value)
	case "!!null":
		got = "nothing (null)"
	default:
		got = value
	}
	var want string
	switch {
	case goType == "scenario.Scenario":
		return "a scenario file is a mapping of its fields (name: ..., duration: ..., regions: ...), not " + got
	case goType == "float64":
		want = "a number"
	case goType == "int" || goType == "int64":
		want = "a whole number (below 2^63)"
	case goType == "uint64":
		want = "a whole number >= 0 (below 2^64)"
	case goType == "string":
		want = "a string"
	case goType == "bool":
		want = "true or false"
	case strings.HasPrefix(goType, "[]"):
		want = "a list"
	case strings.HasPrefix(goType, "map["), strings.HasPrefix(goType, "scenario."):
		want = "a mapping"
	default:
		return fmt.Sprintf("cannot use %s here (a %s)", got, goType)
	}
	return fmt.Sprintf("want %s, got %s", want, got)
}

// checkWritten checks what the file says before the defaults fill in
// what it leaves out: whole numbers where a field is one (YAML would
// truncate 2.9 to 2), no explicit 0 where 0 is not a value, no demand
// field its shape does not read (shapeFields), and a gift_wait left to its
// default that the interval cannot hold.
func (sc *Scenario) checkWritten(root *yaml.Node, set func(string) bool) error {
	ints := []string{"seed"}
	for i := range sc.Demand {
		f := fmt.Sprintf("demand[%d]", i)
		ints = append(ints, f+".cost", f+".keys.count")
	}
	for _, p := range ints {
		n := nodeAt(root, p)
		if n == nil || n.Kind != yaml.ScalarNode || n.ShortTag() != "!!float" {
			continue
		}
		if v, err := strconv.ParseFloat(n.Value, 64); err != nil || v != math.Trunc(v) {
			return bad(p, "%s is not a whole number", n.Value)
		}
	}
	var d Scenario // the defaults, for the messages
	d.defaults(nil)
	type zero struct {
		path string
		zero bool   // the value is 0
		dflt string // what leaving the field out gives
	}
	zeros := []zero{
		{"sample", sc.Sample == 0, d.Sample.D().String()},
		{"rule.rate", sc.Rule.Rate == 0 && sc.Rule.Window != 0, "burst / window"},
		{"rule.burst", sc.Rule.Burst == 0, "rule.rate"},
		{"sync.interval", sc.Sync.Interval == 0, d.Sync.Interval.D().String()},
		{"sync.lease", sc.Sync.Lease == 0, d.Sync.Lease.D().String()},
		{"sync.store_timeout", sc.Sync.StoreTimeout == 0, d.Sync.StoreTimeout.D().String()},
		{"sync.registry_poll", sc.Sync.RegistryPoll == 0, d.Sync.RegistryPoll.D().String()},
		{"sync.etcd_timeout", sc.Sync.EtcdTimeout == 0, d.Sync.EtcdTimeout.D().String()},
	}
	for i, dm := range sc.Demand {
		if dm.Keys != nil {
			zeros = append(zeros, zero{fmt.Sprintf("demand[%d].keys.zipf_s", i), dm.Keys.S == 0, "1.1"})
		}
	}
	for i, e := range sc.Events {
		if e.Kind == "agent_restart" {
			zeros = append(zeros, zero{fmt.Sprintf("events[%d].for", i), e.For == 0, "1s"})
		}
	}
	for _, z := range zeros {
		if z.zero && set(z.path) {
			return bad(z.path, "0 is not allowed: it must be positive (0 does not stand for the default: leave the field out for %s)", z.dflt)
		}
	}
	for i, dm := range sc.Demand {
		shape := dm.Shape
		if shape == "" {
			shape = "constant"
		}
		uses, ok := shapeFields[shape]
		if !ok {
			continue // Validate names the unknown shape
		}
		for _, field := range allShapeFields {
			p := fmt.Sprintf("demand[%d].%s", i, field)
			if set(p) && !slices.Contains(uses, field) {
				return bad(p, "does not apply to shape %s, which uses %s: remove it, or set the shape that uses it", shape, strings.Join(uses, ", "))
			}
		}
	}
	if iv := sc.Sync.Interval.D(); iv > 0 && !set("sync.gift_wait") && d.Sync.GiftWait.D() > maxGiftWaitIntervals*iv {
		gw := d.Sync.GiftWait.D()
		return bad("sync.interval", "%v is too short for sync.gift_wait's default of %v, which may be at most %d intervals (%v at this interval): use an interval of at least %v, or set gift_wait (at most %v; 0s: every excess at once)",
			iv, gw, maxGiftWaitIntervals, maxGiftWaitIntervals*iv, (gw+maxGiftWaitIntervals-1)/maxGiftWaitIntervals, maxGiftWaitIntervals*iv)
	}
	return nil
}

// shapeFields are the demand fields each shape reads; allShapeFields
// every one of them, in the order Demand lists them.
var (
	shapeFields = map[string][]string{
		"constant": {"level"},
		"steps":    {"steps"},
		"ramp":     {"from", "to", "start", "end"},
		"sinusoid": {"level", "amplitude", "period", "phase"},
	}
	allShapeFields = []string{"level", "steps", "from", "to", "start", "end", "amplitude", "period", "phase"}
)

func isNull(n *yaml.Node) bool { return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" }

// docContent returns a document's top node (nil for an empty document).
func docContent(n *yaml.Node) *yaml.Node {
	if n.Kind == yaml.DocumentNode {
		if len(n.Content) == 0 {
			return nil
		}
		return n.Content[0]
	}
	if n.Kind == 0 {
		return nil
	}
	return n
}

// nodeAt returns the node at a dotted path (a.b[2].c), or nil.
func nodeAt(root *yaml.Node, path string) *yaml.Node {
	n := docContent(root)
	for _, part := range splitPath(path) {
		if n == nil {
			return nil
		}
		next := (*yaml.Node)(nil)
		switch n.Kind {
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				if n.Content[i].Value == part {
					next = n.Content[i+1]
					break
				}
			}
		case yaml.SequenceNode:
			if i, err := strconv.Atoi(part); err == nil && i >= 0 && i < len(n.Content) {
				next = n.Content[i]
			}
		}
		n = next
	}
	return n
}

// lineOf finds the line of a dotted path (a.b[2].c) in the document: the
// line of its key, or of the deepest part of the path that is there.
func lineOf(root *yaml.Node, path string) int {
	n := docContent(root)
	if n == nil {
		return 0
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

// walk visits every node under n in document order with its dotted path
// (mapping values only, not keys) and the mapping that holds it, until
// visit returns true.
func walk(n *yaml.Node, path string, visit func(n *yaml.Node, path string, key *yaml.Node) bool) bool {
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			if walk(c, path, visit) {
				return true
			}
		}
		return false
	case yaml.MappingNode:
		if visit(n, path, nil) {
			return true
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i]
			p := k.Value
			if path != "" {
				p = path + "." + k.Value
			}
			if visit(k, path, k) || walk(n.Content[i+1], p, visit) {
				return true
			}
		}
		return false
	case yaml.SequenceNode:
		if visit(n, path, nil) {
			return true
		}
		for i, c := range n.Content {
			if walk(c, fmt.Sprintf("%s[%d]", path, i), visit) {
				return true
			}
		}
		return false
	}
	return visit(n, path, nil)
}

// pathAt returns the dotted path of the first value at line that is a
// list (tag !!seq) or a mapping (!!map), or else a scalar whose value is
// value (a yaml.TypeError's, which cuts values longer than 10 characters
// to 7 and "..."), and the node; or "" and nil. The document's top node
// is the answer only when no other node is.
func pathAt(root *yaml.Node, line int, tag, value string) (string, *yaml.Node) {
	prefix, cut := strings.CutSuffix(value, "...")
	out, node := "", (*yaml.Node)(nil)
	top := docContent(root)
	if top != nil && top.Line == line && (tag == "!!seq" && top.Kind == yaml.SequenceNode || tag == "!!map" && top.Kind == yaml.MappingNode) {
		node = top
	}
	walk(root, "", func(n *yaml.Node, path string, key *yaml.Node) bool {
		if key != nil || n.Line != line || n == top {
			return false
		}
		var ok bool
		switch {
		case tag == "!!seq":
			ok = n.Kind == yaml.SequenceNode
		case tag == "!!map":
			ok = n.Kind == yaml.MappingNode
		case n.Kind == yaml.ScalarNode:
			ok = n.Value == value || cut && strings.HasPrefix(n.Value, prefix)
		}
		if ok {
			out, node = path, n
		}
		return ok
	})
	return out, node
}

// keyParent returns the dotted path of the mapping that has key name at
// line (an unknown field), or "".
func keyParent(root *yaml.Node, line int, name string) string {
	out := ""
	walk(root, "", func(n *yaml.Node, path string, key *yaml.Node) bool {
		if key != nil && n.Line == line && n.Value == name {
			out = path
			return true
		}
		return false
	})
	return out
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
