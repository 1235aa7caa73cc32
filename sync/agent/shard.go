package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/driver"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Shards (see the package doc, "Shards"): shard i of N owns the keys whose
// Redis Cluster hash slot lies in redisstore.ShardSlots(i, N), and runs, per
// rule, the ledger of its own group: the rule's id with the suffix
// "#e<epoch>-<i>of<N>" names the group's ledgers, registry document and
// reports, so shard i of every region forms one ledger group and the
// ledger's proof applies to each group as it stands.

// MaxShards bounds Shard.Count.
const MaxShards = 256

// LayoutKey is the etcd key of the deployment's shard layout (a Layout as
// JSON). No key means Layout{Shards: 1} (epoch 0): one agent per region, as
// before shards existed.
const LayoutKey = "/ratelimit/syncagent/layout"

// epochIncs is how many incarnations a group of a layout of epoch above 0
// may allocate: the store sees incarnation epoch*epochIncs + inc (see
// shardStore), so a later layout's markers and records order above every
// earlier layout's in every slot.
const epochIncs = 1 << 16

// maxEpoch keeps epoch*epochIncs + inc within redisstore.MaxInc.
const maxEpoch = int(redisstore.MaxInc/epochIncs) - 1

// ErrLayout is returned (wrapped) when the layout in etcd is not this
// agent's: it starts no incarnation and drops the ledgers it runs.
var ErrLayout = errors.New("agent: shard layout mismatch")

// ReasonLayout is the apportion_sync_reports_rejected_total reason of a
// report of another shard layout (a rule id with another group suffix).
const ReasonLayout = "layout"

// Layout is the shard layout every region's agents must run: Shards
// processes per region, numbered 0..Shards-1, in its Epoch. The epoch grows
// by one at every change (ChangeLayout), which keeps incarnations ordered
// in the stores across layouts.
type Layout struct {
	Shards int `json:"shards"`
	Epoch  int `json:"epoch"`
}

// validate checks that l is a layout agents can run: 1 to MaxShards
// shards, an epoch within [0, maxEpoch].
func (l Layout) validate() error {
	if l.Shards < 1 {
		return fmt.Errorf("shard count %d outside [1, %d]", l.Shards, MaxShards)
	}
	return Shard{Count: l.Shards, Epoch: l.Epoch}.validate()
}

// Shard is this agent's part of the layout: shard Index of Count in Epoch.
// The zero value and {0, 1, 0} are the unsharded agent (every key, rule ids
// as they are, ReportSubject).
type Shard struct {
	Index, Count, Epoch int
}

// ParseShard reads "i/N" (for example "0/2"); epoch is set from the layout.
func ParseShard(s string) (Shard, error) {
	a, b, ok := strings.Cut(s, "/")
	i, err1 := strconv.Atoi(a)
	n, err2 := strconv.Atoi(b)
	if !ok || err1 != nil || err2 != nil {
		return Shard{}, fmt.Errorf("shard %q: want i/N, e.g. 0/2", s)
	}
	sh := Shard{Index: i, Count: n}
	if n < 1 {
		return Shard{}, fmt.Errorf("shard %q: N must be at least 1", s)
	}
	return sh, sh.validate()
}

func (s Shard) count() int { return max(s.Count, 1) }

func (s Shard) validate() error {
	switch {
	case s.Count < 0 || s.Count > MaxShards:
		return fmt.Errorf("shard count %d outside [1, %d]", s.Count, MaxShards)
	case s.Index < 0 || s.Index >= s.count():
		return fmt.Errorf("shard index %d outside [0, %d)", s.Index, s.count())
	case s.Epoch < 0 || s.Epoch > maxEpoch:
		return fmt.Errorf("layout epoch %d outside [0, %d]", s.Epoch, maxEpoch)
	}
	return nil
}

// Layout is the layout s belongs to.
func (s Shard) Layout() Layout { return Layout{Shards: s.count(), Epoch: s.Epoch} }

// String is "i/N" (with "@epoch" when the epoch is not 0).
func (s Shard) String() string {
	if s.Epoch == 0 {
		return fmt.Sprintf("%d/%d", s.Index, s.count())
	}
	return fmt.Sprintf("%d/%d@%d", s.Index, s.count(), s.Epoch)
}

// plain reports whether s is the unsharded agent of epoch 0, whose rule
// ids, subjects and store incarnations are those of a deployment without
// shards.
func (s Shard) plain() bool { return s.count() == 1 && s.Epoch == 0 }

// token is the group's suffix without '#', also its subject token.
func (s Shard) token() string { return fmt.Sprintf("e%d-%dof%d", s.Epoch, s.Index, s.count()) }

