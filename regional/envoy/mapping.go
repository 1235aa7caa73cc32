package envoy

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

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
	index     int
	entries   []*ratelimitv3.RateLimitDescriptor_Entry
	path      []envoyconfig.Entry
	keyEntry  int    // entry that gave the client key; -1: the descriptor's identity
	resEntry  int    // entry that gave the resource; -1: the domain alone
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

// hashed is s when it is at most max bytes, else "sha256:" and its hex
// SHA-256: an identity within the enforcer's limits for any value.
func hashed(s string, max int) string {
	if len(s) <= max {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// mapDescriptor maps descriptor i of in to c. It fails only on a
// hits_addend beyond any cost (InvalidArgument naming it): envoyproxy/ratelimit
// limits any descriptor, and so does this service.
func (s *service) mapDescriptor(in *rlsv3.RateLimitRequest, i int, d *ratelimitv3.RateLimitDescriptor, c *check) error {
	entries := d.GetEntries()
	*c = check{index: i, entries: entries, keyEntry: -1, resEntry: -1, costField: "hits_addend"}
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
		if _, dup := attrs[e.GetKey()]; !dup {
			attrs[e.GetKey()] = hashed(e.GetValue(), rules.MaxMatchValueLen)
		}
	}
	for _, k := range reserved {
		delete(attrs, k)
	}
	identity := envoyconfig.Identity(c.path, rules.MaxMatchValueLen)
	attrs[envoyconfig.AttrDescriptor] = identity
	if dom := in.GetDomain(); dom != "" {
		if _, ok := attrs[AttrDomain]; !ok {
			attrs[AttrDomain] = dom
		}
	}

	clientKey := ""
	for _, k := range s.clientKeys {
		if j := c.find(k); j >= 0 && entries[j].GetValue() != "" {
			c.keyEntry, clientKey = j, hashed(entries[j].GetValue(), regional.MaxClientKeyBytes)
			break
		}
	}
	if c.keyEntry < 0 {
		clientKey = hashed(identity, regional.MaxClientKeyBytes)
	}

	resource := in.GetDomain()
	if j := c.find(EntryResource); j >= 0 {
		c.resEntry, resource = j, entries[j].GetValue()
	} else {
		for _, k := range s.resourceKeys {
			if j := c.find(k); j >= 0 {
				c.resEntry = j
				if resource != "" {
					resource += " "
				}
				resource += entries[j].GetValue()
				break
			}
		}
	}
	c.req = regional.Request{ClientKey: clientKey, Resource: resource, Cost: int64(cost), Attributes: attrs}
	return nil
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
		c.req.Attributes[envoyconfig.AttrDescriptor] = envoyconfig.Identity(path, rules.MaxMatchValueLen)
	}
}

// finish builds the descriptor's status. It returns the gRPC error of a
// failed check, except that a cost above the enforcer's maximum is an
// over-limit answer for this descriptor alone.
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
		if errors.As(c.err, &re) && re.Field == "cost" {
			c.costErr = fmt.Sprintf("%s: %s", c.costField, re.Msg)
			c.resp = regional.Response{}
			c.status = &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OVER_LIMIT}
			return nil
		}
		return grpcError(c.err, c)
	}
	c.status = descriptorStatus(c.resp)
	c.bound = binding(c.resp) != nil || !c.resp.Allowed
	return nil
}

func (c *check) answered() bool { return c.bound }

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

func (c *check) entryName(j int) string {
	return fmt.Sprintf("descriptors[%d].entries[%d] (key %q)", c.index, j, c.entries[j].GetKey())
}

// field names the part of the Envoy request that a regional.RequestError is about.
func (c *check) field(re *regional.RequestError) string {
	switch f := re.Field; {
	case f == "client_key" && c.keyEntry >= 0:
		return c.entryName(c.keyEntry)
	case f == "client_key":
		return fmt.Sprintf("descriptors[%d].entries", c.index)
	case f == "resource" && c.resEntry >= 0:
		return c.entryName(c.resEntry)
	case f == "resource":
		return "domain"
	case f == "cost":
		return c.costField
	case strings.HasPrefix(f, "attributes."):
		k := strings.TrimPrefix(f, "attributes.")
		for j, e := range c.entries {
			if strings.HasPrefix(e.GetKey(), k) {
				return c.entryName(j)
			}
		}
		if strings.HasPrefix(AttrDomain, k) {
			return "domain"
		}
	}
	return fmt.Sprintf("descriptors[%d].entries", c.index)
}
