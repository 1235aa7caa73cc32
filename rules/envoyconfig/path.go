package envoyconfig

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
)

// Attributes and match keys of the convention between imported rules and
// the Envoy service (regional/envoy), which sets them on every descriptor's
// check. A descriptor entry with one of these keys does not override them.
const (
	// AttrDomain carries the RateLimitRequest's domain.
	AttrDomain = "domain"
	// AttrDescriptor carries the descriptor's identity: its entries as
	// key=value, in order, joined by "|" (see Identity). Imported rules
	// key their buckets on it, as envoyproxy/ratelimit keys its counters
	// on the domain and every entry's key and value.
	AttrDescriptor = "envoy.descriptor"
	// AttrNode names the configuration node a descriptor resolved to (see
	// NodePath); the Envoy service sets it, copied from the node's rule,
	// only on the check of a descriptor that resolved to that node.
	AttrNode = "envoy.node"
	// AttrName is the node's rate_limit.name (escaped like a path element).
	AttrName = "envoy.name"
	// AttrReplaces lists the names the node's rate_limit replaces, escaped
	// and joined by "|".
	AttrReplaces = "envoy.replaces"
	// AttrQuota is "true" for a node in quota mode (quota_mode): the
	// request is over limit only when every quota-mode descriptor is.
	AttrQuota = "envoy.quota"
	// AttrShare lists the levels (0-based, comma-separated) of the node's
	// path whose node has share_threshold: at those levels every value the
	// wildcard matches shares one counter (the identity holds the pattern).
	AttrShare = "envoy.share"
	// AttrLimit marks a node that the Envoy service answers itself, without
	// a bucket: LimitUnlimited, LimitZero or LimitNone. The rule's
	// algorithm fields are placeholders that rule validation requires;
	// they are never evaluated, because no check carries this attribute.
	AttrLimit = "envoy.limit"
)

// Values of AttrLimit.
const (
	LimitUnlimited = "unlimited" // rate_limit.unlimited: always OK, nothing counted
	LimitZero      = "0"         // requests_per_unit 0: always over limit
	LimitNone      = "none"      // a leaf without rate_limit: no limit (it stops the fallback to a key-only sibling)
)

// Entry is one descriptor entry, or one level of a configuration node's
// path; an empty Value in a node path means "key only" (any value).
type Entry struct{ Key, Value string }

// escaper escapes the characters that separate entries and keys from
// values ("|", "="), "%" itself, and "*", which a rule's match value may
// only hold alone (meaning "any value").
var escaper = strings.NewReplacer("%", "%25", "*", "%2A", "|", "%7C", "=", "%3D")

// Escape escapes s for a path element or an AttrName/AttrReplaces value.
func Escape(s string) string { return escaper.Replace(s) }

// Unescape reverses Escape.
func Unescape(s string) (string, error) {
	if !strings.Contains(s, "%") {
		return s, nil
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			b.WriteByte(s[i])
			continue
		}
		if i+2 >= len(s) {
			return "", fmt.Errorf("envoyconfig: %q: %% at %d is not followed by two hex digits", s, i)
		}
		v, err := hex.DecodeString(s[i+1 : i+3])
		if err != nil {
			return "", fmt.Errorf("envoyconfig: %q: %% at %d is not followed by two hex digits", s, i)
		}
		b.WriteByte(v[0])
		i += 2
	}
	return b.String(), nil
}

// NodePath writes a configuration node's path: per level "key" (key only)
// or "key=value", escaped, joined by "|", e.g.
// "source_cluster=proxy|destination_cluster=mock" or "foo|bar=banned".
func NodePath(path []Entry) string {
	parts := make([]string, len(path))
	for i, e := range path {
		parts[i] = Escape(e.Key)
		if e.Value != "" {
			parts[i] += "=" + Escape(e.Value)
		}
	}
	return strings.Join(parts, "|")
}

// ParseNodePath reverses NodePath.
func ParseNodePath(s string) ([]Entry, error) {
	if s == "" {
		return nil, errors.New("envoyconfig: empty node path")
	}
	var out []Entry
	for _, part := range strings.Split(s, "|") {
		k, v, _ := strings.Cut(part, "=")
		key, err := Unescape(k)
		if err != nil {
			return nil, err
		}
		val, err := Unescape(v)
		if err != nil {
			return nil, err
		}
		if key == "" {
			return nil, fmt.Errorf("envoyconfig: node path %q: an empty key", s)
		}
		out = append(out, Entry{key, val})
	}
	return out, nil
}

// Identity is a descriptor's identity: every entry as key=value (escaped),
// in order, joined by "|", e.g. "key1=foo" or
// "source_cluster=proxy|destination_cluster=mock". When that is longer
// than max bytes it is "sha256:" and the hex SHA-256 of it (71 bytes), so
// that any descriptor has an identity within the enforcer's limits.
func Identity(entries []Entry, max int) string {
	var b strings.Builder
	for i, e := range entries {
		if i > 0 {
			b.WriteByte('|')
		}
		b.WriteString(Escape(e.Key))
		b.WriteByte('=')
		b.WriteString(Escape(e.Value))
	}
	if b.Len() <= max {
		return b.String()
	}
	sum := sha256.Sum256([]byte(b.String()))
	return "sha256:" + hex.EncodeToString(sum[:])
}
