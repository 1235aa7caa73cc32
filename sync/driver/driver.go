// Package driver is the sync agent's ordering logic without I/O: one region's
// ledgers (one per coordinated rule) and the order in which their outputs
// reach the store, the network and the reclaim registry. Production
// (sync/agent: Redis, NATS, etcd) and the simulator (simulations/strategy:
// the Go reference model of the store, a virtual WAN, a virtual registry) run
// the same Driver and differ only in their Ports.
//
// The sequence, for every call that feeds a ledger (Tick, Receive,
// Confirmed, Contributed, Records, StoreReset, Taken):
//
//  1. collect: each ledger Output is split into its parts. Store writes and
//     reports wait in the pending batch; contributions go to
//     Ports.Contribute and a close request to Ports.Close (at most one of
//     each in flight per rule: the ledger repeats them until recorded), a
//     take of a peer's witness key to Ports.Take (one per peer region); a
//     fenced ledger is dropped and Ports.Fenced starts a new incarnation.
//  2. flush: the batch's writes go to Ports.Write. What it returns (a store
//     that answers synchronously) is fed back per rule: first every window
//     record the store refused as below its key's use (Ledger.Hold), then
//     the confirmations (ledger.SharesApplied, one call per rule), so a
//     confirmation never publishes a gift the store refused; their outputs
//     are collected again, until no write is left. A store that answers
//     later calls Confirmed, and the batch's reports wait for its answers
//     (at most until the next Tick), so that with either store a tick's
//     report and its writes' confirmations leave together. Neither is built
//     when it is due (ledger.DeferReports): the ledger owes them, and one
//     report carrying both is built when the batch leaves, so no report of
//     every key is held built while the store answers. Then every report
//     of the batch leaves in one message (Ports.Publish), less what a
//     later report of the same rule carries again (supersede); an owed
//     report of more than SendWindow keys is built and sent a part at a
//     time, each part a message of its own after the others.
//
// Tick (TickFrom: the usage as a sequence) feeds the enforcers' usage of
// the interval (every key with usage: a key is coordinated from its first
// usage), ticks every ledger in rule order (after UsageLate, each told
// that the interval's usage is incomplete: the demand estimates wait)
// and asks Ports.Start for an incarnation of every rule without a ledger.
//
// A Driver is not safe for concurrent use: it belongs to one goroutine (the
// agent's loop), and ports hand results back on it. Time comes from
// Ports.Now, read where the agent reads its clock.
package driver

