package envoyconfig

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/rules"
	"go.yaml.in/yaml/v3"
)

// ErrInvalid is matched (errors.Is) by every error of Convert.
var ErrInvalid = errors.New("envoyconfig: invalid configuration")

// Error is a configuration error. Field names the bad field by its path in
// the file, e.g. "descriptors[1].descriptors[0].rate_limit.unit"; Line is
// its line (0 when unknown).
type Error struct {
	Line  int
	Field string
	Msg   string
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("envoyconfig: ")
	if e.Line > 0 {
		fmt.Fprintf(&b, "line %d: ", e.Line)
	}
	if e.Field != "" {
		b.WriteString(e.Field)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// Unwrap makes errors.Is(err, ErrInvalid) true.
func (e *Error) Unwrap() error { return ErrInvalid }

// MaxFileSize bounds one configuration file.
const MaxFileSize = rules.MaxRulesSize

// Units are envoyproxy/ratelimit's units (case-insensitive in a file) and
// the fixed window each becomes (month: 30 days, year: 365 days, as
// envoyproxy/ratelimit counts them).
var Units = map[string]time.Duration{
	"second": time.Second,
	"minute": time.Minute,
	"hour":   time.Hour,
	"day":    24 * time.Hour,
	"week":   7 * 24 * time.Hour,
	"month":  30 * 24 * time.Hour,
	"year":   365 * 24 * time.Hour,
}

const unitList = "second, minute, hour, day, week, month or year"

// Convert turns one envoyproxy/ratelimit configuration file (YAML: a
// domain and its nested descriptors) into rules, one per configuration
// node that the Envoy service needs, in the file's order; see the package
// documentation for the mapping. Every rule is normalized and valid.
func Convert(data []byte, opts ...Option) ([]rules.Rule, error) {
	if len(data) > MaxFileSize {
		return nil, &Error{Msg: fmt.Sprintf("file is %d bytes, over the %d-byte limit", len(data), MaxFileSize)}
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, &Error{Msg: "empty configuration; want a domain and descriptors"}
		}
		return nil, &Error{Msg: "invalid YAML: " + strings.TrimPrefix(err.Error(), "yaml: ")}
	}
	var more yaml.Node
	if err := dec.Decode(&more); err == nil {
		return nil, &Error{Line: more.Line, Msg: "several YAML documents (\"---\"); envoyproxy/ratelimit reads one domain per file: split them into files"}
	} else if !errors.Is(err, io.EOF) {
		return nil, &Error{Msg: "invalid YAML: " + strings.TrimPrefix(err.Error(), "yaml: ")}
	}
	root := &doc
	if root.Kind == yaml.DocumentNode && len(root.Content) == 1 {
		root = root.Content[0]
	}
	c := &converter{ids: map[string]bool{}}
	for _, o := range opts {
		o(c)
	}
	if err := c.file(root); err != nil {
		return nil, err
	}
	return c.out, nil
}

// Option changes what Convert accepts.
type Option func(*converter)

// IgnoreMetadata accepts descriptors' metadata and leaves it out of the
// rules (apportion's Envoy service sends no dynamic metadata). Default:
// metadata is refused, naming the field, so that it is never lost unnoticed.
func IgnoreMetadata() Option { return func(c *converter) { c.ignoreMetadata = true } }

type converter struct {
	domain         string
	ignoreMetadata bool
	ids            map[string]bool
	out            []rules.Rule
}

// node is what a configuration node's rule carries besides its path.
type node struct {
	window   time.Duration // the unit; 0: a placeholder second
	rpu      int64
	limit    string // AttrLimit value; "": a bucket
	name     string
	replaces []string
	shadow   bool
	quota    bool
	shares   []int // levels with share_threshold
}

var (
	fileFields       = []string{"domain", "descriptors"}
	descriptorFields = []string{"key", "value", "rate_limit", "descriptors", "shadow_mode", "detailed_metric", "value_to_metric",
		"quota_mode", "share_threshold", "metadata"}
	rateLimitFields = []string{"unit", "requests_per_unit", "unlimited", "name", "replaces"}
)

// fields checks that n is a mapping with no unknown or repeated keys and
// returns its values by key.
func fields(n *yaml.Node, field string, known []string, what string) (map[string]*yaml.Node, error) {
	if n.Kind != yaml.MappingNode {
		return nil, &Error{Line: n.Line, Field: field, Msg: fmt.Sprintf("must be a mapping (%s), got %s", what, kind(n))}
	}
	m := make(map[string]*yaml.Node, len(n.Content)/2)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		name := join(field, k.Value)
		if k.Kind != yaml.ScalarNode || k.ShortTag() != "!!str" {
			return nil, &Error{Line: k.Line, Field: field, Msg: fmt.Sprintf("key %s is not a string", k.Value)}
		}
		if !slices.Contains(known, k.Value) {
			msg := fmt.Sprintf("unknown field; known fields of %s: %s", what, strings.Join(known, ", "))
			for _, f := range known {
				if strings.EqualFold(strings.ReplaceAll(f, "_", ""), strings.ReplaceAll(k.Value, "_", "")) || distance(f, k.Value) <= 2 {
					msg = fmt.Sprintf("unknown field; did you mean %q?", f)
					break
				}
			}
			if slices.Contains(rateLimitFields, k.Value) && what != "rate_limit" {
				msg = fmt.Sprintf("unknown field here; %q belongs under rate_limit", k.Value)
			}
			return nil, &Error{Line: k.Line, Field: name, Msg: msg}
		}
		if _, dup := m[k.Value]; dup {
			return nil, &Error{Line: k.Line, Field: name, Msg: "appears more than once"}
		}
		m[k.Value] = v
	}
	return m, nil
}