// Group returns the id of rule's ledger group of this shard: rule itself
// when s is plain, else rule + "#" + token. Rule ids never hold '#'
// (rules.Validate), so a group id is never a rule's.
func (s Shard) Group(rule string) string {
	if s.plain() {
		return rule
	}
	return rule + "#" + s.token()
}

// ownGroup reports whether id is a group id of this shard.
func (s Shard) ownGroup(id string) bool {
	_, suf, ok := strings.Cut(id, "#")
	if s.plain() {
		return !ok
	}
	return ok && suf == s.token()
}

// ruleOf returns the rule id of a group id (what the store's markers are
// named by).
func ruleOf(group string) string {
	r, _, _ := strings.Cut(group, "#")
	return r
}

// Owns reports whether key (a bucket key, redisstore.Key) is this shard's.
func (s Shard) Owns(key string) bool {
	return s.count() == 1 || redisstore.ShardOf(key, s.count()) == s.Index
}

// ReportSubject is the subject region's shard s publishes its reports on:
// ReportSubject(region) when s is plain, else that plus "." + token.
func (s Shard) ReportSubject(region string) string {
	if s.plain() {
		return ReportSubject(region)
	}
	return ReportPrefix + region + "." + s.token()
}

// reportWildcard is the subscription of s to its group's reports.
func (s Shard) reportWildcard() string {
	if s.plain() {
		return ReportPrefix + "*"
	}
	return ReportPrefix + "*." + s.token()
}

// regionOf returns the region of a report subject of s's group.
func (s Shard) regionOf(subject string) string {
	r := strings.TrimPrefix(subject, ReportPrefix)
	if !s.plain() {
		r = strings.TrimSuffix(r, "."+s.token())
	}
	return r
}

// storeInc maps a ledger incarnation of s's group to the store's: inc in
// epoch 0, epoch*epochIncs + inc after (an incarnation beyond the epoch's
// room is refused: the store would order it with the next epoch's).
func (s Shard) storeInc(inc uint64) (uint64, error) {
	if s.Epoch == 0 {
		return inc, nil
	}
	if inc >= epochIncs {
		return 0, fmt.Errorf("%w: incarnation %d beyond the %d a layout epoch may use; change the layout (ChangeLayout) to start a new epoch", ErrLayout, inc, epochIncs)
	}
	return uint64(s.Epoch)*epochIncs + inc, nil
}

// ledgerVersion maps a version the store holds back to the ledger's; one
// of another epoch (an earlier layout's, lower; a later one's, only if the
// change procedure was not followed) is none of this group's: zero.
func (s Shard) ledgerVersion(v redisstore.Version) redisstore.Version {
	if s.Epoch == 0 {
		return v
	}
	lo := uint64(s.Epoch) * epochIncs
	if v.Inc < lo || v.Inc >= lo+epochIncs {
		return redisstore.Version{}
	}
	return redisstore.Version{Inc: v.Inc - lo, Seq: v.Seq}
}

// shardStore is the Store of a shard that is not plain: it names markers
// by the rule (not the group) and maps incarnations (storeInc).
type shardStore struct {
	Store
	s Shard
}

func (st shardStore) WriteMarker(ctx context.Context, group string, m redisstore.Marker) (redisstore.Version, error) {
	inc, err := st.s.storeInc(m.Inc)
	if err != nil {
		return redisstore.Version{}, err
	}
	m.Inc = inc
	v, err := st.Store.WriteMarker(ctx, ruleOf(group), m)
	return st.s.ledgerVersion(v), err
}

// DeleteMarker deletes the marker copies of group's rule in the shard's
// slots (the store's WithMarkerSlots).
func (st shardStore) DeleteMarker(ctx context.Context, group string) error {
	md, ok := st.Store.(markerDeleter)
	if !ok {
		return errNoMarkerDelete
	}
	return md.DeleteMarker(ctx, ruleOf(group))
}

// MarkerRules lists the rules with a marker copy in the shard's slots, as
// the shard's group ids.
func (st shardStore) MarkerRules(ctx context.Context) ([]string, error) {
	md, ok := st.Store.(markerDeleter)
	if !ok {
		return nil, errNoMarkerDelete
	}
	rs, err := md.MarkerRules(ctx)
	for i, r := range rs {
		rs[i] = st.s.Group(r)
	}
	return rs, err
}

func (st shardStore) records(recs []redisstore.ShareRecord) ([]redisstore.ShareRecord, error) {
	out := make([]redisstore.ShareRecord, len(recs))
	for i, r := range recs {
		inc, err := st.s.storeInc(r.Inc)
		if err != nil {
			return nil, err
		}
		r.Inc = inc
		out[i] = r
	}
	return out, nil
}

func (st shardStore) WriteShares(ctx context.Context, group string, recs []redisstore.ShareRecord) ([]redisstore.Version, error) {
	rs, err := st.records(recs)
	if err != nil {
		return nil, err
	}
	vs, err := st.Store.WriteShares(ctx, ruleOf(group), rs)
	for i := range vs {
		vs[i] = st.s.ledgerVersion(vs[i])
	}
	return vs, err
}