import (
	"errors"
	"iter"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

// Production defaults of the agent's own settings (the ledger's are in
// ledger.DefaultConfig). sync/agent.DefaultConfig and the simulator's
// scenario defaults both use them.
const (
	DefaultInterval     = 100 * time.Millisecond
	DefaultRegistryPoll = 500 * time.Millisecond
	DefaultEtcdTimeout  = 5 * time.Second
	// ReceiveWindow is the most keys of a peer's report held decoded: the
	// agent and the simulator decode a message a window of keys at a time
	// (wire.DecodeWindowsFromOwned, each window read as a part of a report
	// its sender split) and merge each with Receive. 4,096 keys decoded
	// are about 520 KB at three regions (BenchmarkDecode in sync/wire,
	// reader eu-west: 127 KB per 1,000 keys); a part of NATS's default max
	// payload (1 MiB) holds about 24,000 (42 B a key, BenchmarkEncode).
	ReceiveWindow = 4096
	// SendWindow is the most keys of a report built at once (publish):
	// about 690 KB encoded at three regions (42 B a key, BenchmarkEncode
	// in sync/wire), within one part of NATS's
	// default max payload, so a report is cut about as wire.EncodeParts
	// would cut it.
	SendWindow = 16384
)

// Reasons a peer's rule report is dropped (Ports.Rejected).
const (
	ReasonMalformed   = "malformed"          // does not decode, or its sender is not its subject's region
	ReasonUnknownRule = "unknown_rule"       // a rule this region does not coordinate
	ReasonUnknownReg  = "unknown_region"     // sender or a named region not in the rule
	ReasonStale       = "stale_incarnation"  // an older incarnation than the one paired with
	ReasonFrozen      = "frozen_incarnation" // an incarnation frozen for reclaim
	ReasonBackwards   = "backwards"          // a cumulative counter went down
	ReasonReplayed    = "replayed"           // older than (or a repeat of) a report already accepted
	ReasonImplausible = "implausible"        // counters its sender could not hold (ledger.ErrImplausible)
	ReasonRegions     = "region_list"        // the sender lists the rule's regions otherwise (wire.ErrRegions)
	ReasonOther       = "other"
)

// Ports are the driver's I/O. Every method is called on the driver's
// goroutine and must not call back into the Driver before returning
// (results come back later through Confirmed, Contributed, Closed, Started,
// Records).
type Ports interface {
	// Now is the region's agent clock: monotonic, since the agent started.
	Now() time.Duration
	// Write applies the store writes of one flush, per rule. It returns the
	// answers it already has: per rule, the version the store holds for
	// each key written (or the marker, ledger.MarkerKey) and the window
	// records it refused (Applied). A store that answers later returns nil
	// and calls Confirmed.
	Write(writes map[*Rule][]ledger.Write) map[*Rule]Applied
	// Publish sends one message with the batch's reports to every peer.
	// It must not keep m's slices past its return: the part of a report
	// built a part at a time is reused for the next (publish).
	Publish(m wire.Message)
	// Contribute adds a frozen incarnation's contributions to r's registry
	// and then calls Contributed with the records it got (none on failure).
	Contribute(r *Rule, cs []ledger.Contribution)
	// Close records in r's registry that by's marker is confirmed, then
	// calls Closed (whatever the outcome: the ledger asks again).
	Close(r *Rule, by ledger.Incarnation)
	// Start obtains an incarnation for r, which has no ledger, and calls
	// Started with its ledger; it decides when to try (backoff, a store
	// run id to start with) and ignores calls while one is in flight.
	Start(r *Rule)
	// Fenced tells that r's ledger (incarnation inc) was fenced and
	// dropped; by is the store's marker that ended it when it was one the
	// ledger never wrote (ledger.Output.Superseded), zero otherwise. The
	// port usually calls Start.
	Fenced(r *Rule, inc ledger.Incarnation, by ledger.Version)
	// Rejected tells that peer's report of rule was dropped, with a Reason.
	Rejected(reason, peer, rule string, err error)
	// Reclaimed tells that a completed reclaim record names r's incarnation
	// among its recipients (called each time such a record is fed).
	Reclaimed(r *Rule, rec ledger.Record)
	// Take replaces peer region's witness key by compare-and-swap, if it
	// is still at revision rev, then calls Taken (witness.go). At most one
	// per region is in flight.
	Take(region string, rev int64)
}

// Rule is one coordinated rule as the driver holds it.
type Rule struct {
	ID string
	// Led is the rule's ledger; nil while an incarnation is being started
	// (or after fencing).
	Led *ledger.Ledger

	// regions is Led's region list as the wire names it (nil without Led).
	regions *wire.Regions

	contributing bool
	closing      bool
	fedRev       int64
	fresh        map[string]freshness // peer region -> newest report accepted
}

// RuleRecords is one rule's reclaim registry as a poll reads it.
type RuleRecords struct {
	Revision int64 // changes whenever the rule's registry does
	Records  []ledger.Record
}

// Usage is the usage of one key in one interval.
type Usage struct {
	Rule, Key          string
	Rate               float64 // the rule's rate per second: a token bucket's refill, a window's limit per window
	Admitted, Rejected int64
}

// Driver sequences one region's ledgers. See the package doc.
type Driver struct {
	region string
	p      Ports
	rules  map[string]*Rule

	writes  map[*Rule][]ledger.Write
	reports []wire.RuleReport
	// waiting counts the rules whose writes a store answering later
	// (Ports.Write returned nil) has not answered yet: the batch's reports
	// wait for those answers, or for the next Tick, so that a report and
	// the report of its writes' confirmations leave in one message, as they
	// do with a store that answers in Write.
	waiting int
	// sendWindow is the most keys of a report built at once (SendWindow
	// unless SetSendWindow changed it).
	sendWindow int
	// w is what the port told of the witness keys (witness.go).
	w witnessState
	// usageLate is set by UsageLate for the next Tick.
	usageLate bool
}

// New returns a driver for region with no rules.
func New(region string, p Ports) *Driver {
	return &Driver{region: region, p: p, rules: map[string]*Rule{}, sendWindow: SendWindow}
}

// SetSendWindow sets the most keys of a report built and sent at once
// (default SendWindow; n < 1 means 1). Tests and the simulator's
// fault tests set it low, so that every report leaves in parts.
func (d *Driver) SetSendWindow(n int) { d.sendWindow = max(n, 1) }

// Add returns the rule with id, adding it (without a ledger) if absent.
func (d *Driver) Add(id string) *Rule {
	if r := d.rules[id]; r != nil {
		return r
	}
	r := &Rule{ID: id, fresh: map[string]freshness{}}
	d.rules[id] = r
	return r
}

// Remove drops rule id and its ledger; late results for it are ignored.
func (d *Driver) Remove(id string) { delete(d.rules, id) }

// Rule returns rule id, or nil.
func (d *Driver) Rule(id string) *Rule { return d.rules[id] }

// IDs returns the rules' ids in order.
func (d *Driver) IDs() []string { return slices.Sorted(maps.Keys(d.rules)) }

// current reports whether r is still the driver's rule of its id.
func (d *Driver) current(r *Rule) bool { return r != nil && d.rules[r.ID] == r }

// Started installs led as r's ledger (the answer to Ports.Start) and runs
// its first Tick at once, with a flush: the boot marker (and the first
// report) go out one registry round trip after the start instead of at the
// next interval, so that a region's store leaves its floor that much
// sooner, at a first start and after a fence alike. It returns false if r
// is no longer the driver's.
func (d *Driver) Started(r *Rule, led *ledger.Ledger) bool {
	if !d.current(r) {
		return false
	}
	r.Led, r.fedRev = led, 0
	d.feedWitness(r)
	led.DeferReports() // a Tick's report is built when the batch leaves (publish)
	// An error leaves nil: the rule's reports then fail to encode
	// (wire.ErrInvalid, Ports.Publish's to report) and its peers' are not
	// read. The list reads peers' reports as this region (ReadBy): of each
	// key's counters only those naming it, the only ones its ledger reads.
	r.regions = nil
	if g, err := wire.NewRegions(led.RegionNames()); err == nil {
		r.regions, _ = g.ReadBy(led.Incarnation().Region)
	}
	d.collect(r, led.Tick(d.p.Now()))
	d.Flush()
	return true
}

// Lists gives the region list of each rule with a ledger, to read the
// peers' reports with (wire.Decode), as this region reads them
// (wire.Regions.ReadBy).
func (d *Driver) Lists() wire.Lists {
	return func(rule string) *wire.Regions {
		if r := d.rules[rule]; r != nil && r.Led != nil {
			return r.regions
		}
		return nil
	}
}

// Tick runs one interval at now: usage, every ledger's Tick, a flush.
// Usage of a rule without a ledger is dropped.
func (d *Driver) Tick(usage []Usage) { d.TickFrom(slices.Values(usage)) }

// UsageLate tells every ledger that some of the usage of the interval the
// next Tick ends is late (ledger.UsageLate: the demand estimates wait for
// it, and the usage fed meanwhile is kept). The agent calls it while an
// enforcer it hears every flush has not been heard for more than a flush
// (sync/agent, Config.UsageGrace).
func (d *Driver) UsageLate() { d.usageLate = true }

// TickFrom is Tick with the usage as a sequence, fed to the ledgers in its
// order: a caller holding the interval's usage in maps of its own (the
// agent) passes them without building a slice of every key.
func (d *Driver) TickFrom(usage iter.Seq[Usage]) {
	// Reports still waiting for a store's answer wait no longer than an
	// interval: they leave now, and an answer still to come counts for
	// nothing (the store may never answer).
	d.waiting = 0
	d.publish()
	now := d.p.Now()
	var last *Rule
	for u := range usage {
		r := last
		if r == nil || r.ID != u.Rule {
			r = d.rules[u.Rule]
			last = r
		}
		if r != nil && r.Led != nil {
			r.Led.Usage(now, u.Key, u.Rate, u.Admitted, u.Rejected)
		}
	}
	late := d.usageLate
	d.usageLate = false
	for _, id := range d.IDs() {
		r := d.rules[id]
		if r.Led == nil {
			d.p.Start(r)
			continue
		}
		if late {
			r.Led.UsageLate()
		}
		d.collect(r, r.Led.Tick(now))
	}
	d.Flush()
}

// StoreReset tells every ledger that the store now has run id runID (it
// restarted empty). The writes wait for the next flush (Tick calls one).
func (d *Driver) StoreReset(runID string) {
	now := d.p.Now()
	for _, id := range d.IDs() {
		if r := d.rules[id]; r.Led != nil {
			d.collect(r, r.Led.StoreReset(now, runID))
		}
	}
}

// Receive merges a peer's message into the ledgers and flushes. It
// reports whether any rule report of it was accepted.
func (d *Driver) Receive(m wire.Message) bool {
	now := d.p.Now()
	accepted := false
	for _, rr := range m.Rules {
		r := d.rules[rr.Rule]
		if r == nil {
			d.p.Rejected(ReasonUnknownRule, m.From, rr.Rule, errors.New("rule not coordinated here"))
			continue
		}
		if r.Led == nil {
			continue // starting: the peer repeats itself
		}
		if rr.Err != nil { // not read against our region list (wire.Decode)
			d.p.Rejected(RejectReason(rr.Err), m.From, rr.Rule, rr.Err)
			continue
		}
		if err := r.fresh[m.From].check(rr.Report); err != nil {
			d.p.Rejected(ReasonReplayed, m.From, rr.Rule, err)
			continue
		}
		out, err := r.Led.Receive(now, rr.Report)
		if err != nil && !errors.Is(err, ledger.ErrFenced) {
			d.p.Rejected(RejectReason(err), m.From, rr.Rule, err)
		}
		if err == nil {
			accepted = true
			r.fresh[m.From] = r.fresh[m.From].accepted(rr.Report)
		}
		d.collect(r, out)
	}
	d.Flush()
	return accepted
}

// Confirmed feeds a store's answer that arrived after Ports.Write returned
// and flushes. Confirmations of an earlier incarnation are ignored by the
// ledger.
func (d *Driver) Confirmed(r *Rule, ap Applied) {
	if d.waiting > 0 {
		d.waiting--
	}
	if !d.current(r) || r.Led == nil {
		if d.waiting == 0 {
			d.publish()
		}
		return
	}
	d.applied(r, d.p.Now(), ap)
	d.Flush()
}

// applied feeds r's ledger the store's answer: the refusals (Ledger.Hold)
// before the confirmations, so that a confirmation never publishes a gift
// the store refused; one SharesApplied call for the whole answer (one
// report, not one per confirmed key).
func (d *Driver) applied(r *Rule, now time.Duration, ap Applied) {
	for _, f := range ap.Refused {
		r.Led.Hold(now, f.Key, f.Need, f.Until)
	}
	if len(ap.Confirmations) > 0 {
		d.collect(r, r.Led.SharesApplied(now, ap.Confirmations))
	}
}

// Contributed ends r's Ports.Contribute call with the records it got,
// feeds them and flushes.
func (d *Driver) Contributed(r *Rule, recs []ledger.Record) {
	r.contributing = false
	if !d.current(r) {
		return
	}
	for _, rec := range recs {
		d.recorded(r, rec)
	}
	d.Flush()
}

// Closed ends r's Ports.Close call.
func (d *Driver) Closed(r *Rule) { r.closing = false }

// Records feeds a registry poll: the records of every rule whose revision
// changed since it was last fed. Then it flushes.
func (d *Driver) Records(recs map[string]RuleRecords) {
	for _, id := range slices.Sorted(maps.Keys(recs)) {
		r := d.rules[id]
		rr := recs[id]
		if r == nil || r.Led == nil || rr.Revision == r.fedRev {
			continue
		}
		r.fedRev = rr.Revision
		for _, rec := range rr.Records {
			d.recorded(r, rec)
		}
	}
	d.Flush()
}

func (d *Driver) recorded(r *Rule, rec ledger.Record) {
	if r.Led == nil {
		return
	}
	if rec.Complete && slices.Contains(rec.Recipients, r.Led.Incarnation()) {
		d.p.Reclaimed(r, rec)
	}
	d.collect(r, r.Led.ReclaimRecorded(d.p.Now(), rec))
}

// collect queues out's writes and report and hands its registry requests
// and fencing to the ports.
func (d *Driver) collect(r *Rule, out ledger.Output) {
	if r.Led == nil {
		return
	}
	if len(out.Writes) > 0 {
		if d.writes == nil {
			d.writes = map[*Rule][]ledger.Write{}
		}
		if w := d.writes[r]; len(w) > 0 {
			d.writes[r] = append(w, out.Writes...)
		} else {
			d.writes[r] = out.Writes // the ledger's own (a new slice per call): no copy
		}
	}
	if out.Report != nil {
		d.reports = append(d.reports, wire.RuleReport{Rule: r.ID, Regions: r.regions, Report: *out.Report})
	}
	if len(out.Contributions) > 0 && !r.contributing {
		r.contributing = true
		d.p.Contribute(r, slices.Clone(out.Contributions))
	}
	if out.Close != (ledger.Incarnation{}) && !r.closing {
		r.closing = true
		d.p.Close(r, out.Close)
	}
	if out.Take.Region != "" {
		d.take(out.Take.Region, out.Take.Rev)
	}
	if out.Fenced {
		inc := r.Led.Incarnation()
		r.Led = nil
		d.p.Fenced(r, inc, out.Superseded)
	}
}

// Flush applies the pending writes, feeds back the store's answers
// (refusals, then confirmations), and publishes the pending reports in one
// message, unless a store that answers later still owes answers (then the
// last answer, Confirmed, or the next Tick publishes them).
func (d *Driver) Flush() {
	for len(d.writes) > 0 {
		writes := d.writes
		d.writes = nil
		for r := range writes {
			if r.Led == nil {
				delete(writes, r)
			}
		}
		if len(writes) == 0 {
			break
		}
		res := d.p.Write(writes)
		if res == nil {
			d.waiting += len(writes) // Confirmed, once per rule written
		}
		now := d.p.Now()
		for _, r := range slices.SortedFunc(maps.Keys(res), func(x, y *Rule) int { return strings.Compare(x.ID, y.ID) }) {
			if r.Led == nil {
				continue
			}
			d.applied(r, now, res[r])
		}
	}
	if d.waiting == 0 {
		d.publish()
	}
}

// publish sends the pending reports in one message, less what a later
// report of the same rule carries again (supersede). The reports the
// ledgers owe (ledger.DeferReports: a Tick's, its confirmations') are
// built now, one per ledger, last: no report is held built while the
// store answers a tick's writes (at 100,000 keys with every key written,
// about a second of store calls and 70-270 B per key), and it has the
// state of the moment it leaves under a sequence number of that moment.
//
// An owed report of more than SendWindow keys (SetSendWindow) is built
// and sent a part of SendWindow keys at a time (ledger.OwedReportParts;
// each part is a message of its own, after the pending reports, and is
// sent before the next is built, whose slices it reuses), so that no
// report of every key is held built while it is encoded and sent.
func (d *Driver) publish() {
	now := d.p.Now()
	for _, id := range d.IDs() {
		r := d.rules[id]
		if r.Led == nil {
			continue
		}
		split := false
		for rep, more := range r.Led.OwedReportParts(now, d.sendWindow) {
			rr := wire.RuleReport{Rule: r.ID, Regions: r.regions, Report: *rep}
			if !more && !split {
				d.reports = append(d.reports, rr)
				continue
			}
			if !split {
				split = true
				d.sendPending()
			}
			d.p.Publish(wire.Message{From: d.region, Rules: []wire.RuleReport{rr}})
		}
	}
	d.sendPending()
}

// sendPending publishes the pending reports in one message, less what a
// later report of the same rule carries again (supersede).
func (d *Driver) sendPending() {
	if len(d.reports) > 0 {
		rs := supersede(d.reports)
		d.reports = nil
		d.p.Publish(wire.Message{From: d.region, Rules: rs})
	}
}

// RejectReason maps a ledger.Receive error, or a RuleReport.Err of
// wire.Decode, to its Reason.
func RejectReason(err error) string {
	switch {
	case errors.Is(err, wire.ErrRegions):
		return ReasonRegions
	case errors.Is(err, wire.ErrUnknownRule):
		return ReasonUnknownRule
	case errors.Is(err, ledger.ErrUnknownRegion):
		return ReasonUnknownReg
	case errors.Is(err, ledger.ErrMalformed):
		return ReasonMalformed
	case errors.Is(err, ledger.ErrStaleIncarnation):
		return ReasonStale
	case errors.Is(err, ledger.ErrFrozenIncarnation):
		return ReasonFrozen
	case errors.Is(err, ledger.ErrBackwards):
		return ReasonBackwards
	case errors.Is(err, ledger.ErrImplausible):
		return ReasonImplausible
	}
	return ReasonOther
}
