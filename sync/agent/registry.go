package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultRegistryPrefix is where EtcdRegistry keeps one document per global rule.
const DefaultRegistryPrefix = "/ratelimit/registry/"

// ErrRegistry is wrapped by registry errors other than etcd's own.
var ErrRegistry = errors.New("agent: registry")

// Spec is what a rule's ledgers must agree on in every region: the number
// of units and the floors and initial parts (MinShare and the regions'
// weights). The first agent to create a rule's registry document fixes it;
// every agent builds its ledger from the document's Spec (see the package
// doc on rule changes).
type Spec struct {
	Units    int64               `json:"units"`
	MinShare float64             `json:"min_share"`
	Regions  []ledger.RegionSpec `json:"regions"`
}

func (s Spec) equal(o Spec) bool {
	return s.Units == o.Units && s.MinShare == o.MinShare && slices.Equal(s.Regions, o.Regions)
}

// validate checks a spec read from etcd as the agent would have made it:
// units within the store's range, regions named once in name order
// (ledger.Regions) with finite positive weights of a finite sum.
func (s Spec) validate() error {
	if s.Units <= 0 || s.Units > redisstore.MaxUnits {
		return fmt.Errorf("spec: units %d outside (0, %d]", s.Units, redisstore.MaxUnits)
	}
	var sum float64
	for i, x := range s.Regions {
		if i > 0 && s.Regions[i-1].Name >= x.Name {
			return fmt.Errorf("spec: regions not in name order or repeated at %q", x.Name)
		}
		if !(x.Weight > 0) || math.IsInf(x.Weight, 0) {
			return fmt.Errorf("spec: region %q: weight %v is not a finite number above 0", x.Name, x.Weight)
		}
		sum += x.Weight
	}
	if math.IsInf(sum, 0) {
		return errors.New("spec: the weights' sum is not finite")
	}
	return nil
}

// validLives checks that each region's incarnations appear in increasing
// order, as Start appends them, below the largest number: Start gives the
// next after the region's last, and a number given out twice (or 0, after
// wrapping) would make peers take the new life for an old one.
func validLives(st ledger.RegistryState) error {
	last := map[string]uint64{}
	for _, l := range st.Lives {
		if l.Inc <= last[l.Region] || l.Inc == math.MaxUint64 {
			return fmt.Errorf("state: incarnation %s/%d out of order (after %d) or too large", l.Region, l.Inc, last[l.Region])
		}
		last[l.Region] = l.Inc
	}
	return nil
}

// ledgerConfig returns base with the spec's Units and MinShare.
func (s Spec) ledgerConfig(base ledger.Config) ledger.Config {
	base.Units, base.MinShare = s.Units, s.MinShare
	return base
}

// Registry is the reclaim registry as the agent uses it: one ledger.Registry
// per global rule, every change atomic (EtcdRegistry: compare-and-swap).
type Registry interface {
	// Start allocates region's next incarnation for rule, creating the rule's
	// registry with spec if it has none; it returns the spec in force.
	Start(ctx context.Context, rule string, spec Spec, region string) (ledger.Start, Spec, error)
	// Contribute adds c to rule's registry and returns the record of c.Of.
	Contribute(ctx context.Context, rule string, c ledger.Contribution) (ledger.Record, error)
	// Close records that by's store marker is confirmed: every earlier
	// incarnation of its region is at its floor for good.
	Close(ctx context.Context, rule string, by ledger.Incarnation) error
	// Records returns, per rule with a registry, a revision that changes
	// whenever the rule's registry does, and every reclaim record in it.
	Records(ctx context.Context) (map[string]RuleRecords, error)
}

// RuleRecords is one rule's registry as Records sees it.
type RuleRecords = driver.RuleRecords

// registryDoc is the JSON document of one rule's registry.
type registryDoc struct {
	Spec  Spec                 `json:"spec"`
	State ledger.RegistryState `json:"state"`
}

// EtcdRegistry keeps each rule's ledger.Registry as one JSON document under
// a prefix and changes it with a compare-and-swap loop on the key's
// ModRevision, so concurrent agents never lose an update.
type EtcdRegistry struct {
	kv     clientv3.KV
	prefix string
	base   ledger.Config
	shard  Shard // the layout every change checks (LayoutKey), and whose groups Records returns
}

// NewEtcdRegistry returns a registry over kv under prefix (default
// DefaultRegistryPrefix when empty). base supplies the ledger settings the
// registry validates with (Units and MinShare come from each rule's Spec).
func NewEtcdRegistry(kv clientv3.KV, prefix string, base ledger.Config) *EtcdRegistry {
	if prefix == "" {
		prefix = DefaultRegistryPrefix
	}
	if !strings.HasSuffix(prefix, "/") {
		prefix += "/"
	}
	return &EtcdRegistry{kv: kv, prefix: prefix, base: base}
}

// forShard returns r checking sh's layout and reading sh's groups.
func (r *EtcdRegistry) forShard(sh Shard) *EtcdRegistry {
	c := *r
	c.shard = sh
	return &c
}

// Key returns the etcd key of rule's registry document.
func (r *EtcdRegistry) Key(rule string) string { return r.prefix + rule }

