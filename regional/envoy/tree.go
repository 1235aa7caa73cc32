package envoy

import (
	"cmp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/envoyconfig"
)

// nodeKind is what an imported configuration node does to a descriptor
// that resolves to it.
type nodeKind int

const (
	kindNone      nodeKind = iota // no limit (an intermediate node, or a leaf without rate_limit)
	kindBucket                    // its rule's fixed window
	kindUnlimited                 // OK, counted nowhere
	kindZero                      // requests_per_unit 0: always over limit
)

// node is one envoyproxy/ratelimit configuration node, rebuilt from the
// imported rules (rules/envoyconfig) of a rule index.
type node struct {
	children  map[string]*node // by envoyproxy/ratelimit's composite key: "key" or "key_value"
	wildcards []wildcard       // the children whose composite key holds "*"
	kind      nodeKind
	rule      *rules.Rule    // the node's rule; nil for an intermediate node
	name      string         // rate_limit.name
	replaces  []string       // rate_limit.replaces
	quota     bool           // quota_mode
	shares    map[int]string // share_threshold: level -> the wildcard value that stands for every value it matches
}

type wildcard struct {
	key   string   // the child's composite key, e.g. "files_docs/*"
	parts []string // key split on "*"
}

// limited reports whether the node has a rate_limit (envoyproxy/ratelimit's
// "limit != nil"): a bucket, unlimited or zero.
func (n *node) limited() bool { return n != nil && n.kind != kindNone }

// window is the node's unit as a duration.
func (n *node) window() time.Duration { return time.Duration(n.rule.Window) }

// trees holds the configuration trees by domain derived from one rule
// index; it is immutable.
type trees struct {
	ix      *rules.Index
	domains map[string]*node
}

// buildTrees derives the configuration trees from the imported rules of
// ix: those whose match holds a domain and an envoy.node path. A rule whose
// path does not parse, or whose envoy.limit is unknown, is left out (it then
// limits nothing through this service); of two rules for one node, the first
// by id is the node's.
func buildTrees(ix *rules.Index) *trees {
	t := &trees{ix: ix, domains: map[string]*node{}}
	for _, r := range ix.Rules() {
		dom, np := r.Match[envoyconfig.AttrDomain], r.Match[envoyconfig.AttrNode]
		if dom == "" || np == "" {
			continue
		}
		path, err := envoyconfig.ParseNodePath(np)
		if err != nil {
			continue
		}
		kind, ok := map[string]nodeKind{"": kindBucket, envoyconfig.LimitUnlimited: kindUnlimited,
			envoyconfig.LimitZero: kindZero, envoyconfig.LimitNone: kindNone}[r.Match[envoyconfig.AttrLimit]]
		if !ok {
			continue
		}
		name, err := envoyconfig.Unescape(r.Match[envoyconfig.AttrName])
		if err != nil {
			continue
		}
		var replaces []string
		if rs := r.Match[envoyconfig.AttrReplaces]; rs != "" {
			for _, s := range strings.Split(rs, "|") {
				u, err := envoyconfig.Unescape(s)
				if err != nil {
					continue
				}
				replaces = append(replaces, u)
			}
		}
		n := t.domains[dom]
		if n == nil {
			n = &node{children: map[string]*node{}}
			t.domains[dom] = n
		}
		for _, e := range path {
			ck := compositeKey(e.Key, e.Value)
			c := n.children[ck]
			if c == nil {
				c = &node{children: map[string]*node{}}
				n.children[ck] = c
				if strings.Contains(ck, "*") {
					n.wildcards = append(n.wildcards, wildcard{key: ck, parts: strings.Split(ck, "*")})
				}
			}
			n = c
		}
		if n.rule != nil {
			continue
		}
		rule := r
		n.rule, n.kind, n.name, n.replaces = &rule, kind, name, replaces
		n.quota = r.Match[envoyconfig.AttrQuota] == "true"
		if sh := r.Match[envoyconfig.AttrShare]; sh != "" {
			n.shares = map[int]string{}
			for _, f := range strings.Split(sh, ",") {
				if l, err := strconv.Atoi(f); err == nil && l >= 0 && l < len(path) {
					n.shares[l] = path[l].Value
				}
			}
		}
	}
	for _, root := range t.domains {
		sortWildcards(root)
	}
	return t
}

// sortWildcards orders every node's wildcard children by the length of
// their fixed text, longest first, then by key: the first that matches
// wins. (envoyproxy/ratelimit tries them in file order, which the rules do
// not keep; the two differ only when two wildcard siblings match one value.)
func sortWildcards(n *node) {
	slices.SortFunc(n.wildcards, func(a, b wildcard) int {
		if c := cmp.Compare(len(b.key)-strings.Count(b.key, "*"), len(a.key)-strings.Count(a.key, "*")); c != 0 {
			return c
		}
		return cmp.Compare(a.key, b.key)
	})
	for _, c := range n.children {
		sortWildcards(c)
	}
}

func compositeKey(key, value string) string {
	if value == "" {
		return key
	}
	return key + "_" + value
}

// resolve finds the node of a descriptor of domain as envoyproxy/ratelimit
// does: per entry, the child keyed key_value, else the first wildcard child
// that matches key_value, else the child keyed by the key alone; the node's
// limit applies only when the descriptor's last entry reaches it. It returns
// nil when no node with a rate_limit applies.
func (t *trees) resolve(domain string, entries []envoyconfig.Entry) *node {
	cur := t.domains[domain]
	if cur == nil {
		return nil
	}
	var found *node
	for i, e := range entries {
		kv := e.Key + "_" + e.Value
		next := cur.children[kv]
		if next == nil {
			for _, w := range cur.wildcards {
				if wildcardMatch(w.parts, kv) {
					next = cur.children[w.key]
					break
				}
			}
		}
		if next == nil {
			next = cur.children[e.Key]
		}
		if next.limited() && i == len(entries)-1 {
			found = next
		}
		if next == nil || len(next.children) == 0 {
			break
		}
		cur = next
	}
	return found
}

// wildcardMatch reports whether s matches a pattern split on "*", each "*"
// standing for any run of characters.
func wildcardMatch(parts []string, s string) bool {
	if len(parts) == 1 {
		return parts[0] == s
	}
	first, last := parts[0], parts[len(parts)-1]
	if len(s) < len(first)+len(last) || !strings.HasPrefix(s, first) || !strings.HasSuffix(s, last) {
		return false
	}
	rest := s[len(first) : len(s)-len(last)]
	for _, p := range parts[1 : len(parts)-1] {
		i := strings.Index(rest, p)
		if i < 0 {
			return false
		}
		rest = rest[i+len(p):]
	}
	return true
}
