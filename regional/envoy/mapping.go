package envoy

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/apportion/apportion/internal/hashform"
	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/envoyconfig"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// check is one descriptor: its mapping to an enforcer request, the
// configuration node it resolved to, and its answer.
type check struct {
	entries   []*ratelimitv3.RateLimitDescriptor_Entry
	path      []envoyconfig.Entry
	keyEntry  int    // entry that gave the client key; -1: the descriptor's identity
	costField string // where the cost came from
	skip      bool   // a refund (is_negative_hits) or no entries: answered OK, nothing checked
	node      *node  // the imported node with a rate_limit it resolved to; nil: none (or replaced)

	req     regional.Request
	resp    regional.Response
	err     error
	costErr string // the cost is above the enforcer's maximum: over limit, and why
	status  *rlsv3.RateLimitResponse_DescriptorStatus
	bound   bool // resp has a binding rule or a rejection: a candidate for the headers
}

// reserved are the attributes this service sets; descriptor entries with
// these keys do not override them.
var reserved = []string{envoyconfig.AttrDescriptor, envoyconfig.AttrNode, envoyconfig.AttrName,
	envoyconfig.AttrReplaces, envoyconfig.AttrLimit, envoyconfig.AttrQuota, envoyconfig.AttrShare}

// The enforcer's limits on a request (regional's, which TestEnforcerLimits
// checks): a resource, an attribute's key and an attribute's value are at
// most maxFieldBytes of valid UTF-8 each, and a request has at most
// maxAttributes attributes. A client key is at most regional.MaxClientKeyBytes.
const (
	maxFieldBytes = rules.MaxMatchValueLen
	maxAttributes = 64
)

// mapped is s as a field of an enforcer request that takes at most max
// bytes: s itself when it is at most max bytes of valid UTF-8 and not of the
// hashed form, else hashedForm(s), "sha256:" and the hex SHA-256 of s (71
// bytes) (internal/hashform, shared with the Go client and middleware). It
// is injective: a kept s is never of the hashed form and a hashed one always
// is, so a hashed form never equals a kept value, and two different hashed
// values differ (barring a SHA-256 collision). So every value gets its own
// bucket and match value, long ones included, and a client cannot send the
// hashed form of another value to share its bucket: that form is hashed
// again.
var (
	mapped       = hashform.Fit
	hashedForm   = hashform.Hash
	isHashedForm = hashform.Is
)

// identity is the envoy.descriptor attribute of a descriptor whose entries
// (or, at share_threshold levels, wildcard values) are path:
// envoyconfig.Identity, whose hashed form is already that of mapped (its
// un-hashed form always holds a "=", so it never has the hashed form), made
// valid UTF-8 the same way.
func identity(path []envoyconfig.Entry) string {
	id := envoyconfig.Identity(path, maxFieldBytes)
	if isHashedForm(id) {
		return id
	}
	return mapped(id, maxFieldBytes)
}

