package driver

import "time"

// DefaultWitnessLease is the agent's and the simulator's
// ledger.Config.WitnessLease: between two regions, a region cut off from
// its peer and from etcd keeps its position this long after its last
// renewal of its witness key, and a region lost for good is reclaimed by
// the survivor about this long (times (1+rho)/(1-rho), plus the margin)
// after it was last heard. Cuts shorter than it cost nothing; a region
// that reaches etcd keeps its position through a cut of any length.
const DefaultWitnessLease = time.Minute

// The witness keys (ledger.Take, the sync/ledger package doc: Two regions
// and the witness). The port renews this region's key and reads the
// peers'; the driver hands what it learns to every ledger, and to every
// ledger started later, and sends a ledger's take to the port, one per
// region at a time.
type witnessState struct {
	sent   time.Duration           // the newest successful renewal's send time (0: none since the key was lost)
	seen   map[string]witnessSight // peer region -> its key as first seen
	taking map[string]bool         // peer regions whose key a Ports.Take is taking
}

type witnessSight struct {
	rev int64
	at  time.Duration
}

// WitnessRenewed feeds a renewal of this region's witness key that
// succeeded, sent at sent (Ports.Now) to every ledger.
func (d *Driver) WitnessRenewed(sent time.Duration) {
	d.w.sent = max(d.w.sent, sent)
	d.eachLedger(func(r *Rule) { r.Led.WitnessRenewed(sent) })
}

// WitnessLost tells every ledger that this region's key was taken (a
// renewal found it at another revision than the one written last). Call
// it before feeding any renewal of the key written again.
func (d *Driver) WitnessLost() {
	d.w.sent = 0
	d.eachLedger(func(r *Rule) { r.Led.WitnessLost() })
}

// WitnessSeen feeds peer region's witness key at revision rev (0: no key)
// as read now; a revision already seen keeps the time it was first seen.
func (d *Driver) WitnessSeen(region string, rev int64) {
	if d.w.seen == nil {
		d.w.seen = map[string]witnessSight{}
	}
	sg, ok := d.w.seen[region]
	if !ok || sg.rev != rev {
		sg = witnessSight{rev: rev, at: d.p.Now()}
		d.w.seen[region] = sg
	}
	d.eachLedger(func(r *Rule) { r.Led.WitnessSeen(sg.at, region, rev) })
}

// Taken ends a Ports.Take: ok if region's key was at rev and is now this
// region's. Every ledger then freezes its incarnation of that region if it
// may (ledger.WitnessTaken), and the driver flushes.
func (d *Driver) Taken(region string, rev int64, ok bool) {
	delete(d.w.taking, region)
	if !ok {
		return
	}
	now := d.p.Now()
	d.eachLedger(func(r *Rule) { d.collect(r, r.Led.WitnessTaken(now, region, rev)) })
	d.Flush()
}

// eachLedger calls fn for every rule with a ledger, in rule order.
func (d *Driver) eachLedger(fn func(r *Rule)) {
	for _, id := range d.IDs() {
		if r := d.rules[id]; r.Led != nil {
			fn(r)
		}
	}
}

// feedWitness gives a new ledger what the driver knows of the witness keys.
func (d *Driver) feedWitness(r *Rule) {
	if d.w.sent > 0 {
		r.Led.WitnessRenewed(d.w.sent)
	}
	for region, sg := range d.w.seen {
		r.Led.WitnessSeen(sg.at, region, sg.rev)
	}
}

// take hands a ledger's take to the port unless one of that region is in flight.
func (d *Driver) take(region string, rev int64) {
	if d.w.taking[region] {
		return
	}
	if d.w.taking == nil {
		d.w.taking = map[string]bool{}
	}
	d.w.taking[region] = true
	d.p.Take(region, rev)
}

// SeenWitness returns the revision of peer region's witness key as last
// fed (WitnessSeen), 0 if none.
func (d *Driver) SeenWitness(region string) int64 { return d.w.seen[region].rev }