func (r *EtcdRegistry) decode(b []byte) (*ledger.Registry, Spec, error) {
	var doc registryDoc
	if err := json.Unmarshal(b, &doc); err != nil {
		return nil, Spec{}, fmt.Errorf("%w: document: %w", ErrRegistry, err)
	}
	if err := doc.Spec.validate(); err != nil {
		return nil, Spec{}, fmt.Errorf("%w: document: %v", ErrRegistry, err)
	}
	if err := validLives(doc.State); err != nil {
		return nil, Spec{}, fmt.Errorf("%w: document: %v", ErrRegistry, err)
	}
	reg, err := ledger.RestoreRegistry(doc.Spec.ledgerConfig(r.base), doc.Spec.Regions, doc.State)
	if err != nil {
		return nil, Spec{}, fmt.Errorf("%w: document: %w", ErrRegistry, err)
	}
	return reg, doc.Spec, nil
}

// layoutGuard checks the layout read in lay (a range read of LayoutKey)
// against r's shard (checkLayout) and returns the comparison that holds
// while that layout document is unchanged (none: ModRevision 0).
func (r *EtcdRegistry) layoutGuard(lay *etcdserverpb.RangeResponse) (clientv3.Cmp, error) {
	var doc []byte
	var rev int64
	if len(lay.Kvs) > 0 {
		doc, rev = lay.Kvs[0].Value, lay.Kvs[0].ModRevision
	}
	return clientv3.Compare(clientv3.ModRevision(LayoutKey), "=", rev), r.shard.checkLayout(doc)
}

// update runs fn on rule's registry (created with spec when absent, if spec
// is not nil) and writes it back if the document did not change meanwhile,
// retrying otherwise.
func (r *EtcdRegistry) update(ctx context.Context, rule string, spec *Spec, fn func(*ledger.Registry, Spec) error) error {
	key := r.Key(rule)
	for {
		// The document and the layout in one read; the write below
		// compares both, so no incarnation starts in a layout that is not
		// this agent's (see the package doc, "Shards").
		tr, err := r.kv.Txn(ctx).Then(clientv3.OpGet(key), clientv3.OpGet(LayoutKey)).Commit()
		if err != nil {
			return err
		}
		resp := tr.Responses[0].GetResponseRange()
		layCmp, err := r.layoutGuard(tr.Responses[1].GetResponseRange())
		if err != nil {
			return err
		}
		var reg *ledger.Registry
		var cur Spec
		var cmp clientv3.Cmp
		if len(resp.Kvs) == 0 {
			if spec == nil {
				return fmt.Errorf("%w: rule %q has no registry", ErrRegistry, rule)
			}
			cur = *spec
			if reg, err = ledger.NewRegistry(cur.ledgerConfig(r.base), cur.Regions); err != nil {
				return fmt.Errorf("%w: %w", ErrRegistry, err)
			}
			cmp = clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
		} else {
			if reg, cur, err = r.decode(resp.Kvs[0].Value); err != nil {
				return err
			}
			cmp = clientv3.Compare(clientv3.ModRevision(key), "=", resp.Kvs[0].ModRevision)
		}
		if err := fn(reg, cur); err != nil {
			return err
		}
		b, err := json.Marshal(registryDoc{Spec: cur, State: reg.State()})
		if err != nil {
			return err
		}
		tr, err = r.kv.Txn(ctx).If(cmp, layCmp).Then(clientv3.OpPut(key, string(b))).Commit()
		if err != nil {
			return err
		}
		if tr.Succeeded {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// Start implements Registry.
func (r *EtcdRegistry) Start(ctx context.Context, rule string, spec Spec, region string) (ledger.Start, Spec, error) {
	var st ledger.Start
	var used Spec
	err := r.update(ctx, rule, &spec, func(reg *ledger.Registry, cur Spec) error {
		var err error
		st, err = reg.Start(region)
		used = cur
		return err
	})
	return st, used, err
}

// Contribute implements Registry.
func (r *EtcdRegistry) Contribute(ctx context.Context, rule string, c ledger.Contribution) (ledger.Record, error) {
	var rec ledger.Record
	err := r.update(ctx, rule, nil, func(reg *ledger.Registry, _ Spec) error {
		var err error
		rec, err = reg.Contribute(c)
		return err
	})
	return rec, err
}

// Close implements Registry.
func (r *EtcdRegistry) Close(ctx context.Context, rule string, by ledger.Incarnation) error {
	return r.update(ctx, rule, nil, func(reg *ledger.Registry, _ Spec) error {
		return reg.Close(by)
	})
}

// Records implements Registry with one range read of the prefix (and of
// LayoutKey: another layout than the agent's is ErrLayout). Documents that
// do not decode, and those of other shards' groups, are left out.
func (r *EtcdRegistry) Records(ctx context.Context) (map[string]RuleRecords, error) {
	tr, err := r.kv.Txn(ctx).Then(clientv3.OpGet(r.prefix, clientv3.WithPrefix()), clientv3.OpGet(LayoutKey)).Commit()
	if err != nil {
		return nil, err
	}
	resp := tr.Responses[0].GetResponseRange()
	if _, err := r.layoutGuard(tr.Responses[1].GetResponseRange()); err != nil {
		return nil, err
	}
	out := make(map[string]RuleRecords, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		id := strings.TrimPrefix(string(kv.Key), r.prefix)
		if !r.shard.ownGroup(id) {
			continue
		}
		reg, _, err := r.decode(kv.Value)
		if err != nil {
			continue
		}
		out[id] = RuleRecords{Revision: kv.ModRevision, Records: reg.Records()}
	}
	return out, nil
}