// mapDescriptor maps descriptor i of in to c. It fails only on a
// hits_addend beyond any cost (InvalidArgument naming it): envoyproxy/ratelimit
// limits any descriptor, and so does this service. Every part is mapped
// within the enforcer's limits (mapped): a client key over
// regional.MaxClientKeyBytes, and a resource, an entry key or value and the
// domain over maxFieldBytes, are hashed; fit then keeps the number of
// attributes within maxAttributes.
func (s *service) mapDescriptor(in *rlsv3.RateLimitRequest, i int, d *ratelimitv3.RateLimitDescriptor, c *check) error {
	entries := d.GetEntries()
	*c = check{entries: entries, keyEntry: -1, costField: "hits_addend"}
	cost := uint64(in.GetHitsAddend())
	if h := d.GetHitsAddend(); h != nil {
		cost, c.costField = h.GetValue(), fmt.Sprintf("descriptors[%d].hits_addend", i)
	}
	if cost > math.MaxInt64 {
		return status.Errorf(codes.InvalidArgument, "%s: %d is above the maximum of %d", c.costField, cost, int64(math.MaxInt64))
	}
	if len(entries) == 0 || d.GetIsNegativeHits() {
		c.skip = true // no entries: no limit can apply; a refund: apportion does not refund
		return nil
	}

	c.path = make([]envoyconfig.Entry, len(entries))
	attrs := make(map[string]string, len(entries)+3)
	for j, e := range entries {
		c.path[j] = envoyconfig.Entry{Key: e.GetKey(), Value: e.GetValue()}
		k := mapped(e.GetKey(), maxFieldBytes)
		if _, dup := attrs[k]; !dup {
			attrs[k] = mapped(e.GetValue(), maxFieldBytes)
		}
	}
	for _, k := range reserved {
		delete(attrs, k)
	}
	id := identity(c.path)
	attrs[envoyconfig.AttrDescriptor] = id
	if dom := in.GetDomain(); dom != "" {
		if _, ok := attrs[AttrDomain]; !ok {
			attrs[AttrDomain] = mapped(dom, maxFieldBytes)
		}
	}

	clientKey := ""
	for _, k := range s.clientKeys {
		if j := c.find(k); j >= 0 && entries[j].GetValue() != "" {
			c.keyEntry, clientKey = j, mapped(entries[j].GetValue(), regional.MaxClientKeyBytes)
			break
		}
	}
	if c.keyEntry < 0 {
		// The identity's hashed form is already the one mapped gives.
		if clientKey = id; !isHashedForm(id) {
			clientKey = mapped(id, regional.MaxClientKeyBytes)
		}
	}

	resource := in.GetDomain()
	if j := c.find(EntryResource); j >= 0 {
		resource = entries[j].GetValue()
	} else {
		for _, k := range s.resourceKeys {
			if j := c.find(k); j >= 0 {
				if resource != "" {
					resource += " "
				}
				resource += entries[j].GetValue()
				break
			}
		}
	}
	c.req = regional.Request{ClientKey: clientKey, Resource: mapped(resource, maxFieldBytes), Cost: int64(cost), Attributes: attrs}
	return nil
}

// fit keeps the check's attributes within the enforcer's maxAttributes. A
// descriptor with more entries keeps only the attributes that the rules
// matching it read (their match keys and key parts), rule by rule in id
// order; a rule whose attributes no longer fit beside those of the rules
// before it is not applied to the descriptor, as if it did not match (only
// rules that together read more than maxAttributes distinct attributes do
// that; a rule with more match keys than that matches no request at all).
// Dropping the attributes no rule reads changes nothing: a rule matches
// the kept attributes exactly when it matches all of them. ix is the rule
// index the descriptor was resolved with; a rule set swapped in before the
// check may read attributes not kept, for that check only.
func (c *check) fit(ix *rules.Index) {
	attrs := c.req.Attributes
	if len(attrs) <= maxAttributes {
		return
	}
	kept := make(map[string]string, maxAttributes)
	var add []string
	for _, r := range ix.Match(c.req.Resource, attrs) {
		add = add[:0]
		need := func(k string) bool { // false: the request has no attribute k
			if _, ok := attrs[k]; !ok {
				return false
			}
			if _, ok := kept[k]; !ok && !slices.Contains(add, k) {
				add = append(add, k)
			}
			return true
		}
		for k := range r.Match {
			if k != rules.PartResource {
				need(k)
			}
		}
		applies := true
		for _, k := range r.Key {
			if k != rules.PartClientKey && k != rules.PartResource && !need(k) {
				applies = false // no bucket for this request: the enforcer skips the rule
			}
		}
		if !applies || len(kept)+len(add) > maxAttributes {
			continue
		}
		for _, k := range add {
			kept[k] = attrs[k]
		}
	}
	c.req.Attributes = kept
}

// applyReplaces drops the nodes that another descriptor's node replaces,
// as envoyproxy/ratelimit does: every node with a rate_limit (unlimited
// ones included) contributes its replaces, and a named node other than an
// unlimited one that any of them names is not applied.
func applyReplaces(cs []check) {
	var replaced map[string]bool
	for i := range cs {
		if n := cs[i].node; n != nil {
			for _, r := range n.replaces {
				if replaced == nil {
					replaced = map[string]bool{}
				}
				replaced[r] = true
			}
		}
	}
	for i := range cs {
		if n := cs[i].node; n != nil && n.kind != kindUnlimited && n.name != "" && replaced[n.name] {
			cs[i].node = nil
		}
	}
}