// distance is the Levenshtein distance of a and b.
func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

func join(parent, field string) string {
	if parent == "" {
		return field
	}
	return parent + "." + field
}

func kind(n *yaml.Node) string {
	switch {
	case n.Kind == yaml.SequenceNode:
		return "a list"
	case n.Kind == yaml.MappingNode:
		return "a mapping"
	case n.Kind == yaml.AliasNode:
		return "an alias"
	case n.ShortTag() == "!!null":
		return "null"
	}
	return fmt.Sprintf("%s %q", strings.TrimPrefix(n.ShortTag(), "!!"), n.Value)
}

// str reads a scalar as text, as envoyproxy/ratelimit does (a number or
// boolean is taken as written); null is "".
func str(n *yaml.Node, field string) (string, error) {
	if n.Kind != yaml.ScalarNode {
		return "", &Error{Line: n.Line, Field: field, Msg: "must be a string, got " + kind(n)}
	}
	if n.ShortTag() == "!!null" {
		return "", nil
	}
	return n.Value, nil
}

// boolean reads true/false (and YAML 1.1's yes/no/on/off, which
// envoyproxy/ratelimit's parser accepts); null is false.
func boolean(n *yaml.Node, field string) (bool, error) {
	if n.Kind == yaml.ScalarNode {
		switch strings.ToLower(n.Value) {
		case "true", "yes", "y", "on":
			if n.Style&(yaml.SingleQuotedStyle|yaml.DoubleQuotedStyle) == 0 {
				return true, nil
			}
		case "false", "no", "n", "off":
			if n.Style&(yaml.SingleQuotedStyle|yaml.DoubleQuotedStyle) == 0 {
				return false, nil
			}
		case "", "~", "null":
			if n.ShortTag() == "!!null" {
				return false, nil
			}
		}
	}
	return false, &Error{Line: n.Line, Field: field, Msg: "must be true or false, got " + kind(n)}
}

