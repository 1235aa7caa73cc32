// Package agent is a region's sync agent: it wraps one pure share ledger
// (sync/ledger) per coordinated global rule (token_bucket, fixed_window,
// sliding_window) with NATS, Redis and etcd, and
// thereby keeps the sum of the shares that the regions' Redis servers enforce
// at or below each global limit while moving share to where the demand is.
//
// Key invariant: the agent adds no path around the ledger. Every store write
// is one the ledger emitted, applied in emission order per key (versions make
// replays and reorderings harmless), or a refresh: a key's last write the
// store confirmed (Ledger.Held), written again at the same version and
// units so that its key keeps its TTL (refresh.go); a confirmation (ShareApplied) is
// reported only with the version the store says it holds afterwards; every
// report published is one the ledger returned; and every input the ledger
// rejects (a malformed message, an unknown region, a stale or frozen
// incarnation, a counter that went backwards or one its sender could not
// hold), and every message that fails authentication or is a replay, is
// dropped, counted in
// apportion_sync_reports_rejected_total{reason} and logged at a limited
// rate, and changes nothing. No-overshoot therefore rests on the ledger's
// proof and on the store contract of the ledger package doc, which
// regional/redisstore implements.
//
// # Inputs and outputs
//
//   - Rules: a rules.Source (rules/etcdstore.Watcher). A rule is coordinated
//     here when it is global, token_bucket, fixed_window or sliding_window,
//     and lists this region in Regions. A window rule's reclaim wait is one
//     window longer (W(1+rho)/(1-rho) more): a lapsed region's use of its
//     window stays admitted until that window ends.
//   - Usage: usage.Subscribe on "ratelimit.usage.<region>" (a shard keeps
//     the deltas of its own keys, see Shards); each delta of a
//     coordinated rule goes to Ledger.Usage with the delta's Key (the Redis
//     bucket key) as the ledger key and the rule's refill_per_second (a
//     window's limit / window). The subject is not signed, so each delta
//     is taken alone (onUsage): one whose rule or key is not valid UTF-8
//     is dropped and counted in apportion_sync_usage_dropped_total, the
//     rest of its batch applies, and counts of any size add with
//     saturation (the ledger bounds the demand they make: DemandCap).
//     The enforcers flush at the multiples of
//     usage.DefaultInterval on the wall clock (usage.NextFlush) and the
//     loop ticks halfway between two flushes (nextTick), so that every
//     interval holds the same number of flushes: with both on free-running
//     timers, an interval now and then held none and its keys' demand
//     read as 0 (live, 8 to 14 demand reports a minute per region for
//     shift's key against 0 to 5; the sync bytes twice the simulator's).
//     The alignment needs the region's hosts' wall clocks within a few tens
//     of ms of each other (NTP does it); hosts whose clocks are further
//     apart are as unaligned as free-running timers were, nothing worse:
//     safety never depends on it. Every enforcer sends a batch at every
//     flush, empty without usage, so one that misses a flush is late, not
//     idle: the tick then leaves the demand estimates as they are
//     (driver.UsageLate) until its usage arrives, at most UsageGrace
//     (lateusage.go: a stalled NATS server no longer reads as traffic
//     that stopped).
//   - Refusals: the store refuses a window record below what the key has
//     used of its window and answers the fewest units it can take; the
//     agent's store port returns it with the confirmations (driver.Applied)
//     and the driver passes it to Ledger.Hold before them.
//   - Reports: one message per tick on "ratelimit.report.<region>" (a shard:
//     Shard.ReportSubject) carrying the
//     report of every ledger that has one (sync/wire; split by EncodeParts
//     when larger than the connection's max payload; none is built before
//     the connection was first made, while that is unknown, and none is
//     handed to NATS while it is not connected, where it would wait in the
//     reconnect buffer and reach the peers stale: those count in
//     apportion_sync_reports_unsent_total{reason="disconnected"}, not as
//     sent nor as published for acks.go); the agent
//     subscribes to "ratelimit.report.*" and feeds the other regions'
//     reports to Ledger.Receive; on its own subject it only looks for another agent
//     serving its region (own.go: a message it did not publish, signed with
//     the region's key, of a newer incarnation than its own, is counted and
//     logged). A message whose From differs from its subject token is
//     malformed.
//   - Authentication (verify.go): every message is sealed with the
//     region's Ed25519 key (Config.Signer, an NKey seed: wire.Signer) and
//     opened with the key Config.PeerKeys holds for the region of its
//     subject (wire.Verifier); unsigned, forged, altered or truncated
//     messages are dropped before they are decoded further. A signature
//     proves origin, not freshness, so a rule report also has to be newer
//     than the newest accepted from its region (incarnation, sequence, key
//     range of a split report), which drops replays. Without a Signer the
//     Config is invalid unless InsecureUnsigned (agentd.RunCommand: a startup error
//     unless --insecure-unsigned-reports).
//   - Store: Store (regional/redisstore.Store). Marker writes go to
//     WriteMarker(rule), key writes to WriteShares(rule) with the rule's
//     global capacity and rate in thousandths, Total = Units, Floor = this
//     region's floor units (ledger.Split), and every record but a Release
//     one with the Hold (Config.RecordHold, refreshed every Hold/2: a
//     held key's record never expires while the agent lives, and outlives
//     its marker's lease when the agent dies). RunID is read every tick; a
//     change calls StoreReset on every ledger. A marker renewal confirmed
//     only after the lease it renews ran out (the rule's keys held their
//     floor meanwhile, with no fence) is counted in
//     apportion_sync_marker_lapses_total{cause} and logged (lapse.go).
//     A peer heard whose reports acknowledge none of this agent's for two
//     leases (it refuses or cannot read them) is flagged in
//     apportion_sync_peer_unacknowledged{peer} and logged (acks.go).
//     A peer no coordinated rule lists any more is forgotten, its per-peer
//     series deleted (forgetUnlisted).
//     The marker of a rule no longer coordinated is deleted once its ledger
//     is dropped, and at start those of every rule not coordinated
//     (Store.DeleteMarker, MarkerRules: markers.go).
//   - Registry: Registry (EtcdRegistry: one JSON document per rule under
//     /ratelimit/registry/<rule>, holding the rule's Spec and its
//     ledger.RegistryState, changed only by a Txn comparing ModRevision, so
//     concurrent agents never lose an update; large per-key lists live in
//     chunks under /ratelimit/registry.chunks/<rule>/, see "Registry
//     chunks"). Start allocates incarnations;
//     Contributions are submitted as the ledger emits them (it re-emits
//     pending ones, so a failed submission is retried), and so is a new
//     incarnation's Close once its marker is confirmed (it ends the earlier
//     incarnations of the region for the reclaims); every agent reads the
//     whole prefix every RegistryPoll and feeds the records of a document
//     whose revision changed to ReclaimRecorded.
//   - Witness keys (witness.go; the sync/ledger package doc, Two regions
//     and the witness): one key per region (and shard group) under
//     /ratelimit/registry.witness/, which the agent renews by compare-and-
//     swap every WitnessLease/4 (driver.WitnessRenewed; a key found at
//     another revision was taken by the peer: driver.WitnessLost, then it
//     is written again), reads with every registry poll
//     (driver.WitnessSeen), and takes from a silent peer when a ledger of
//     a two-region rule asks (driver.Ports.Take). Only the revisions
//     count; the values say who wrote them and when, for people.
//
// # Time and goroutines
//
// The order of the ledgers' calls and outputs (collect, flush, confirmations,
// publish, registry feeding, fencing) is sync/driver's: the agent runs one
// driver.Driver and implements its ports (ports.go) with Redis, NATS and
// etcd; the simulator runs the same driver on a virtual clock.
//
// The ledgers' clock is time.Since(agent start): monotonic, never the wall
// clock. The driver, the ledgers and all per-rule state belong to one
// goroutine (the loop): it runs ticks, merges received reports, and runs the closures that
// registry calls (on goroutines the agent owns, bounded by EtcdTimeout) post
// back. Store writes of one tick run in parallel across rules and are awaited
// before the confirmations go back to the ledgers. The loop never waits on
// etcd, so an etcd outage stops reclaims and new incarnations only; a Redis
// outage costs each write its StoreTimeout. Start and Close(ctx) own every
// goroutine; Close is safe twice.
//
// A fenced ledger (its lease lapsed, or a peer froze it) is dropped and a new
// incarnation started through the registry; meanwhile the store enforces the
// floor (its marker lapses or the new marker floors the old records).
//
// # Shards
//
// More keys than one process holds: Config.Shard (syncagent --shard i/N)
// makes the agent shard i of N of its region. Shard i owns the keys whose
// Redis Cluster hash slot lies in redisstore.ShardSlots(i, N) (N contiguous
// slot ranges; a check's buckets share one slot, so a request is one
// shard's) and is a ledger participant for those keys only. Design: shard
// i of every region forms its own ledger group. Per rule the group's id is
// the rule id with the suffix "#e<epoch>-<i>of<N>" (Shard.Group; rule ids
// never hold '#'), and that id names everything the ledger proof is about:
// the group's registry document (its own incarnations, Close records and
// reclaims: <registry prefix><group id>), its reports (subject
// "ratelimit.report.<region>.e<epoch>-<i>of<N>", with the group id as each
// rule report's Rule, inside the region's signature, so a report of one
// group replayed on another's subject is refused: ReasonLayout) and its
// ledgers. Each group is thus exactly the unsharded system restricted to its
// keys, and the ledger package doc's invariants, leases, fencing and
// reclaims hold per group as they stand; for a key only its own group ever
// writes a record or a marker copy it reads, so the per-key sum over the
// regions is the group's sum, at most the limit. The unsharded agent (0/1,
// epoch 0) keeps rule ids, subjects, etcd keys and store incarnations as
// they were.
//
//   - Fencing lease: the marker of a rule already has one copy per hash
//     slot on a Redis Cluster, and a check reads the copy of its key's slot
//     in the same script call (regional/redisstore, "Redis Cluster"). Shard
//     i's store (redisstore.WithMarkerSlots) writes the copies of its own
//     slots only, so each copy is one group's marker, with that group's
//     incarnation, default and lease: a shard that dies or is cut off lets
//     only its own copies lapse, its keys fall to their floors, and the
//     other shards' keys are untouched. Enforcers are unchanged. A single
//     Redis server has one marker per rule: more than one shard needs a
//     Redis Cluster (agentd refuses otherwise).
//   - Usage: every shard subscribes to the region's usage subject and drops
//     the deltas of other shards' keys (Shard.Owns: one CRC16 of the hash
//     tag). BenchmarkUsageFilter: 217-402 ns per delta received as shard
//     0/2 against 261-437 for the unsharded agent (three runs each, 2 shared
//     cores; dropping half the keys saves more map work than the hash
//     costs).
//   - Layout: every region must run the same N, in the same epoch: the
//     layout in etcd at LayoutKey ({"shards":N,"epoch":E}; none means
//     N=1, epoch 0). Every registry change (Start, Contribute, Close) reads
//     it with the document and compares its revision in the same
//     transaction, so no incarnation of a group starts while etcd holds
//     another layout (ErrLayout); every registry poll reads it too, and an
//     agent that finds another layout drops its ledgers
//     (apportion_sync_reports_rejected_total{reason="layout"} counts it),
//     its marker copies then lapsing within the lease. Agents of different
//     layouts therefore never coordinate the same key concurrently once
//     they have polled, and their reports never meet (other subjects and
//     group ids).
//   - Incarnations across layouts: a new layout's groups allocate
//     incarnations from 1 in fresh registry documents, but a slot's marker
//     copy and a key's record of the previous layout hold that layout's
//     (higher) numbers, and the store applies only higher versions. The
//     store therefore sees incarnation E*65536 + inc in epoch E > 0
//     (shardStore; a group has 65,535 incarnations per epoch, and versions
//     of other epochs read as none), so every epoch orders above the
//     previous ones in every slot: its first marker replaces the old copy
//     and floors the old records at once.
//
// Changing the layout (N), invariant 1: stop every agent of the old layout
// in every region, wait the reclaim wait (Lease(1+Rho)/(1-Rho) + Margin +
// StoreTimeout: every old marker copy has lapsed, every store enforces its
// floors), run ChangeLayout (syncagent layout N: the next epoch), start the
// N shards of every region. Until a new group's first marker is confirmed
// its region enforces floors; from then on each region enforces, per key,
// either its floor or the new group's share, and the new group's shares sum
// to at most the limit (its first incarnations own F+I, the initial split).
// No key is carried over: each group starts from the initial split and
// demand moves shares again within the liveness bound. An old agent that
// was missed stops at its next registry poll (above); one cut off from
// etcd but not from its peers cannot be stopped by the agents, which is why
// the procedure stops them first. A shard restarting within a layout is
// the ledger's restart of one participant of its group: a new incarnation
// from the group's document, its marker copies replacing the old ones, its
// peers freezing and reclaiming the old one; the other shards' groups do
// not notice. Its keys are back at their targets within the ledger's
// bound: the restart (a registry round trip and the first marker's
// 16384/N slot copies) plus T_heal. TestShardedAgentsWithRedisCluster
// runs 2 regions x 2 shards on two Redis Clusters with demand moving,
// checks the sum for each key in the stores (the enforcer's script), and
// kills and restarts shard 1 of a region: its key falls to the floor
// (the new marker floors the lost incarnation's records) and is back
// above its target within 60 s (1.1-8.0 s in four runs under a load of
// 20-27 on 2 cores), while the other shard's key keeps its share and its
// incarnation; then it changes the layout from 2 shards to 1 by the
// procedure above, and both keys are back at their targets 1.4-2.6 s after
// the new agents start (without the epoch's incarnation mapping the new
// markers are refused and the test fails).
//
// # Registry chunks
//
// A rule's registry holds per-key lists (a contribution's Q, a completed
// record's Keys, an incarnation's Paid and Kept): with 100,000 active keys
// the single JSON document was 15.9 MB, above what etcd accepts in one
// request (--max-request-bytes, 1.5 MiB by default; the client sends at
// most 2 MiB), so reclaims never completed. A document whose lists add up
// to more than 256 KiB (chunks.go) keeps every list above 1 KiB in chunks:
// the list's JSON encoding in pieces of at most 512 KiB, each under
// <registry prefix without its final "/">.chunks/<rule>/<hex SHA-256 of the
// piece>, referenced from the document by hash and length (200,000 keys in
// six lists: a 7.8 KB document and 73 chunks instead of one 36 MB
// document). Smaller documents keep the previous version's form, which
// both versions read; a chunked one is refused by the previous version (its
// "state" is a string), never read as empty.
//
//   - Outside the registry prefix, so Records' range read and the documents
//     under it keep their shape and count; a rule's chunks under their own
//     prefix, so collecting them lists only the rule's keys.
//   - Content-addressed: an immutable list (a contribution, a completed
//     record) is put once; a write puts only the chunks the document it
//     replaces does not reference. Everything read is verified (length and
//     SHA-256) before use: a mismatched or missing chunk is an ErrRegistry
//     naming its key, the change fails and writes nothing (Records leaves
//     the rule out, as any document that does not decode).
//   - Every chunk the current document references exists: new chunks are
//     put, one request each, before the compare-and-swap, which compares
//     the document's and the layout's ModRevision as before, the ModRevision
//     of <chunk prefix><rule>/gc as read before the puts (every collection
//     changes it, so one that may have deleted a new chunk fails the swap,
//     which retries and puts it again), and, for up to 120 new chunks, each
//     one's CreateRevision > 0 (a chunk deleted by anyone else fails it too).
//     etcd allows 128 comparisons per transaction (--max-txn-ops): a write
//     with more new chunks (a reclaim of roughly 400,000 keys or more) relies
//     on the gc key alone, so a chunk deleted by hand in that window is
//     found at the next read, as a missing chunk.
//   - Chunks nothing references (those of the replaced document, and those
//     of writes that failed or crashed between their puts and their swap)
//     are collected after every successful write of the rule, in
//     transactions of at most 120 deletes, each comparing the document's
//     ModRevision (unchanged since the listing) and the gc key's, and
//     changing the gc key. Garbage is thus bounded by one write's new
//     chunks per crashed or abandoned writer, until the rule's next write.
//   - Reads: a document's chunks are read at the revision of the read that
//     returned it (they exist then, whatever changed since; a compacted
//     revision makes update read again and Records fail until the next
//     poll), verified, and cached by hash (immutable; up to 256 MiB, least
//     recently used out). Records decodes only documents whose ModRevision
//     changed since its last call.
//
// # Decisions
//
//   - The reclaim registry is polled (one range read per RegistryPoll), not
//     watched: it changes rarely, a poll needs no reconnect logic, and the
//     ledger tolerates a late record (it only delays a reclaim). After a
//     failed poll the next waits driver.PollWait (2, then 4 RegistryPoll);
//     the first that
//     succeeds after failures starts at once every rule whose start
//     failed meanwhile (registryBack), instead of after its backoff (up to
//     10 s), and a start sent in the outage and still in flight is tried
//     again as soon as it is given up (after EtcdTimeout): a region cut
//     off from etcd, whose incarnation fenced in the cut, starts again
//     within about EtcdTimeout of the heal, where it could take that plus
//     10 s (TestStartWhenRegistryBack, polling every 200 ms: 0.7 s
//     waiting, 3.3 s before; 2.0 s with a start in flight and EtcdTimeout
//     2 s, 8.5 s before).
//   - A rule's Spec (Units, MinShare, regions and weights) is fixed by the
//     first agent that creates the rule's registry document, and every agent
//     builds its ledger from the document's Spec, so all regions always agree.
//     Changing a live global rule's regions, weights or min_share therefore
//     needs a new rule id, also after the rule is deleted: the document
//     outlives it, and the rule store (rules/etcdstore, under
//     DefaultRegistryPrefix) refuses a global rule whose split differs from
//     its id's document; capacity and rate changes apply at once (shares
//     are fractions of the limit), and so do the whole tokens of limits of
//     a few tokens: each rule set gives the running ledgers the Quantum of
//     the rule's capacity as it is now (followCapacity,
//     ledger.Ledger.SetQuantum; TestCapacityChangeWholeTokens: three
//     regions cut from a burst of 4 to 2 hold whole tokens of the new one
//     within a second, where they kept tokens of the old one, a fraction
//     of the new, until restarted). The Spec also records the units of one
//     whole token (Quantum), with which the registry pays reclaims out in
//     whole tokens: each write of the document records the Quantum of the
//     rule's capacity as the writing agent has it (EtcdRegistry.setLimit).
//     Advisory only (any payout sums to what was freed), so a write a
//     capacity change behind only rounds a payout to the old token, which
//     the ledgers' gifts then round to the new, and a document from before
//     it pays by weight alone.
//   - The contract store in the tests (memstore_test.go) implements the store
//     contract in memory under one lock shared by the regions, so its sampler
//     checks the sum at true instants; the same scenario runs against real
//     Redis, where the regions are read in both orders (see redisProbe).
//   - Standby (agentd.RunCommand --standby): the process campaigns on an etcd
//     election (/ratelimit/syncagent/<region>/leader, per shard
//     .../<region>/shard-<i>-of-<N>/leader) and runs an agent only
//     while leader; each term starts new incarnations (state is not carried
//     over, as the ledger package doc requires). A deposed leader cut off from
//     etcd but not from Redis can still renew its marker until the new
//     leader's marker (a Create with a higher incarnation) replaces it, after
//     which its renewals are refused by the store.
//   - agentd.RunCommand's HTTP server (--http-addr) serves /metrics, /healthz,
//     /readyz (200 once the agent has a rule set, its store's run id and a
//     NATS connection: Agent.Ready; a standby needs the connection too)
//     and GET /v1/shares?rule=ID (the rule's coordinated keys with
//     their units, rate and burst, busiest first), which rlctl limits show
//     --agents reads. It has no authentication: keep it on a private address.
//
// # Limits
//
//   - Registry size (see "Registry chunks"): each list costs about 30 bytes
//     per key in etcd and 90 bytes per 512 KiB chunk in the document, which
//     may not exceed 1 MiB. At 1,000,000 keys (BenchmarkRegistry1MKeys: a
//     33 KB document, 351 chunks, 182 MB) the write that completes a
//     reclaim puts ~150 MB of chunks (more than the 120 the swap checks one
//     by one, above) and took 11-12 s on 2 loaded cores, and a Records with
//     an empty cache 6.6-7.1 s: most of it the ledger.Registry's own work
//     (Contribute, State's sorting, RestoreRegistry, Records: ~10 s of CPU
//     in all) and JSON (~4 s). That is above EtcdTimeout (5 s): at that
//     scale a reclaim needs a longer EtcdTimeout or a cheaper
//     ledger.Registry, not smaller requests. At 10,000,000 keys the
//     document still fits (~0.3 MB), but a rule's chunks (~1.8 GB in six
//     lists) approach etcd's default backend quota (--quota-backend-bytes,
//     2 GB; etcd advises at most 8 GB), every reclaim rewrites GBs, and old
//     revisions keep deleted chunks until etcd compacts: beyond a few
//     million keys per rule the registry needs per-key deltas or sharding
//     (Shards), not chunks.
//   - A store write that takes effect later than StoreTimeout after it was
//     issued breaks the ledger's lease arithmetic; the agent bounds its own
//     calls by StoreTimeout (a go-redis client given to the store needs
//     ContextTimeoutEnabled for a deadline to bound a call's wait: agentd's
//     client has it, through internal/backend) and disables client
//     retries, but cannot stop a request already sent from being applied
//     late (a Redis that reads it and runs it only later: starved of CPU,
//     paused). Such a write applies the share writes late (they are
//     versioned: it changes nothing a later write has not), and a marker
//     write cannot hold its lease any longer for it: its end is capped at
//     the store's clock read before the write plus the lease, on a Cluster
//     per master (redisstore.WriteMarker).
//   - Shares, Snapshot, /v1/shares and the apportion_sync_share_units
//     gauge read the ledgers on demand on the loop goroutine (no copy of
//     the keys is kept between ticks), so they wait for the loop: up to a
//     tick, or a tick's store writes (bounded by StoreTimeout each), and at
//     most shareViewTimeout. Each visits every key a ledger holds, keeping
//     only the keys it answers with; the tick itself only counts the
//     coordinated keys for the gauge, every tenth tick (the gauge lags by
//     up to ten intervals).
//   - Reports wait for the loop in their encoded form, verified on the
//     NATS goroutine and decoded by the loop one at a time, and a window
//     of at most 4,096 keys at a time once the whole message is checked
//     (receiveWindow, wire.DecodeWindowsFromOwned: each window is merged as
//     a part of a report its sender split would be), without a copy (the
//     report's strings point into the NATS message's buffer, so what is
//     kept past it, a ledger's key names, the driver's last key per peer,
//     is copied; of each key's counters only those naming this region are
//     kept, wire.Regions.ReadBy), within a byte
//     budget (inbox.go: per sender 5/4 of the most report bytes this agent
//     published in one tick lately, every part counted, at least 4 MiB;
//     1,024 messages at most); past it
//     the oldest reports of the sender holding the most are dropped
//     (reason overflow), never a sender's newest unless past the count. Reports are cumulative, so a drop costs time only:
//     what it said comes back with the sender's next full report, within
//     FullEvery intervals.
//   - Shards: more than one needs a Redis Cluster; every shard receives
//     every usage delta of its region and drops the others' (no per-shard
//     usage subject: the enforcers would need the layout); a shard's
//     metrics, snapshot and /v1/shares cover its own keys, under group ids;
//     after a layout change a key whose record the old layout wrote
//     enforces its floor until its new group first writes it (the new
//     marker floors the old records); a layout change needs every old
//     agent stopped first (see Shards), which the agents cannot enforce on
//     one cut off from etcd.
package agent