// needsCheck reports whether the descriptor goes to the enforcer: all but
// refunds, empty descriptors and unlimited or zero nodes.
func (c *check) needsCheck() bool {
	return !c.skip && (c.node == nil || c.node.kind == kindBucket)
}

// route sets the attributes that make the node's rule, and no other
// imported rule, match the descriptor's check; with share_threshold, the
// identity holds the wildcard value at those levels, so that every value it
// matches counts in one bucket.
func (c *check) route() {
	if c.node == nil {
		return
	}
	for k, v := range c.node.rule.Match {
		c.req.Attributes[k] = v
	}
	if len(c.node.shares) > 0 {
		path := slices.Clone(c.path)
		for l, v := range c.node.shares {
			path[l].Value = v
		}
		c.req.Attributes[envoyconfig.AttrDescriptor] = identity(path)
	}
}

// finish builds the descriptor's status. It returns the gRPC error of a
// check that failed for the whole call (the caller has gone away, no rule
// set); a request the enforcer refuses is answered for this descriptor
// alone: a cost above its maximum is OVER_LIMIT (where a limit applies:
// the service answered the others OK before), anything else OK.
func (c *check) finish() error {
	switch {
	case c.skip:
		c.status = &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
		return nil
	case c.node != nil && c.node.kind == kindUnlimited:
		c.status = &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK, LimitRemaining: math.MaxUint32}
		return nil
	case c.node != nil && c.node.kind == kindZero:
		c.resp = zeroAnswer(c.node, time.Now())
		c.status = descriptorStatus(c.resp)
		if !c.node.rule.Shadow {
			c.status.CurrentLimit = &rlsv3.RateLimitResponse_RateLimit{Name: c.node.rule.ID, Unit: unitOf(c.node.window())}
		}
		c.bound = !c.resp.Allowed // in shadow mode it binds nothing, headers included
		return nil
	}
	if c.err != nil {
		var re *regional.RequestError
		if !errors.As(c.err, &re) {
			return regional.GRPCStatus(c.err, nil)
		}
		c.resp = regional.Response{}
		if costRefused(re) {
			c.costErr = fmt.Sprintf("%s: %s", c.costField, re.Msg)
			c.status = &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OVER_LIMIT}
			return nil
		}
		// Not reached: mapDescriptor and fit keep every part within the
		// enforcer's limits (TestEnforcerLimits, FuzzShouldRateLimit).
		// Should a part still be refused, the descriptor is answered alone,
		// as one that no rule matches (OK, no current_limit; the enforcer's
		// refusal is counted as invalid in apportion_requests_total), and
		// the others keep their answers.
		c.status = &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
		return nil
	}
	c.status = descriptorStatus(c.resp)
	c.bound = binding(c.resp) != nil || !c.resp.Allowed
	return nil
}

func (c *check) answered() bool { return c.bound }

// costRefused reports whether err is the enforcer's refusal of a cost above
// its maximum.
func costRefused(err error) bool {
	var re *regional.RequestError
	return errors.As(err, &re) && re.Field == "cost"
}

// zeroAnswer is the answer of a node with requests_per_unit 0 at now: over
// limit (allowed in shadow mode), 0 remaining, waiting cannot help, reset at
// the end of the unit's current window (epoch-aligned, as envoyproxy/ratelimit's).
func zeroAnswer(n *node, now time.Time) regional.Response {
	w := n.window().Milliseconds()
	reset := w - now.UnixMilli()%w
	st := regional.Status{RuleID: n.rule.ID, Allowed: false, RetryAfterMs: redisstore.Never, ResetAfterMs: reset,
		Shadow: n.rule.Shadow, WindowMs: w}
	resp := regional.Response{Allowed: n.rule.Shadow, RuleID: n.rule.ID, ResetAfterMs: reset, Statuses: []regional.Status{st}}
	if !resp.Allowed {
		resp.RetryAfterMs = redisstore.Never
	}
	return resp
}

// find is the index of the first entry keyed k, or -1.
func (c *check) find(k string) int {
	for j, e := range c.entries {
		if e.GetKey() == k {
			return j
		}
	}
	return -1
}