func (c *converter) file(root *yaml.Node) error {
	if root.Kind == yaml.ScalarNode && root.ShortTag() == "!!null" {
		return &Error{Msg: "empty configuration; want a domain and descriptors"}
	}
	f, err := fields(root, "", fileFields, "a configuration file")
	if err != nil {
		return err
	}
	dn, ok := f["domain"]
	if !ok {
		return &Error{Line: root.Line, Field: "domain", Msg: "required (config file cannot have empty domain)"}
	}
	if c.domain, err = str(dn, "domain"); err != nil {
		return err
	}
	switch {
	case c.domain == "":
		return &Error{Line: dn.Line, Field: "domain", Msg: "must not be empty (config file cannot have empty domain)"}
	case strings.Contains(c.domain, rules.MatchAny):
		return &Error{Line: dn.Line, Field: "domain", Msg: fmt.Sprintf("%q contains %q, which a rule cannot match literally", c.domain, rules.MatchAny)}
	case len(c.domain) > rules.MaxMatchValueLen:
		return &Error{Line: dn.Line, Field: "domain", Msg: fmt.Sprintf("is %d bytes, over the limit of %d", len(c.domain), rules.MaxMatchValueLen)}
	}
	if ds, ok := f["descriptors"]; ok {
		return c.descriptors(ds, "descriptors", nil, nil)
	}
	return nil
}

// descriptors converts one level of descriptors under path.
// shares lists the levels of path whose node has share_threshold.
func (c *converter) descriptors(n *yaml.Node, field string, path []Entry, shares []int) error {
	if n.ShortTag() == "!!null" {
		return nil
	}
	if n.Kind != yaml.SequenceNode {
		return &Error{Line: n.Line, Field: field, Msg: "must be a list of descriptors, got " + kind(n)}
	}
	seen := map[string]string{} // envoyproxy/ratelimit's composite key -> field
	for i, dn := range n.Content {
		df := fmt.Sprintf("%s[%d]", field, i)
		d, err := fields(dn, df, descriptorFields, "a descriptor")
		if err != nil {
			return err
		}
		var e Entry
		if kn, ok := d["key"]; ok {
			if e.Key, err = str(kn, df+".key"); err != nil {
				return err
			}
		}
		if e.Key == "" {
			return &Error{Line: dn.Line, Field: df + ".key", Msg: "required (descriptor has empty key)"}
		}
		if vn, ok := d["value"]; ok {
			if e.Value, err = str(vn, df+".value"); err != nil {
				return err
			}
		}
		composite := compositeKey(e)
		if prev, dup := seen[composite]; dup {
			return &Error{Line: dn.Line, Field: df, Msg: fmt.Sprintf("duplicate descriptor composite key '%s' (also %s)",
				c.statsKey(append(slices.Clone(path), e)), prev)}
		}
		seen[composite] = df
		here := append(slices.Clone(path), e)
		hereShares := shares
		if fn, ok := d["share_threshold"]; ok {
			on, err := boolean(fn, df+".share_threshold")
			if err != nil {
				return err
			}
			if on && !strings.Contains(composite, "*") {
				return &Error{Line: fn.Line, Field: df + ".share_threshold", Msg: fmt.Sprintf(
					"share_threshold can only be used with wildcard values (containing '*'), but found key '%s'", composite)}
			}
			if on {
				hereShares = append(slices.Clone(shares), len(path))
			}
		}
		quota := false
		if qn, ok := d["quota_mode"]; ok {
			if quota, err = boolean(qn, df+".quota_mode"); err != nil {
				return err
			}
		}
		if mn, ok := d["metadata"]; ok && mn.ShortTag() != "!!null" && !c.ignoreMetadata {
			return &Error{Line: mn.Line, Field: df + ".metadata", Msg: "not supported by the import: apportion's Envoy service sends no dynamic metadata; remove it, or import without it (rlctl import envoy --ignore-metadata)"}
		}
		for _, f := range []string{"detailed_metric", "value_to_metric"} { // statistics only: accepted, no effect
			if fn, ok := d[f]; ok {
				if _, err := boolean(fn, df+"."+f); err != nil {
					return err
				}
			}
		}
		shadow := false
		if sn, ok := d["shadow_mode"]; ok {
			if shadow, err = boolean(sn, df+".shadow_mode"); err != nil {
				return err
			}
		}
		rl, hasRL := d["rate_limit"]
		if hasRL && rl.ShortTag() == "!!null" {
			hasRL = false
		}
		children, hasChildren := d["descriptors"]
		if hasChildren && (children.ShortTag() == "!!null" || children.Kind == yaml.SequenceNode && len(children.Content) == 0) {
			hasChildren = false
		}
		switch {
		case hasRL:
			if err := c.rateLimit(rl, df+".rate_limit", here, node{shadow: shadow, quota: quota, shares: hereShares}); err != nil {
				return err
			}
		case !hasChildren:
			// A leaf without a limit: requests that reach it are not
			// limited, and do not fall back to a key-only sibling.
			if err := c.emit(here, df, node{limit: LimitNone, shadow: shadow, shares: hereShares}); err != nil {
				return err
			}
		}
		if cn, ok := d["descriptors"]; ok {
			if err := c.descriptors(cn, df+".descriptors", here, hereShares); err != nil {
				return err
			}
		}
	}
	return nil
}