// WriteWindowShares passes window records to the store's WriteWindowShares
// where it has one (else WriteShares, as the agent would).
func (st shardStore) WriteWindowShares(ctx context.Context, group string, recs []redisstore.ShareRecord) ([]redisstore.WindowApplied, error) {
	ws, ok := st.Store.(windowStore)
	if !ok {
		vs, err := st.WriteShares(ctx, group, recs)
		return driver.Versions(vs), err
	}
	rs, err := st.records(recs)
	if err != nil {
		return nil, err
	}
	out, err := ws.WriteWindowShares(ctx, ruleOf(group), rs)
	for i := range out {
		out[i].Version = st.s.ledgerVersion(out[i].Version)
	}
	return out, err
}

// shardSource renames every rule to its group id of the shard.
type shardSource struct {
	rules.Source
	s Shard
}

func (src shardSource) Run(ctx context.Context, update func([]rules.Rule)) error {
	return src.Source.Run(ctx, func(rs []rules.Rule) {
		out := make([]rules.Rule, len(rs))
		for i, r := range rs {
			r.ID = src.s.Group(r.ID)
			out[i] = r
		}
		update(out)
	})
}

// ReadLayout returns the layout in etcd (Layout{Shards: 1} when there is
// none) and the key's ModRevision (0: none).
func ReadLayout(ctx context.Context, kv clientv3.KV) (Layout, int64, error) {
	resp, err := kv.Get(ctx, LayoutKey)
	if err != nil {
		return Layout{}, 0, err
	}
	if len(resp.Kvs) == 0 {
		return Layout{Shards: 1}, 0, nil
	}
	l, err := decodeLayout(resp.Kvs[0].Value)
	return l, resp.Kvs[0].ModRevision, err
}

func decodeLayout(b []byte) (Layout, error) {
	var l Layout
	if err := json.Unmarshal(b, &l); err != nil {
		return Layout{}, fmt.Errorf("%w: %s: %w", ErrLayout, LayoutKey, err)
	}
	if err := l.validate(); err != nil {
		// (At most 256 bytes of the document: it is etcd's, and could be
		// a megabyte logged at every poll.)
		return Layout{}, fmt.Errorf("%w: %s holds an invalid layout %.256q: %w", ErrLayout, LayoutKey, b, err)
	}
	return l, nil
}

// ChangeLayout sets the layout to shards processes per region in the next
// epoch (compare-and-swap on LayoutKey) and returns it. Run it only as the
// procedure of the package doc ("Changing the layout") says: with every
// agent of the old layout stopped in every region.
func ChangeLayout(ctx context.Context, kv clientv3.KV, shards int) (Layout, error) {
	for {
		cur, rev, err := ReadLayout(ctx, kv)
		if err != nil {
			return Layout{}, err
		}
		next := Layout{Shards: shards, Epoch: cur.Epoch + 1}
		if err := next.validate(); err != nil {
			return Layout{}, fmt.Errorf("%w: cannot change to %d shards in epoch %d: %v", ErrLayout, shards, next.Epoch, err)
		}
		b, _ := json.Marshal(next)
		tr, err := kv.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(LayoutKey), "=", rev)).
			Then(clientv3.OpPut(LayoutKey, string(b))).Commit()
		if err != nil {
			return Layout{}, err
		}
		if tr.Succeeded {
			return next, nil
		}
	}
}

// checkLayout compares the layout document read (b, nil: none) with s's.
func (s Shard) checkLayout(b []byte) error {
	l := Layout{Shards: 1}
	if b != nil {
		var err error
		if l, err = decodeLayout(b); err != nil {
			return err
		}
	}
	if l != s.Layout() {
		return fmt.Errorf("%w: etcd %s says %d shards per region in epoch %d, this agent is shard %s: run the layout's shards (see docs/operations.md, Shards)",
			ErrLayout, LayoutKey, l.Shards, l.Epoch, s)
	}
	return nil
}

// layoutLost runs on the loop goroutine when the registry found another
// layout in etcd: every ledger is dropped (its marker lapses within the
// lease, the store enforcing the floors), and Start is refused until the
// layout is this agent's again.
func (a *Agent) layoutLost(err error) {
	a.m.rejected.WithLabelValues(ReasonLayout).Inc()
	a.logs.Log(slog.LevelError, "layout", "shard layout changed in etcd; dropping every ledger", logKeyErr, err)
	for id, st := range a.rules {
		if st.Led != nil {
			a.drv.Remove(id)
			st.Rule = a.drv.Add(id)
			st.newLedger()
		}
	}
	a.publishSnapshot()
}
