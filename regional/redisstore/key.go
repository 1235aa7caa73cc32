package redisstore

import (
	"strconv"
	"strings"

	"github.com/apportion/apportion/rules"
)

// Key builds "rl:{<tag escaped>}:<ruleID escaped>[:<extra escaped>...]".
// The braces are a Redis Cluster hash tag, so every bucket of one client
// lands in one slot and one script can touch them all.
//
// Escaping is percent-encoding of '%', '{' and '}' in the tag, and of '%',
// '{', '}' and ':' in the rule id and the extras. The mapping is injective
// (the parts can be read back unambiguously), and the hash tag of the
// result is exactly the escaped tag, which holds no brace: no client key can
// choose another client's slot or key ("{user:1}" and "user:1" give
// different keys and tags). An empty tag is written "%00" (a literal "%00"
// tag escapes to "%2500"), because Redis Cluster ignores an empty hash tag.
func Key(tag, ruleID string, extra ...string) string { return SubKey(tag, 0, ruleID, extra...) }

// SubKey is Key for sub-bucket sub of a hot key spread over several (a
// rule's split): sub 0 is Key itself, sub i > 0 appends "%#i" to the
// escaped tag ("rl:{tenant%#1}:r"), its own hash tag and so its own Redis
// Cluster slot. The escaped tag never holds "%#" (escaping writes '%' only
// as "%25", "%7B", "%7D" or the empty tag's "%00"), so no client key, split
// or not, reaches another's sub-bucket: client "v#1" is "rl:{v#1}:r",
// client "v"'s sub-bucket 1 "rl:{v%#1}:r".
func SubKey(tag string, sub int, ruleID string, extra ...string) string {
	var b strings.Builder
	b.Grow(10 + len(tag) + len(ruleID) + 8*len(extra))
	b.WriteString("rl:{")
	if tag == "" {
		b.WriteString("%00")
	} else {
		escape(&b, tag, false)
	}
	if sub > 0 {
		b.WriteString("%#")
		b.WriteString(strconv.Itoa(sub))
	}
	b.WriteString("}:")
	escape(&b, ruleID, true)
	for _, e := range extra {
		b.WriteByte(':')
		escape(&b, e, true)
	}
	return b.String()
}

// AlgorithmKey is the key under which a bucket of algorithm a keeps its
// state, given its Key (or SubKey): the key itself for a token bucket, else
// the key with "%!" and the algorithm's tag appended ("%!fw" fixed window,
// "%!sw" sliding window, "%!sl" sliding log, "%!lb" leaky bucket). Each
// algorithm keeps its own layout, and some layouts have the same length
// (a leaky bucket's and a token bucket's 12 bytes), so a rule whose
// algorithm changes must not read its keys' old state: the new script
// refused it as a bad state (the check then answered by the failure policy
// until the key expired) or misread it. With the algorithm in the key it
// starts afresh, as a new key. Escaping never writes "%!", so these keys
// differ from every key Key and SubKey build and from each other; the hash
// tag, and so the Cluster slot, is the key's.
func AlgorithmKey(key string, a rules.Algorithm) string {
	tag := ""
	switch a {
	case rules.FixedWindow:
		tag = "%!fw"
	case rules.SlidingWindow:
		tag = "%!sw"
	case rules.SlidingLog:
		tag = "%!sl"
	case rules.LeakyBucket:
		tag = "%!lb"
	}
	return key + tag
}

func escape(b *strings.Builder, s string, colon bool) {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '%':
			b.WriteString("%25")
		case c == '{':
			b.WriteString("%7B")
		case c == '}':
			b.WriteString("%7D")
		case c == ':' && colon:
			b.WriteString("%3A")
		default:
			b.WriteByte(c)
		}
	}
}