// compositeKey is envoyproxy/ratelimit's key of a node among its siblings.
func compositeKey(e Entry) string {
	if e.Value == "" {
		return e.Key
	}
	return e.Key + "_" + e.Value
}

// statsKey is envoyproxy/ratelimit's name of a node: the domain and each
// level's composite key, joined by ".".
func (c *converter) statsKey(path []Entry) string {
	parts := []string{c.domain}
	for _, e := range path {
		parts = append(parts, compositeKey(e))
	}
	return strings.Join(parts, ".")
}

func (c *converter) rateLimit(n *yaml.Node, field string, path []Entry, nd node) error {
	f, err := fields(n, field, rateLimitFields, "rate_limit")
	if err != nil {
		return err
	}
	unlimited := false
	if un, ok := f["unlimited"]; ok {
		if unlimited, err = boolean(un, field+".unlimited"); err != nil {
			return err
		}
	}
	var unit string
	un, hasUnit := f["unit"]
	if hasUnit {
		if unit, err = str(un, field+".unit"); err != nil {
			return err
		}
	}
	window, validUnit := Units[strings.ToLower(unit)]
	switch {
	case unlimited && validUnit:
		return &Error{Line: un.Line, Field: field + ".unit", Msg: "should not specify rate limit unit when unlimited"}
	case !unlimited && !hasUnit:
		return &Error{Line: n.Line, Field: field + ".unit", Msg: "required: " + unitList}
	case !unlimited && !validUnit:
		return &Error{Line: un.Line, Field: field + ".unit", Msg: fmt.Sprintf("invalid rate limit unit '%s'; use %s", unit, unitList)}
	}
	var rpu int64
	if rn, ok := f["requests_per_unit"]; ok {
		v, err := strconv.ParseUint(rn.Value, 10, 32)
		if rn.Kind != yaml.ScalarNode || rn.ShortTag() != "!!int" || err != nil {
			return &Error{Line: rn.Line, Field: field + ".requests_per_unit", Msg: fmt.Sprintf("must be a whole number from 0 to %d, got %s", uint32(math.MaxUint32), kind(rn))}
		}
		rpu = int64(v)
	}
	var name string
	if nn, ok := f["name"]; ok {
		if name, err = str(nn, field+".name"); err != nil {
			return err
		}
	}
	var replaces []string
	if rn, ok := f["replaces"]; ok && rn.ShortTag() != "!!null" {
		if rn.Kind != yaml.SequenceNode {
			return &Error{Line: rn.Line, Field: field + ".replaces", Msg: "must be a list of {name: ...}, got " + kind(rn)}
		}
		for i, en := range rn.Content {
			ef := fmt.Sprintf("%s.replaces[%d]", field, i)
			e, err := fields(en, ef, []string{"name"}, "a replaces entry")
			if err != nil {
				return err
			}
			var r string
			if nn, ok := e["name"]; ok {
				if r, err = str(nn, ef+".name"); err != nil {
					return err
				}
			}
			switch {
			case r == "":
				return &Error{Line: en.Line, Field: ef + ".name", Msg: "should not have an empty replaces entry"}
			case r == name:
				return &Error{Line: en.Line, Field: ef + ".name", Msg: "replaces should not contain name of same descriptor"}
			}
			replaces = append(replaces, r)
		}
	}
	nd.window, nd.rpu, nd.name, nd.replaces = window, rpu, name, replaces
	switch {
	case unlimited:
		nd.limit, nd.window = LimitUnlimited, 0
	case rpu == 0:
		nd.limit = LimitZero
	}
	return c.emit(path, field, nd)
}

