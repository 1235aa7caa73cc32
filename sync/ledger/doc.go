// Package ledger is the share ledger of the sync agent: a pure state machine
// that moves ownership of each global limit between regions without the sum of
// the enforced shares ever exceeding the limit.
//
// Nothing here reads a clock, does I/O, starts goroutines or draws random
// numbers. Inputs are method calls carrying the agent's local monotonic time
// (Tick, Usage, Receive, ShareApplied, ReclaimRecorded, StoreReset); outputs
// are returned values (store writes, a report to publish, contributions for
// the reclaim registry, and whether the incarnation has fenced itself). The
// agent wraps it with Redis, NATS and etcd; the simulator drives the same code
// in virtual time.
//
// # Units and positions
//
// Per global rule and key the whole limit (rate R and capacity C) is Units
// integer units. Region i owns a floor F_i (MinShare split by weight, never
// moved) and, in its first incarnation, an initial part I_i of the rest (split
// by weight). Its base B_i is F_i + I_i (first incarnation) or F_i (later
// ones), plus what reclaim records paid it. A store enforcing u units enforces
// rate floor(R*u/Units) and capacity floor(C*u/Units), so sums of floors never
// exceed R and C when the units do not exceed Units.
//
// Ownership moves only by gifts, per pair of incarnations (i, j):
// give[i][j] (units i lowered itself by), conf[i][j] <= give[i][j] (the part
// whose lowering the store confirmed: the only counter i publishes), and
// recv[i][j] <= conf[i][j] (the largest published counter j has applied).
// Position of i for a key:
//
//	pos_i = B_i + extra_i + frozen_i + sum_j (recv[j][i] - give[i][j])
//
// where extra_i comes from reclaim records and frozen_i is the sum of the
// pair terms (recv - give) of peers i has frozen (see Reclaim).
//
// # Protocol
//
//   - Lower first. A giver raises give[i][j] and emits a share write with its
//     lowered position at once. Only after ShareApplied confirms a version at
//     least that write's does it raise conf[i][j], and only conf is reported.
//     A receiver may raise (apply a larger counter) at any time. A store may
//     refuse a lowering (a global window that has used more than the lowered
//     share allows: a write never confirmed); Hold then cancels the
//     unconfirmed part of the gift (give falls back, never below conf, and
//     pending versions are capped so a later confirmation cannot publish
//     it) and bounds gifts by what is above the hold until it ends.
//   - Reports carry cumulative counters, so merging is max(): loss,
//     duplication and reordering change nothing. A report from an unknown
//     region, a stale or frozen incarnation, malformed, with a counter lower
//     than one already applied from the same incarnation in an older report,
//     or implausible (values its sender could not hold: plausible.go) is
//     rejected whole (an error, Stats.Rejected) and changes nothing.
//     A key's demand is not one of the values checked: it is bounded
//     instead, to [0, DemandCap whole limits] (a negative one, which
//     only an estimate overflowing int64 ever made, reads as the bound:
//     Config.readDemand), and every ledger bounds its own estimates and
//     the usage it is fed the same way (saturating sums, no conversion
//     out of range: demand.go), so it never publishes a demand out of
//     range. Demand is the allocator's input only, no counter or
//     position, so invariants 1 to 3 do not read it (as with the band
//     below), and a key report with a demand out of range is merged
//     with its demand bounded: before, one key's negative demand
//     refused the whole report, its acknowledgements too, and its
//     sender's lease lapsed (TestHugeUsage). Values that are counters or
//     positions stay checked whole: a sender that publishes one out of
//     range is broken or forged, and its other keys' counters are then
//     no more trustworthy than the bad one (plausible.go).
//   - Every Tick: fold usage (admitted and rejected) into an EWMA demand
//     (units, per key, divided by the EWMA's total weight so far so that a
//     new key starts at its mean; for small limits the EWMA averages over at
//     least DemandTokens requests' worth of the limit, so a few requests a
//     second do not swing it, and silence caps it: demand.go), compute
//     targets with the injected Allocator over the live regions (heard within
//     Lease, not frozen) from their last reported positions plus our own gifts
//     in flight (with Quantum, wants that all lie within EvenBand below
//     their fair shares count as the fair shares: demand within noise of an
//     even split keeps the static split, and nothing moves or is clamped on
//     that noise), round them to whole tokens when Quantum is set (the
//     limit's capacity may change while a ledger runs: SetQuantum, which
//     changes no counter or position, so the next Tick rounds to the new
//     token; a region
//     below one token of capacity admits nothing; a region holding a token
//     keeps it unless another wants KeepToken times more, since a move
//     throws the holder's banked tokens away), and give our excess over
//     target to the regions below theirs in proportion to their deficits:
//     at once if it is more than GiftBand of the limit, else once it has
//     lasted GiftWait in a row (Config.GiftBand: one region's demand
//     report moves every other region's target a little, and at ten
//     regions the few units each then gave, each in a report all the
//     regions receive, were half the sync traffic; keys at rest and
//     whole-token keys do not wait).
//     Targets are >= 0, so nobody gives below its floor. Nobody gives to a region it does not consider live, nor to a
//     later incarnation of a region (restarted, or fenced and back) before
//     that incarnation has acknowledged one of our reports: behind a one-way
//     or flapping link it could not apply the gift, and the units would sit
//     in flight until its reclaim.
//   - Demand dead band (DemandBand, 0.25 by default: see Config). A key's
//     demand counts as changed only when the estimate moved past the band
//     from the value last reported (or to or from zero), and at one Tick
//     every DemandRefresh (3 s) past a tenth of the band, so that a demand
//     drifting within the band is not left a band away; the reported value
//     is then updated at once, and
//     every region allocates with the demands as last reported, its own
//     included (Share.Reported). Targets are a function of reported state
//     only, so they do not move on the estimate's noise, and no gift is
//     made on it. The band changes which demand the allocator sees, never
//     a counter or a position, so invariants 1 to 3 do not depend on it;
//     invariant 4 is argued for demand that holds still, which with the
//     band is reported demand. (TestRandomized's churn seeds 35 and 202
//     that stayed off the targets with a band of 0.15 were a settlement
//     going round for good, which the band did not cause: seed 1241 does
//     it without; see Settling cycles.)
//   - Reports go out at a Tick when a key changed since the last report (a
//     counter, its position, its activity or retirement, its demand past
//     the band) or, as a heartbeat carrying the acknowledgements, when
//     HeartbeatEvery has passed since the last report (with HeartbeatEvery
//     at most Interval at every Tick; 1 s by default), with the keys that
//     changed; every FullEvery-th report of Tick carries every active key
//     (and a key gone idle, in the next three such reports: idleDone),
//     so a lost report is repaired within FullEvery reports, and so does
//     the next Tick's report after a peer is heard again after a silence
//     of more than two report periods (two intervals and a half without
//     a heartbeat: one lost report is not a silence), or acknowledges one
//     of our reports after such a silence (a cut: Ledger.resync). With
//     DeferReports (the driver's) a Tick, and a confirmation below, owes
//     its report instead of building it; OwedReport builds one report for
//     all that are owed when the caller sends it, with the state and a
//     sequence number of that moment: for the proof the owed reports were
//     lost and the later one carries what they would have (a report
//     carries every key changed since the last one). OwedReportParts
//     builds it a part of keys at a time, each part with the header and
//     the sequence number: a report split into parts, as the wire splits
//     one into messages. Reports are paced to the peers'
//     acknowledgements (pace.go, Config.PaceKeys): a report carries only
//     the keys that fit in every peer's window of keys in flight, the
//     rest stay due for the next, which starts where it stopped; for the
//     proof the keys left out are a part lost.
//     ShareApplied
//     returns an immediate report when it makes gifts durable, and Receive
//     returns the raise write at once, so a gift takes about one RTT plus
//     the store write.
//
// # The store contract (the Redis script must implement it)
//
// Each region's store holds a marker (incarnation, version, default units,
// lease expiry on the store's clock) and per key a share record (units,
// version). For a key the store enforces:
//
//   - the floor, if there is no marker, or the marker's lease has expired, or
//     the key's record belongs to another incarnation than the marker;
//   - the record's units, if it has a record of the marker's incarnation;
//   - the marker's default units (the base) otherwise.
//
// A record write applies only if its version is above the stored one; a share
// change settles the bucket at the old rate up to now, sets the new rate and
// capacity and clamps the tokens, in one script; elapsed time below zero
// counts as zero. A raise adds no tokens, except once per key under a
// first incarnation's first marker, a Create the ledger flags Boot only
// while no marker of it was confirmed and no StoreReset came
// (regional/redisstore, "The boot fill"):
// a key built at the floor before it gets the tokens it would hold had it
// started at min(its units, the base); safe because before that marker is
// confirmed the incarnation has published nothing, so its published
// position is at least its base. Records of coordinated keys do not expire while their
// incarnation's marker may be in force (the agent gives them a TTL, the
// Hold, and writes them again well within it; only Release records,
// written when a key is back at its base, may expire with the bucket). A marker Create applies only to the store run (RunID) it names; a
// renewal applies only over a marker of its own incarnation. ShareApplied is
// reported whenever the store holds a version >= the written one. A write
// that has not taken effect StoreTimeout after it was issued never does.
//
// Consequences: an empty store (Redis restarted) enforces floors until the
// ledger, told by StoreReset, has re-written every key it ever wrote, has seen
// them confirmed, and only then re-creates the marker; a marker create delayed
// past a second reset is refused by its RunID; a new incarnation's marker
// turns every record of the old one into the floor at once.
//
// # Leases and self-fencing (invariant 3)
//
// Reports acknowledge, per peer incarnation, the highest report sequence heard.
// Let D = (the latest local send time of one of our reports that any peer has
// acknowledged, or the start: when the request for this incarnation was
// sent, Start.Sent) + Lease. Every Tick renews the marker with a
// store lease of (1-rho)((D-now)/(1+rho) - StoreTimeout), so in real time the
// store lease ends no later than D does. At D the store is at the floor. An
// incarnation that holds more than its floor on some key then fences: it stops
// gifting and reporting, and the agent must start a new incarnation. One that
// holds only its floor has nothing to give up and carries on (reporting, so a
// peer can acknowledge it again; its next marker is then a Create): a region
// cut off from every peer fences once, then keeps one life for the whole cut.
// A peer telling us it froze us fences us too, while that peer's
// incarnation is the newest of its region we know of (then neither of the
// two would ever take the other's gifts again, and our successor pairs
// with it anew); a freeze heard from an incarnation whose successor we
// have heard, or the registry shows registered (Start.Live, a reclaim
// record), is late or replayed, and is ignored with the rest of its
// report: the successor pairs with us, or says it froze us in its own
// reports (TestFrozenAckOfSupersededIncarnation).
//
// Heartbeats (1 s by default: see Config.HeartbeatEvery). With HeartbeatEvery
// above Interval a Tick with nothing
// changed sends no report until the heartbeat h = min(HeartbeatEvery,
// (L(1-rho)/(1+rho) - StoreTimeout - Interval)/4) has passed (Config.heartbeat:
// 685 ms at the default lease of 3 s). Safety does not depend
// on h: D and the store lease are computed from acknowledged send times
// only, as above, whatever their age. What h changes is how old the
// newest acknowledged send can be: a report is acknowledged in the peer's
// next report, within h + RTT of its arrival, and our reports are at most
// h apart, so with no loss D - now >= L - RTT - 2h, which the bound on h
// keeps above half the lease beyond StoreTimeout and Interval (a lost
// heartbeat costs h more). Every report still carries the acks, so an
// event report renews them too. The cost floor this leaves: a heartbeat
// to each of n-1 peers is 40 B of NATS framing + wire.Overhead (65 B) + the
// encoding (about 25 B + 4 B per ack: 167 B in all at ten regions,
// measured in rlsim's ten-regions), so about (n-1) * (130 + 4(n-1)) / h
// bytes a second received per region with no key changed at all: 200 B/s
// at 2 regions, 9 * 167 / 0.685 = 2,190 B/s at 10 with a 3 s lease.
// 1,500 B/s at 10 regions, events included, would need h well above 1 s,
// hence a lease of 5 s or more, and fewer event reports than a region's
// gifts, their receivers' raises and its demand moves make now (about
// 5.7 KB/s received per region at ten regions, rlsim ten-regions), or acks
// sent only to the peer they concern (a per-recipient message instead of
// one report to all).
// Liveness with a heartbeat: invariant 4's steps that wait for a report
// or an acknowledgement take h + RTT instead of I + RTT (gifts and raises
// still go out at the next Tick): T_heal has P = max(I, h) in step 2. With
// h = 207 ms (the harness's lease of 1 s) its bound is 1.52 s instead of
// 1.305 s, and TestPartitionDuringShift runs with and without the
// heartbeat against it (worst 1.41 s at five regions with it, 1.29 s
// without; before the resync of step 2: 1.39 s at three regions, 1.52 s
// at five).
//
// Why the heartbeat and the band were off by default until 3 December 2026: with whole tokens
// (Quantum) the targets depend on the pool each region computes from its
// views, and a heartbeat changes when views are refreshed. In
// TestRandomized's seed 108 (burst 4, five regions, heartbeat only,
// before the resync) a region gives its token to two regions at once;
// each, not yet seeing the other's raise, computes a smaller pool in
// which the token belongs back to the giver, and gives it back; the giver
// then sees the whole pool again: the token went round every 200 ms for
// good (give, Config.wholeTokens). With the band at 0.25 and the
// heartbeat at 1 s, seed 106 (burst 4) still ended off its targets among
// the default 400 seeds; over 2,000 seeds 106 and 631 (burst 4), and at
// 0.15, 617 (burst 4) and 1414 (a settlement of 1,115 units still moving
// 7.7 s after the heal, bound 7.32 s). Without either setting, seeds 1 to
// 2,000 failed one, 1929 (burst 4), and the default 400 none. The
// whole-token cases were one mechanism, in the defaults too: gifts in
// flight between two other regions, missing from a region's pool. give
// now holds whole-token gifts while a key's views disagree (invariant 4,
// step 4), and seeds 1 to 2,000 pass with the defaults and with the band
// at 0.25 and the heartbeat at 1 s (TestWholeTokenViews replays 1929, 106
// and 631). At 0.15 with the heartbeat, 617 now settles (1.5 s); 1414, a
// settlement (no Quantum), still reaches its targets 7.7 s after the heal
// against 7.32 s. Since 3 December 2026 the band (0.25, with a refresh
// every DemandRefresh of 3 s) and the heartbeat (1 s) are the defaults:
// seeds 1 to 2,000 of TestRandomized pass with them (worst heal 4.65 s,
// seed 1395, against the bound of 7.32 s; LEDGER_SEEDS=2000), and rlsim's
// sync bytes fall several times over at about the same utilization
// (Config.DemandBand has the figures). LEDGER_BAND=0 LEDGER_HEARTBEAT=0s
// runs the randomized tests as they were before.
//
// With one region there is no D (it never comes), nor with two regions
// without a witness (Config.WitnessLease 0): the marker is
// renewed with a store lease of Lease at every Tick and the incarnation
// never fences on silence. A peer freezes by silence only while a peer
// acknowledges it (below); with two regions that acknowledging peer is the
// silent one itself, and the acknowledgement came in a report heard at or
// after the acknowledged report's send time, within Lease, less than
// ReclaimAfter: so nobody ever reclaims a live incarnation of a two-region
// rule by silence, only one whose successor's marker has already floored
// its records (a newer incarnation seen, or Close). Its store lease then
// protects nothing, and a region cut off from its only peer keeps its
// position for the whole cut instead of its floor; but a dead agent's
// store falls to the floor a Lease after the last renewal, and what it
// held stays unused until the region returns. Among three regions or more the other side of a cut may be a live majority that
// acknowledges itself and must be able to reclaim what the silent region
// held, so that region has to be at its floor by ReclaimAfter: a cut-off
// region of three or more keeps only its floor, whatever it held (see
// Partitions, below).
//
// Two regions and the witness (witness.go; Config.WitnessLease W, which
// the agent and the simulator set: driver.DefaultWitnessLease). Between
// two regions nothing in the reports tells a dead region from a cut-off
// one; etcd, which both reach in the normal case, can. Each region's
// agent renews a key of its own in etcd by compare-and-swap on the
// revision it wrote last (WitnessRenewed: a renewal sent at t that
// succeeded), and reads its peer's key (WitnessSeen: a revision and when
// it was first seen). Then D = max(ack deadline, t_w + W), t_w the send
// time of the newest successful renewal fed to this incarnation (none
// after WitnessLost: the key was taken), and the store lease written with
// the marker is still at most Lease. The survivor s may freeze its peer p
// only through the key: when p has been silent, and p's key at one
// revision v, for WitnessReclaimAfter = W(1+rho)/(1-rho) + Margin on s's
// clock, while s holds its own lease (Output.Take), s replaces p's key by
// compare-and-swap at v, and only if that succeeds (WitnessTaken) freezes
// p's incarnation and contributes to its reclaim, as among three regions.
// Safety: p's renewals that succeeded all wrote revisions up to v (a later
// one would have changed the key, and the take would fail), each sent
// before s first saw v, so p's witness deadline (W on p's clock, which
// runs at least 1-rho) ended within W/(1-rho) real time of that sight,
// and s's wait of W(1+rho)/(1-rho) on a clock that runs at most 1+rho is
// at least that long; p's ack deadline came from s's
// acknowledgements of reports s heard before its silence of the same wait,
// so it ended too; p's marker lease ends by its D, and its store is at its
// floor when s freezes p. Every renewal after the take fails (the key is
// no longer at p's revision), and p's agent, which sees that, tells its
// ledgers (WitnessLost) before it writes the key again for its later
// incarnations: a renewal of the new key never extends an incarnation that
// was alive when the key was taken. A take serves every rule of the
// region pair: each ledger freezes only if its own condition holds, at
// once or, if its own silence of p is still short (each rule hears p at
// its own report's phase: its last report of p can be a heartbeat younger
// than the asking rule's), once it holds (the take is remembered for the
// incarnation it ended: WitnessTaken, tookFreezable). Before 6 December
// 2026 nothing remembered it: such a rule asked again only once the take's
// own revision of the key had been seen for a whole wait, and its share
// stayed stranded 62 s longer (TestWitnessTakeStaggeredRules in
// sync/driver).
//
// So, with a witness: a cut between two regions that both still reach etcd
// changes nothing (both renew; nobody fences or takes a key); a region cut
// off from its peer and from etcd keeps its position for up to W after its
// last renewal, then fences to its floor if it held more; and a region
// lost for good (or cut off that long) is reclaimed by the survivor
// WitnessReclaimAfter after its last renewal and report, plus the
// registry's round trips (TestTwoRegionLossReclaimedByWitness: fenced
// 2.56 s and reclaimed 3.28 s after the cut with W = 3 s, bound 5.01 s;
// TestTwoRegionCutWithWitnessKeepsPositions; TestRandomized draws a
// witness of 2 s in half its two-region seeds, with etcd cuts among its
// faults: 94 keys taken over LEDGER_SEEDS=2000, every seed safe and at
// the targets in time). If etcd is down as well as the link between the
// two regions for more than W, both fence to their floors until one of
// them is heard again: the price of reclaiming a lost region without a
// third one. A peer that never wrote a key (a version without the
// witness) is never taken.
//
// A survivor freezes a peer incarnation (stops applying and giving to it,
// ignores its messages, contributes its pair terms to the registry) when it
// has heard nothing from it for ReclaimAfter = Lease(1+rho)/(1-rho) + Margin
// on its own clock while a peer acknowledges the survivor itself, or when it
// sees a newer incarnation of that region (whose marker, confirmed before its
// first report, has already floored the old one). A region with no live peer
// does not start a reclaim by silence: it could not take the payment
// (below), and reclaiming the other side of a partition would only make it
// start a new life. Among three regions or more it does freeze a silent
// incarnation once the registry needs its contribution (another region
// froze that one first, or paid it unheard: below): a reclaim
// needs one from every incarnation whose life overlapped the silent one
// (the cohort rule, below), and what the contribution attests, that the
// contributor has been silent towards it for ReclaimAfter, holds whether or
// not anyone hears the contributor. (Until 6 December 2026 it did not: two
// regions alone at once each waited for the other's contribution, every
// reclaim overlapping theirs waited with them, and what those held was held
// by nobody until one of the two was healed: TestSeveralRegionsAlone.)
//
// # Reclaim
//
// The Registry (one etcd document, compare-and-swap) allocates incarnations,
// records which are closed, collects contributions and pays out. A new
// incarnation whose first marker is confirmed asks for Close (Output.Close):
// every earlier incarnation of its region is then closed, at its floor for
// good (its records are floored by the new marker) and silent (the agent
// runs one incarnation per region at a time: a life ends at the next Start).
// Survivor j's contribution to the reclaim of A is Q_j = conf[j][A] -
// recv[A][j] per key, frozen: j keeps -Q_j in its position for good (an
// unconfirmed gift to A is cancelled: a raise back).
//
// Reclaims complete in cohorts. The cohort of A starts as {A}; every
// unreclaimed incarnation X of another region whose life overlapped a member
// M must have contributed to M, or else be closed, and then X joins the
// cohort (X and M are both at their floors for good and neither froze the
// other: their pair is counted by nobody, which is exact, since the units of
// a pair, both positions plus what is in flight, sum to zero). A member that
// is not closed must have a contribution, and, from every other region, one
// from the last of that region's incarnations that overlapped it: that one
// froze it after silence, later than any earlier one of its region could
// have acknowledged it, so its store lease has lapsed. When the cohort
// completes, per key, Phi = sum over members (I_M for a first incarnation +
// Paid_M + Kept_M + the Q of contributors outside the cohort) is split by
// weight among the newest unreclaimed incarnation of every region (outside
// the cohort: for a two-region cohort, the two successors) and added to their
// cumulative Paid; each contributor outside adds -Q to its
// Kept. Paid_M (what reclaims paid M, applied or not) and Kept_M (what M kept
// of pairs with incarnations reclaimed before it) are thus never lost: a
// pair is counted once, by whichever of its two reclaims completes first
// using the other's contribution, and the second reclaim counts the kept
// side. A recipient applies the part of its cumulative Paid it has not
// applied yet, in any order and late, but only while a peer acknowledges it
// (joined): a region alone holding more than its floor would fence at once.
//
// The registry stays bounded: a reclaimed incarnation is forgotten (a
// watermark per region remembers that every incarnation up to it is
// reclaimed) once every earlier one of its region is reclaimed too and it is
// not among its region's two newest; a completed reclaim keeps no
// contributions. Its size is O(regions x unreclaimed incarnations x keys with
// units in flight), whatever the run length (TestRegionAloneForHours,
// TestRegistryBoundedOverAWeek).
//
// # Invariant 1, proof sketch
//
// Let E_i be what i's store enforces. Claim: sum_i E_i <= Units at every instant.
//
//  1. E_i <= the position computed from published counters only,
//     P_i = B_i + extra_i + frozen_i + sum_j (recv[j][i] - conf[i][j]):
//     raises need recv, which needs a published conf; conf is published only
//     after the store holds a version whose units already subtract give >=
//     conf; every later write also subtracts it (give only grows); an empty
//     store enforces floors until every key is re-asserted; a lapsed lease or
//     a newer incarnation's marker gives the floor <= P_i. A first marker
//     written after D (floor-only incarnations only) has a zero lease.
//  2. With all regions alive, sum_i P_i = sum F + sum I + sum over pairs
//     (recv - conf) <= Units, since recv[j][i] <= conf[j][i].
//  3. A cohort completes only when each member's store is at its floor for
//     good: it is closed, or every incarnation that could still acknowledge
//     it has been silent towards it for ReclaimAfter, so its lease deadline
//     has passed in real time (as above; between two regions a member is
//     closed, frozen on seeing its successor, whose marker floored it, or
//     taken through the witness, whose own argument is under Leases). The
//     deadline counts from the member's last acknowledged report, or, with
//     none, from its start: a silence counted by a peer must therefore
//     begin after that start. A peer counts it from its own start only for
//     the incarnations the registry showed allocated when its own life was
//     (Start.Live), and a life's start is when it sent its request for an
//     incarnation (Start.Sent), before its allocation; from a report it
//     hears, which its sender sent after its start; the first freezer of a
//     member is one of these, and the others contribute only once the
//     registry shows it needs them. (Until 5 December 2026 every peer's
//     first life counted as started at the peer's own start, and a first
//     life allocated later and never heard was reclaimed while its store
//     still enforced its initial part: TestLateFirstLife,
//     TestSlowStartAnswer; TestRandomized now starts a quarter of its
//     seeds' last region late and answers another quarter's r0 late.
//     Longer hunts find a few seeds whose churned keys end the 15 s calm
//     phase still settling or retiring, converging a little later, not
//     stuck. On 5 December 2026 (the gift wait, and closures to every
//     peer at once: retire.go), LEDGER_SEEDS=5000 fails two of 5,000:
//     seed 2982, a sample 11.1 s after the heal with 16,701 units of k7
//     held by no region (in flight: that sample does not count them; the
//     end is at the targets), and seed 3709 (7 regions,
//     delays up to 2.5 s), k7 still held at the end (active, its pairs not
//     yet retired), forgotten with a calm phase of 20 s; both
//     pass without the gift wait (LEDGER_GIFT_WAIT=0s), whose slower last
//     gifts leave keys idle, and settling, later. The 2,000 seeds of
//     TestRandomizedAdversary pass. Before: 1243 (four closures drained
//     one peer at a time, now at once) and 3930 (a sample 10.35 s after
//     the heal during a settlement), and adversary seed 85 of 1,000 (a
//     settlement retrying with its backoff), all converging within 5 s
//     of the calm phase's end; all three pass now.) Every
//     contributor outside has frozen its pair with the members: it
//     applies nothing more from them. Phi is
//     then what the members held above their floors plus what was in flight
//     to or from them, so Phi >= 0 and the clamp at 0 never binds; each
//     recipient's payment is a raise of a part of Phi, so any subset of
//     recipients having applied it is bounded by all of them having applied
//     it, and the total is sum F + sum I + the remaining pairs <= Units.
//
// # Invariant 4: liveness, and its bound
//
// Claim: once the network is healthy (every report and registry call gets
// through, RTT the largest round trip, T_reg the registry's one-way delay),
// every agent is up and demand holds still, every key's positions reach the
// allocator's targets, with every unit held by a live incarnation, within
//
//	T_heal = 2 T_reg + 2 (P + RTT) + 3 (I + S + RTT + W)
//
// of the heal (I the interval, S StoreTimeout, P = max(I, h) the longest
// time between two reports, h the heartbeat: Config.heartbeat, W GiftWait
// rounded up to Ticks; Config.HealBound computes it), plus the restart of
// an agent that is down (a registry round trip and its first marker write).
//
//  1. Every dead incarnation is reclaimed. A dead incarnation's successor
//     confirms its marker and closes it; a region that is gone for good is
//     frozen by every survivor after ReclaimAfter (the survivors acknowledge
//     each other). So every overlapping incarnation has either contributed or
//     is closed, and the cohort rule completes it: no reclaim waits for a
//     dead contributor (before, a two-region partition longer than the lease
//     left both sides' reclaims waiting for each other forever).
//  2. After the heal, each new incarnation's report reaches its peers within
//     P + RTT/2 (a Tick with nothing changed waits for the heartbeat); a
//     peer that still pairs with the old one freezes it at once and
//     contributes (T_reg), the record reaches everyone (T_reg).
//     Acknowledgements come back within another P + RTT (they ride on the
//     peer's next report), so every incarnation has a lease (joined: it
//     applies its Paid) and accepts gifts. What a peer missed during the
//     cut is repaired by a full report at the next Tick after it is heard
//     again after a silence of more than 2P (2.5P without a heartbeat),
//     or acknowledges a report of ours after such a silence (Ledger.resync; before, the repair waited
//     for the next of every FullEvery-th report, FullEvery heartbeats with
//     nothing changed: TestPartitionDuringShift's two-region cuts took 910
//     ms with a heartbeat against 410 ms without).
//     Gifts, raises and confirmations do not wait for the heartbeat: a key
//     that changed is reported at the next Tick, so step 3 keeps I.
//  3. Then sum of positions = Units (nothing is lost: item 1 and the
//     accounting above), and the allocator's targets over the live regions
//     are reached by gifts: each round (a giver's tick, its store write,
//     the report) takes I + S + RTT and brings every position within the
//     givers' projection error of its target; three rounds bring it within
//     0.1% of the limit in the tests. A round whose excess is within
//     GiftBand waits W first (an excess that stays is given after W, so
//     the targets are still reached exactly): hence W in each of the three
//     rounds. It costs time after a heal: TestRandomized's worst over its
//     400 seeds went from 3.85 s to 6.25 s (seed 53, seven regions) with
//     the harness's W of 300 ms (LEDGER_GIFT_WAIT=0s for the old figure),
//     against a bound of 8.23 s; TestPartitionDuringShift at five regions
//     from 1.41 s to 1.84 s, bound 2.43 s. With whole tokens (Quantum) see
//     step 4.
//  4. Whole tokens. The rounding (Config.wholeTokens) is discontinuous: a
//     view of the pool a few units short can move a whole token. And a
//     region's views miss the gifts in flight between two other regions:
//     the giver's report shows its lowering, the receiver's does not show
//     the raise yet, so the pool is short by the gift. In TestRandomized's
//     seed 1929 (defaults, four regions, a burst of 4), 12.3 s after the
//     heal, the four regions computed pools of 900,000, 858,049 (twice)
//     and 735,760 units in the same interval: r3's gift of 41,951 to r1
//     was in flight, so r0 and r2 targeted r1 at no token where r3
//     targeted it at one; r1, having applied it, saw a pool shorter still
//     and gave it on, and the givers, seeing the whole pool again, gave
//     again, until the end of the calm phase (and seeds 106 and 631 with
//     a band of 0.25 and a 1 s heartbeat, seed 108 with the heartbeat
//     alone in an earlier build). So give holds a key's whole-token gifts
//     back while its views disagree (Ledger.consistent): for every two
//     other live regions j and m, m's last report must acknowledge the
//     report of j our view of j on the key comes from (reports carry an
//     acknowledgement of every peer; each ledger keeps the newest per
//     sender and region, O(regions^2) per ledger, and per key only a
//     one-byte count in the key's padding). m applied every gift j
//     published to it there before it sent that report, so no unit moving
//     between two other live regions is missing from our pool. The check
//     is conservative: every report of j that carries the key counts (a
//     demand change, a full report), not only those whose gifts grew, so
//     while the regions report a key at every Tick the views seldom agree
//     and the hold is in effect holdTicks Ticks before each whole-token
//     gift: rounds that much slower (TestHoldCapped: 3 Ticks, with its
//     views as they are or forced to disagree). Knowing which report of
//     j last raised a counter to a third region would take 8 more bytes
//     per pair (56 to 64, TestKeySize); not done. The hold
//     lasts at most holdTicks Ticks in a row (ceil((P + I)/I) + 1: 3 at
//     the defaults, 5 with the harness's heartbeat of 207 ms), then the
//     gifts go out whatever the views: a view that cannot agree (a
//     receiver that never hears a giver) slows a key's gifts to one Tick
//     in holdTicks + 1, it never stops them. The hold chooses only whether
//     a Tick gifts (no counter, position or write changes): invariants 1
//     to 3 hold as proven.
//     Bound. With a healthy network a receiver reports a raise at its next
//     Tick (the key changed) and any peer acknowledges a report in its
//     next one, within P, so after a round of gifts the views agree again
//     within P + RTT (+ S for the giver's confirmation report), inside the
//     hold's cap: each round of step 3 takes at most holdTicks I more, and
//     on agreeing views every region computes the same pool, so the
//     rounding no longer hands a token back for want of units it cannot
//     see. What the check
//     does not see, and why the bound for whole tokens stays measured, not
//     proven: a report of the giver sent between its lowering and its
//     store's confirmation (the published counter not yet raised: at most
//     S), and a gift the receiver applied from a report of the giver we
//     have not received yet (our pool is then larger, for up to RTT/2);
//     and KeepToken still weighs each view's own positions. Measured: TestRandomized's
//     small-limit seeds among seeds 1 to 2,000 reach the targets within
//     4.55 s of the heal with the defaults (4.45 s without the hold,
//     seed 1929 apart; bound of the proven case 7.1 s) and within 4.95 s
//     with a band of 0.25 and a 1 s heartbeat (7.32 s); without the hold
//     seed 1929 (and 106 and 631 with those settings) never settled
//     (TestWholeTokenViews). rlsim's scenarios
//     (seed 1): the ledger's utilization holds or rises (follow-the-sun
//     94.93% to 97.16%, daily-quota 96.75% to 97.35%, limit-10-per-second
//     94.02% to 94.07%; the other ten unchanged) and its sync bytes fall
//     where it changed (44,649 to 32,309, 16,394 to 13,089 and 26,235 to
//     24,973 B/key/s); limit-1-per-second-moving wrongly rejects 9.91%
//     instead of 9.79% at the same utilization.
//
// The tests check this bound in virtual time (TestTwoRegionPartition,
// where neither side fences; TestRegionAloneForHours; TestSeveralRegionsAlone;
// TestPartitionDuringShift;
// TestRandomized over 2..7 regions with loss, duplication, delays, restarts,
// store resets and partitions: restart delays + RetryWrite + T_heal + ten
// intervals of demand estimate, 8.23 s with the harness's settings since
// the gift wait (7.32 s before): worst 6.25 s over LEDGER_SEEDS=5000;
// TestRandomizedTenRegions the same draws at ten regions, worst 3.7 s over
// 40 seeds with LEDGER_REGIONS=10 LEDGER_SEEDS=40 (4.45 s of 7.1 s before
// the gift wait); TestRandomizedAdversary the same with genuine reports
// replayed to any region at any later time, after the heal too: worst
// 4.6 s over LEDGER_SEEDS=2000 (4.05 s of 7.32 s over 1,000 before the
// gift wait; 3.35 s with LEDGER_REGIONS=10 LEDGER_SEEDS=40, 2.9 s with
// LEDGER_REGIONS=2 LEDGER_SEEDS=300, both before it); the
// quarter of its seeds with a burst of 1 to 4 whole tokens, not bounded,
// 5.85 s now, 5.85, 3.3 and 3.0 s before), end to end in the simulator
// with the agents' driver (simulations TestFaultsServeAgain: an agent
// restart, a Redis restart, both, 80% of a region's messages lost for 15
// s, and a partition with the clocks at the bound's edges, at 2 and 10
// regions and 1/s and 10,000/s, within
// HealBound plus the restart: worst 4.5 s of 6.6 s) and live
// (cmd/internal/live, TestLiveTwoRegionPartition). Under replay the bound is measured, not
// proven; what had broken it, a replayed freeze of a dead incarnation
// fencing a live one, is gone (above, "A peer telling us it froze us").
//
// # Partitions: what a cut-off region keeps
//
// Two regions: each side keeps its position for the whole cut (invariant 3,
// no D): the sum of the positions stays at most Units (gifts in flight at
// the cut stay lowered on the giver and unapplied on the receiver), no
// incarnation fences, and after the heal the reports resume in the same
// incarnations, so the shares reach the targets within one round of gifts
// (TestTwoRegionPartition: 10 ms at most after cuts of 2 s and 10 s, bound
// 1.3 s; TestTwoRegionPartitionSmallLimit the same for whole tokens of a
// burst of 1 and 4, one side keeping the token through a 10 s cut;
// two-region-partition: 99.96% utilization, 74.41% when both sides fenced
// to their floors). Without a witness, a lone survivor of a lost region keeps its
// position, not the other's: it cannot reclaim with no peer to acknowledge
// it, and the lost region's units come back when it returns (its new
// incarnation's marker floors the old records, the survivor freezes the old
// incarnation and the cohort completes). With a witness (Leases, above), a
// side that still reaches etcd keeps its position however long the cut,
// and one that reaches neither its peer nor etcd keeps it for up to
// WitnessLease, then its floor; the survivor reclaims the rest.
//
// Three regions or more: a region cut off from all its peers keeps only its
// floor once its lease has lapsed, and this cannot be improved without
// moving the floor. The survivors acknowledge each other and, after
// ReclaimAfter, cannot tell the silent region's death from a cut: for the
// limit to stay live when a region dies, they must then hand out everything
// it held above its floor (Reclaim). If it still enforced u > floor, the
// sum of the stores would exceed Units by u - floor. A region keeping more
// during a cut would need the survivors to leave that much unreclaimed for
// good when it dies, which is what the floor already is: min_share is the
// price paid in advance for serving during a cut, and min_share 1 is the
// static split (partition: 99.79% against the static split's 99.99%, the
// cut-off region at its floor for the cut).
//
// Several regions cut off at once, each alone (a region cut from every
// other, the others of the cut included): each reclaim that overlaps them
// completes once every other lone region has found it silent for
// ReclaimAfter (a lone region contributes to the reclaims the registry
// needs it for, above), so a region healed while others are still alone is
// served as after a full heal, within the bound of invariant 4 counted
// from its heal, less what a reclaim paid the regions still alone (below)
// (TestSeveralRegionsAlone: 3 of 5 and 3 of 10 regions alone for 10 s, the
// one with the demand healed first; served within 0.78 s and 0.70 s of its
// heal at worst over 10 seeds, bound 2.43 s; the stack's
// TestSeveralCutLiveness: 0.6-5.1 s with the real agents at ten regions, 1/s
// and 10,000/s).
//
// What a reclaim pays a region that is alone. A completed reclaim pays the
// newest unreclaimed incarnation of every region its weight's part, and a
// recipient applies a payment only while a peer acknowledges it. A region
// cut off alone fences and starts a new incarnation, and the reclaim of
// its old one pays the new one: that part would wait with it for the whole
// cut, held by nobody, while its traffic has moved to the other regions
// (12-31% of the limit at four regions, and with a burst of 1 the whole
// token when the tie of the whole-token split fell on it: no region could
// admit anything for the cut). So a ledger that sees a completed record pay
// a member's successor it has not heard makes it freezable, its silence
// counted from then (Ledger.paidUnheard: the recipient was allocated before the
// record, so its start, from which its lease counts while no peer
// acknowledges it, is earlier, and we never acknowledged it); its reclaim
// gives the part back to the others, and it fences only once that reclaim
// is complete, so its successor is allocated after it and is paid nothing
// by it: a lone region fences twice, then holds its floor in its third
// incarnation for the rest of the cut (TestRegionAloneForHours). One heard
// within ReclaimAfter is never frozen, and one that any region hears is not
// reclaimed without that region's contribution. Not between two regions:
// there no incarnation has a lease deadline without a witness (invariant
// 3), so a silent peer is frozen only through the witness. The region
// that now takes the traffic holds every unit the others do not need within
// two reclaim waits and the heal bound of the cut (TestFailoverFromLoneRegion,
// 4 and 10 regions, bursts of 1 and 4 and none: 3.17-3.57 s at worst over
// 10 seeds, bound 4.87 s, 6.87 s with whole tokens). The part a reclaim of
// another region's incarnation pays a region alone still waits for its heal
// (freezing it too would make two regions alone at once pass the units to
// each other, a new incarnation each time): at most 21,428 of 1,000,000
// units 5 s after the heal in TestSeveralRegionsAlone at five regions, none
// at ten. A cohort completes
// only if it has someone to pay: with every region's newest incarnation in
// it or reclaimed, it waits for the next Start (an earlier form of
// paidUnheard, which froze every recipient not heard, let three regions
// restarting under loss reclaim each other's newest incarnations in a
// chain, and 900,000 of 1,000,000 units were paid to nobody:
// TestRandomized's seed 166; the guard stays against any other chain).
//
// # Clocks
//
// No clocks are synchronised. Every clock (agents and stores) runs at a rate
// within [1-Rho, 1+Rho] of real time; that is the only timing assumption,
// plus StoreTimeout bounding a store write. A backward step of the store
// clock never mints tokens (elapsed time is clamped at 0); a forward step mints
// at most one bucket capacity (tokens are clamped to the capacity).
//
// # Restart
//
// An agent that restarts with its state lost starts a new incarnation from
// the Registry: floor only, new pairs, marker first (no report before the
// marker is confirmed). Peers freeze the old incarnation when they see the new
// one. Persisting and restoring state was not chosen: a restored state older
// than the last write issued would break the lower-first order.
//
// # Idle keys and their retirement
//
// A key leaves coordination (its record is re-written as a Release record at
// the base, which the store may let expire with the bucket, after which the
// marker's default is the same value) only when it had no usage for IdleAfter,
// its position is its base with no extra or frozen part, every gift is
// confirmed and applied, and every peer reports its position at its base and
// no demand. With no demand above the floors anywhere, the allocator's wants
// are the bases (restWants), so an idle key's positions go back to the bases
// even after a restart has made them differ from the split by weight, and
// exactly: Hysteresis spares small gifts only while there is demand (with
// it at rest, at ten regions the last few units of most keys stayed off
// their bases and no key was ever forgotten: TestChurnLiveness).
//
// An idle key's counters are then forgotten by retirement (retire.go), so
// memory and Tick follow the keys in use, not every key ever seen. A key
// whose pairs are all zero is dropped at once (after the three full reports
// that carry it idle, so peers learn it is idle): its state equals none. A peer that has not
// reported a key in 8 FullEvery of its reports (two full reports at least)
// holds it idle or not at all:
// the ledger's view of it is reset to its base with no demand (a peer that
// forgot a key never reports it again). Otherwise region j
// retires k when it is idle, its last write confirmed and every pair
// balanced and net zero: give = conf = applied by the peer = recv (its
// gifts all applied, and as many units came back from each peer as went to
// it). Retiring is irrevocable: j numbers the retirement (Retire), marks k
// with it in every report, and from then on applies and gives nothing on k.
// A peer x that reads the mark with counters for it closes its pair with j:
// it applies j's final gift counter C and restarts the pair at the final
// counters (rebase: give, conf and applied lose R, j's applied counter, recv
// loses C; the position is unchanged, R = C, and gifts x made beyond R stay in
// flight in the new counters), and carries the closure (key, j, j's
// incarnation, number) in every report, from the first that carries it,
// until j acknowledges one of them. A report carries at most
// MaxClosureBytes of closures; the others wait for room. Waiting only
// delays: x's reports between its restart and the first carrying the
// closure count afresh already, and j, retiring k, applies none of x's
// counters on k until it reads the closure (and raises its watermark to
// that report).
// When j reads the closure it restarts its pair with x the same way; once
// every pair is closed or zero, j forgets k (or keeps it, restarted, if it
// was paid or used meanwhile). Two rules make the restart point agreed:
//
//   - Watermark. When x closes on j's report of sequence q, and when j
//     accepts x's closure in x's report t, and when x sees j's acknowledgement
//     of its closure in j's report a, the receiver ignores the keys of every
//     later-arriving report of that peer incarnation with a lower sequence
//     (q, t, a). Sequences are per incarnation and only grow, so the reports
//     it still reads were sent after the sender's own restart point: x
//     restarts before it first sends the closure (t and later count afresh),
//     and j reads a closure only after having sent its mark (q and later
//     carry the mark, handled below, or come after j's restart).
//   - Marks are not counters. A report carrying j's retirement mark is read
//     only as a request to close: x skips it while its closure is pending,
//     and a mark whose counters for x are zero needs no closure. After j has
//     acknowledged the closure, j's later marks carry zero counters for x
//     (j restarted before acknowledging). A key report for a key x holds no
//     state for, at the sender's base with no demand and no counters, makes
//     none.
//
// Safety (no counter applied twice, none lost). Consider one pair (x, j) of
// incarnations and one key. Each side's counters form segments separated by
// its restarts; a receiver applies a counter only from a report it does not
// ignore, and by the watermark such a report was sent in the sender's
// segment that matches the receiver's current one (the sender restarted
// before, or after, the same handshake step). Within a segment the protocol
// is the one proven above (cumulative counters, max merge). At a restart
// both sides remove the same amounts, R from the gifts x made and C from the
// gifts j made, where R and C are j's final counters: j applies and gives
// nothing between its mark and its own restart, so its counters are exactly
// R and C there, and x has applied C before it removes it. Hence in the new
// segments recv <= conf still holds on both sides (x's in-flight gifts are
// give - R on both counts), positions are unchanged at every step, and
// invariant 1's published positions keep their sum: every term (recv - conf)
// of a pair is the same before and after, and between x's restart and j's
// the pair's two terms sum to R - conf_x <= 0 as before. Nothing is lost:
// what x gave beyond R remains in x's new conf and j applies it after its
// retirement, from a report past the watermark. Loss and duplication change
// nothing (marks and closures are repeated until acknowledged; duplicates
// fall under the watermark or are skipped); reordering is what the watermark
// is for; a restart makes a new incarnation with new pairs (a frozen pair is
// zero, so a retirement never waits for a frozen peer); a partitioned or
// frozen-in-place peer only delays the retirement: j holds k, retiring,
// until the peer answers or is frozen.
//
// Reclaim is unaffected: a restart removes equal amounts (R = C) from both
// counters of a pair, so every survivor's contribution Q = conf - recv and
// every frozen term are what they would have been, and a forgotten key is at
// its base with nothing frozen or paid.
//
// Liveness. Retirement adds no wait to the bound of invariant 4: after the
// heal a mark reaches the peers within I + RTT/2, the closure comes back
// within another I + RTT (within step 2's 2 (I + RTT)), or, when more
// closures wait than one report has room for, after the ones before it:
// each acknowledgement round trip clears MaxClosureBytes of them, and at
// least one to each peer, since each peer acknowledges its own
// (TestClosuresWaitForRoom, TestClosuresOnePerPeer; TestRandomized gives
// half its churning seeds room for one closure per report: until 5
// December 2026 that one went to one peer at a time, and at ten regions
// seed 39 of LEDGER_REGIONS=10 LEDGER_SEEDS=40 ended its calm phase with
// two retirements still waiting for their closures); a retiring key that
// gets demand meanwhile stays at its base until its retirement ends and
// becomes active then. Tested by TestRandomized (a third of its seeds churn
// eight keys through every fault and check that, after the calm phase, every
// ledger holds only keys in use or kept as below), TestLateDuplicateAfterForget,
// TestRetireWithAGiftInFlight and TestChurnThreeRegions. A key whose pairs
// are not all net zero is settled first (Settling cycles, below).
//
// # Settling cycles
//
// Among three regions or more, units can come back to every region's base
// along other pairs than they went: r0 gave r1 x, r1 gave r2 x, r2 gave r0
// x. Every position is at its base, but no pair is net zero, and retiring a
// pair with a net would move it into the ended terms of its two sides,
// which a later reclaim of either would not count (the registry rebuilds a
// dead incarnation's holdings from its peers' counters): a mint. Such a key
// is settled instead: its units go back the way they came, by gifts.
//
// Let owed_ij = recv[j][i] - give[i][j], what i owes j on a key. When
// nobody wants more than its floor (restWants), a region above its base
// first pays every live peer it owes its whole debt, as far as its
// position above its floor allows (above its base, if it holds reclaim
// terms on the key), and only then gives to deficits (give, settleGive).
// A quiet key whose gifts are all confirmed and applied but that has a
// pair with a net is made active again by the same payment, at its base,
// once every live peer reports it at its base with no demand
// (settleStart). The payees, above their bases then, pay what they owe in
// turn; once every pair is net zero the key retires as above. Two records
// bound what goes round. A region pays again only if at least half of
// its last payment stuck: its sum of |net| on the key must be at least
// ceil(g/2) below the sum S before its last payment of g (cleared when the
// key leaves coordination or has demand). And it begins a settlement from
// rest again only if its last beginning since the key's demand at least
// halved its sum or, when it did not, once a backoff has passed: IdleAfter
// plus the idle reports' time, doubled with every beginning in a row that
// did not halve it (at most 64 times; cleared with demand). Among ten
// regions all beginning at once, the deficit gifts of some payments close
// new cycles, and a region's sum can end where its beginning found it
// though the key's nets as a whole fell: without the retry such a key
// (one of 300 at ten regions in TestChurnLiveness) was held for good. A
// region with reclaim terms cannot bring its nets to
// zero at its base: what it is paid beyond what it owes goes back out by
// its deficit gifts, and views of a payment in flight differ, so that
// regions at their bases give part of it back to the payer for a while.
//
// Without these bounds the units of such a key went round for good
// (TestSettleNoLivelock). Regions with reclaim terms did not pay at all,
// so a cycle through one came back by its deficit gifts, split among
// several deficits; the payer's sum was then a few units below the old
// record (the sum when it last paid), so it paid its whole debts again,
// and each time the key came to rest the record was cleared and it began
// afresh. Positions went up to 1.4% of the limit off their bases every
// few seconds, long after the heal: TestRandomized's seeds 35 and 202
// with a demand band of 0.15, and seed 1241 without it (the band only
// changes the faults' course).
//
// Safety. A payment is an ordinary gift (lowered first, published once
// confirmed, applied by a raise); the rule only chooses its recipient and
// amount, so invariant 1's proof covers it unchanged, and retirement still
// closes only pairs that are net zero. Lowering a key towards its floor
// costs nothing when nobody wants more than the floor.
//
// Termination. The two views of a pair satisfy owed_ij + owed_ji = (recv_i -
// give_j) + (recv_j - give_i) <= 0 (recv never exceeds the other side's
// give), so a pair is never owed both ways and a payment never makes the
// payee owe the payer: a payment of g lowers the pair's |net| by g. Without
// reclaim terms a region's position less its base is the sum of its nets,
// so a region above its base owes at least its excess, and once it has paid
// its whole debts it is at its base plus the sum of its negative nets, at
// or below its base: it has no excess over the bases left for the
// allocator's deficit gifts. With consistent views the only gifts that
// create nets at rest are then those of regions with reclaim terms, and
// every payment lowers the sum of the pairs' |net|, a non-negative
// integer. Whatever the views, the records bound the payments: between
// two clearings a region's records fall by at least half of each of its
// payments, so it pays at most twice the sum it began with, and each
// beginning from rest halves it or comes a backoff after the last, the
// backoff doubling, so within a time T there are at most log2 of it plus
// log2(T/backoff) + 1 beginnings. Between them only the allocator's gifts
// move units, to the bases. Every pair
// ends net zero unless every region still owed on a cycle is at its
// floor (none can pay first) or holds reclaim terms (its nets cannot all
// be zero at its base), or a record stopped the payments first: the key
// is then held (Limits), at the bases, and settling begins again after
// each backoff (a payment round its cycle, then back to the bases, at
// most once per 64 backoffs in the end: 17 minutes with the defaults). A payee pays its whole debt at
// once, so a payment goes round its cycle in about n rounds of I + S +
// RTT for a cycle of n regions, after the key's IdleAfter. (A region's
// excess of a few units over several deficits, whose proportional shares
// all round down to zero, goes to the largest deficit: such units stayed
// off the bases for good.) Tested by TestCycleSettled (60 random runs of
// three regions: without settling 59 kept the key for good; with it every
// ledger forgot it within 89 intervals of the last use),
// TestChurnThreeRegions (every one of 3,000 keys, its use moving between
// regions halfway through its life, forgotten by all three regions),
// TestChurnLiveness (the same at 2 and 10 regions and at 1/s, every key
// forgotten within its stated window),
// TestSettleNoLivelock and TestRandomized (every fault, the calm phase's
// convergence bound unchanged, every sample past it within 1% of the
// targets, and at its end every key with demand at its targets, a key at
// rest at them but for a retry's payment in flight, every unit held or in
// flight).
//
// # Limits
//
// Keys kept in memory though idle: a key named by a reclaim payment (extra:
// the cumulative payment names it for good) and a key with frozen reclaim
// terms, until the incarnation that holds them ends; and a key whose cycle
// cannot settle because every region owed on it is at its floor or holds
// reclaim terms on it, or whose payments a record stopped (Settling
// cycles). A reclaim
// names only the keys whose pairs with the reclaimed incarnation were not
// net zero when the survivors froze it (the keys in use then, and those
// settling), so these keys are bounded by the keys in use at reclaims
// during the current incarnations' lives, not by the keys ever seen; a
// restarted region starts without them. Releasing them earlier would need
// the registry to drop the key from payments and kept terms in the same
// step as every ledger drops its part, which it does not do.
package ledger