// emit appends the rule of the node at path.
func (c *converter) emit(path []Entry, field string, nd node) error {
	r := rules.Rule{
		ID:        c.id(path),
		Match:     map[string]string{AttrDomain: c.domain, AttrNode: NodePath(path)},
		Key:       []string{AttrDescriptor},
		Algorithm: rules.FixedWindow,
		Limit:     max(nd.rpu, 1),
		Window:    rules.Duration(time.Second),
		Shadow:    nd.shadow,
	}
	if nd.window > 0 {
		r.Window = rules.Duration(nd.window)
	}
	if nd.limit != "" {
		r.Match[AttrLimit] = nd.limit
		r.Limit = 1 // a placeholder: never evaluated
	}
	if nd.name != "" {
		r.Match[AttrName] = Escape(nd.name)
	}
	if len(nd.replaces) > 0 {
		esc := make([]string, len(nd.replaces))
		for i, s := range nd.replaces {
			esc[i] = Escape(s)
		}
		r.Match[AttrReplaces] = strings.Join(esc, "|")
	}
	if nd.quota {
		r.Match[AttrQuota] = "true"
	}
	if len(nd.shares) > 0 {
		parts := make([]string, len(nd.shares))
		for i, l := range nd.shares {
			parts[i] = strconv.Itoa(l)
		}
		r.Match[AttrShare] = strings.Join(parts, ",")
	}
	for k, v := range r.Match {
		if len(v) > rules.MaxMatchValueLen {
			return &Error{Field: field, Msg: fmt.Sprintf("the node's %s is %d bytes, over a rule's limit of %d for a match value", k, len(v), rules.MaxMatchValueLen)}
		}
	}
	r.Normalize()
	if err := r.Validate(); err != nil {
		return &Error{Field: field, Msg: err.Error()}
	}
	c.out = append(c.out, r)
	return nil
}

// id is the rule id of a node: envoyproxy/ratelimit's statistics name of
// it (domain.key_value.key), with characters a rule id cannot hold turned
// into "-", shortened with a hash suffix past rules.MaxIDLen, and made
// unique with a "-2", "-3" ... suffix.
func (c *converter) id(path []Entry) string {
	full := c.statsKey(path)
	b := []byte(full)
	for i, ch := range b {
		if !('a' <= ch && ch <= 'z' || 'A' <= ch && ch <= 'Z' || '0' <= ch && ch <= '9' || ch == '_' || ch == '.' || ch == '-') {
			b[i] = '-'
		}
	}
	id := string(b)
	if len(id) > rules.MaxIDLen-12 {
		sum := sha256.Sum256([]byte(full))
		id = id[:rules.MaxIDLen-12-9] + "-" + hex.EncodeToString(sum[:4])
	}
	if strings.Trim(id, ".") == "" {
		id = "envoy-" + id
	}
	base := id
	for n := 2; c.ids[id]; n++ {
		id = fmt.Sprintf("%s-%d", base, n)
	}
	c.ids[id] = true
	return id
}
