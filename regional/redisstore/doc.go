// Package redisstore is the enforcer's Redis side: it evaluates a request's
// buckets (token bucket, sliding window counter, fixed window, sliding log,
// leaky bucket) in Redis with Lua scripts, and implements the share
// ledger's store contract (sync/ledger) for global token buckets and global
// fixed and sliding windows.
//
// Invariants:
//
//   - All buckets of one request are evaluated in ONE script call, and the
//     call is all-or-nothing: the script first checks every bucket, then
//     writes only if every non-shadow bucket allows; a rejected request
//     consumes nothing from any bucket (a shadow bucket consumes only when
//     the request is allowed and it itself allows). Keys of one request share
//     a Redis Cluster hash tag (Key), so one script can touch them all.
//   - Integer arithmetic only. Capacities and rates are in thousandths of a
//     token (per second). Token and leaky buckets store their level in
//     millionths of a token ("thousandths" with the sub-thousandth remainder
//     kept), so a refill adds exactly elapsed_ms x rate and never drifts,
//     however often a bucket is checked. Elapsed time is capped at the time to
//     become full before multiplying, and parameters are bounded (MaxCapacity,
//     MaxRate, MaxCost, MaxLimitWindow), so every value the Lua script holds
//     stays below 2^53, where doubles are exact.
//   - The clock is Redis TIME (one clock for every enforcer of a region; tests
//     pass their own with WithClock). Elapsed time below zero is clamped to
//     zero: a clock step back never mints tokens. A token or leaky bucket
//     then takes the clock's time as its own (written even when the request
//     is rejected; nothing is consumed), so refill resumes at once instead of
//     freezing until the clock catches up. A fixed or sliding window whose
//     stored window is after the clock's takes the clock's window as its
//     own, its counts carried (written too, allowed or not): the window
//     then ends by the clock, which can be sooner than the stored one would
//     have in real time, so a step back can admit up to one window's limit
//     more, as a step forward can. A sliding log whose newest entry is
//     after the clock moves every entry back by as much, the newest to now
//     (written too), so each leaves the window when it would have without
//     the step: nothing more. Before 6 December 2026 such keys were read at
//     their stored time, and a key at its limit refused every request
//     until the clock caught up with it: as long as the step (an hour's
//     step back, an hour; TestContract, "clock step back"). A step forward
//     mints at most one bucket's capacity; so does a step back of a token
//     bucket by more than 5.8 days (its time is kept modulo 10^9 ms, below).
//     A step mints that much each time: a clock stepped back and forth n
//     times mints up to n capacities. A Redis clock that runs fast by a
//     fraction e refills e more of every bucket (the rate is its clock's);
//     no setting of the sync agents (--clock-rate-bound, for their leases)
//     changes that.
//   - Every key written has a TTL: the time to become full (token bucket,
//     from empty), to drain (leaky bucket), or for the data to stop counting
//     (windows), plus a slack (WithTTLSlack), at least 1s. An expired key
//     therefore always stands for the state a new key starts in (full token
//     bucket, empty leaky bucket, zero counts), except a global key holding
//     a share record that is not a Release record: it has at least the
//     record's Hold, which its writer renews (below, "Record TTLs"; with no
//     Hold it is persistent). The only keys without a TTL are the markers:
//     one per global rule (16384 slot copies per rule on a Cluster), each
//     overwritten in place, so bounded by the rules, not the keys; their
//     writer deletes the marker of a rule it no longer coordinates
//     (DeleteMarker, MarkerRules: marker_delete.go).
//
// Result semantics (all in ms from the evaluation time, exact):
//
//   - token_bucket: RetryAfterMs when rejected is the time until cost tokens
//     have refilled; ResetAfterMs the time until the bucket is full.
//   - leaky_bucket (a meter: the level drains at Rate; a request is allowed if
//     level + cost <= capacity): when allowed, RetryAfterMs is the delay
//     before the request's turn (the time for the level ahead of it to
//     drain); when rejected, the time until level + cost fits. ResetAfterMs
//     is the time until the level is zero. Remaining is the room left.
//   - fixed_window: RetryAfterMs and ResetAfterMs are the time until the
//     window ends.
//   - sliding_window (two fixed windows; the previous one weighted by the
//     part of it still inside the sliding window; compared exactly as
//     c*W + p*(W-off) + cost*W <= limit*W): RetryAfterMs is the first ms at
//     which the request would fit if nothing else arrived; ResetAfterMs the
//     time until the estimate is zero.
//   - sliding_log (one sorted-set member per token, scored by its ms):
//     RetryAfterMs is when enough entries have left the window; ResetAfterMs
//     when the newest one has. Memory grows with the limit.
//   - RetryAfterMs is Never (-1) when waiting cannot help: cost above the
//     capacity or limit, or a global share with rate zero. It is 0 when allowed
//     (except for leaky_bucket).
//
// Global buckets. A Bucket with Global set is a token bucket whose Capacity
// and Rate are the rule's GLOBAL ones, split into Global.Units units; the
// store enforces u units as capacity floor(C*u/U) and rate floor(R*u/U)
// (exact in Lua while U <= MaxUnits). Per global rule the region's store
// holds a marker (MarkerKey: incarnation, version, default units, the time it
// was applied and its lease end on the store clock, and the server run id it
// was created on; it never expires by TTL) and per key an optional share
// record (incarnation, version, units, Release) inside the bucket's value.
// A marker's lease ends no later than the store clock read just before the
// write was sent plus the lease, however late Redis runs the write (CPU
// starvation, a pause: TestLateMarkerWriteKeepsItsLeaseEnd), so a write
// applied late never holds a region's share longer than one applied at once.
// Check enforces, per key:
//
//   - Global.Floor if the marker is missing, not in force (lease over, the
//     clock before the time it was applied, or written under another server
//     run id, i.e. restored from a snapshot after a restart), or the key's
//     record belongs to another incarnation than the marker;
//   - the record's units if the key has a record of the marker's incarnation;
//   - the marker's default units otherwise (always at most Global.Units).
//
// When the enforced capacity or rate differs from what the bucket last saw,
// the bucket is settled at the rate and capacity it last saw up to now, then
// takes the new ones and its tokens are clamped to the new capacity, in the
// same script, and the new state is written even if the request is
// rejected. A state written by a regional check (no rate stored) gets no
// refill credit. A missing key starts full at its enforced capacity; an
// existing one gains no token when raised, except by the boot fill below.
// WriteShares applies a record whose version is not below the stored one
// with the same settle-set-clamp steps; a Release record gives the key the
// bucket's TTL (at least ShareRecord.TTL), any other the bucket's TTL, at
// least ShareRecord.Hold (no Hold: persistent), and Check keeps that TTL
// (KEEPTTL). WriteMarker applies a Create only on the server run
// it names, above the held version; a renewal only over a held marker of the
// same incarnation, at or above its version. Both return the version held
// afterwards. A regional check on a key holding a global state keeps only
// its tokens (a rule that changes scope loses its records).
//
// The boot fill. A raise adds no tokens, with one exception. A marker is
// a boot marker when it is a Create of incarnation 1 (a region's first),
// flagged Boot by its writer (below), applied over no marker of the
// server run, and stays one through writes
// of its incarnation with the same default units applied while it is in
// force (flagged by bit 47 of its stored sequence); any other write ends
// it. When a key's settle step finds a boot marker in force, a stored e
// equal to the floor, and units u above the floor enforced since the
// marker's Create (the held record's or the default; for WriteShares the
// units before the new record), its tokens get floor(C*min(u,D)/U) -
// floor(C*F/U) more, D the marker's default: a key built at the floor
// before the region's first marker holds what a bucket of min(u,D) units
// started full at its creation would, as the static split's does.
//
// Why it stays within the global bound (C + R*T over any T). Charge each
// region a virtual bucket L_i: until its marker applies, D units (a first
// incarnation's base B_i: the ledger publishes nothing before its first
// marker is confirmed, so its published position is at least B_i), from
// then on the units the contract enforces; L_i refills at its charge's
// rate, is clamped when the charge falls and gains nothing when it rises.
// The charges sum to at most U at every instant (sync/ledger, invariant
// 1), so the regions admit at most sum L_i(s) + R*T <= C + R*T in any
// [s, s+T] as long as each real bucket holds at most L_i. Before the fill
// L_i >= min(cap(X), t + cap(X) - cap(F)), X = min(u, D): it starts so
// (full against full), admissions take the same from both, and L_i refills
// at least as fast and is clamped no lower. So the fill leaves t <= L_i,
// and from then on both follow the same units. It applies at most once
// per key: a state written while a boot marker is in force has e = the
// units then enforced, which change only by a write to the key (the
// default cannot change within a boot). Hence no fill on a later raise
// (a giver's used tokens plus fresh ones would exceed the bound), for a
// later incarnation (its records carry gifts), after a lapse (the Create
// that follows is not over "no marker") or a default change (a reclaim
// payment). A Redis that restarts empty forgets the keys' use, and the
// store cannot tell its re-created marker from a first one; the writer can,
// so a boot marker also needs the Create flagged Boot (Marker.Boot), which
// the ledger sets only on its first incarnation's Creates before any of its
// markers was confirmed and before any store reset (a Create naming the
// run id of a store that restarted since is refused anyway). Without the
// flag a re-created marker fills nothing, and a restart re-mints only what
// it always did: the floor's burst of keys that start anew.
// TestGlobalContract's boot cases fail if the fill applies on a later
// raise, for incarnation 2, for a Create not flagged Boot, after a lapse or
// after a default change.
//
// Global windows. A fixed_window or sliding_window Bucket with Global set
// has the rule's GLOBAL limit L per window W; with u units (chosen exactly
// as above: floor, record or the marker's default) the key admits while its
// use of the window stays within the allowance A = floor(L*u/U). Its use is
// n for a fixed window, and for a sliding window the estimate
// c + p*(W-off)/W (compared exactly, times W). A window has no refill to
// settle, so a share change needs no settle step. Instead WriteShares (and
// WriteWindowShares, which also says why) refuses a record, and the key
// keeps the version it held, when the key has used more of its window than
// the allowance of the record's units or of the units it would enforce
// with it (the floor, for a record of another incarnation than the
// marker's). A refusal answers the fewest units the key could take now
// (the least u whose allowance covers the use) and the time until the
// window ends. The sync agent hands that to its ledger (Ledger.Hold), which
// cancels the unconfirmed part of the gift and gives only what is above
// it: a region gives only what it has not used of its window, and the rest
// once that window is over. Records, TTLs and markers are as for token
// buckets; a regional check of a key with global window state keeps its
// counts and drops the record.
//
// Invariant (global windows): at every instant, the regions' uses of their
// current windows sum to at most L. Per region, use <= A at all times: an
// admission needs use + cost <= A, a raise only widens A, a lowering
// applies only if use <= the new A, and the use never grows otherwise (a
// fixed count resets when its window ends; a sliding estimate decays as the
// previous window slides out and is continuous at the boundary, where the
// count moves to p with weight 1). The ledger confirms, so publishes, a gift
// only once the store holds the lowered record, so the units the regions
// enforce sum to at most U exactly as for token buckets (sync/ledger), and
// the allowances to at most sum floor(L*u_i/U) <= L. Not covered: (a) a
// lapsed lease lowers a region to its floor whatever it has used; survivors
// therefore reclaim a window rule's share one window later (sync/agent
// adds W(1+rho)/(1-rho) to the wait), when the lapsed window is over; (b) a
// region whose agent restarts has its old records count at the floor at
// once, and a peer that sees the new incarnation reclaims the old one
// without waiting: that window may admit up to the restarted region's use
// above its floor more; (c) a Redis that restarts empty forgets the
// window's use (as for regional windows). Each region's windows follow its
// own Redis clock, so with clocks offset by d an observer's calendar window
// may also see what the regions admit within d of its boundary.
//
// Record TTLs. A key without a record enforces the marker's default units
// (the base), and that is right for a key the region's ledger never wrote:
// the ledger counts every such key at its base. So a record must not vanish
// while its incarnation's marker may be in force: a record below the base
// would come back at the base, above what the ledger published. A record
// of a key whose agent is gone for good (or of a region taken out) must
// still go, or the keys would pile up. Hence the Hold: the key of a record
// that is not a Release record expires Hold after its last write, and its
// writer writes it again, same version (re-applied: only the TTL changes),
// well within the Hold. sync/agent's Hold (Config.RecordHold, default 1h,
// never below 4(Lease + Interval + StoreTimeout)) is renewed every Hold/2:
// a live agent renews it Hold/2 before it would expire, and a dead agent's
// marker lease lapses (the store then enforces the floor on every key)
// before its records can expire (Hold/2 - Interval > Lease). Eviction is the one way around it: a
// volatile-* maxmemory policy may evict a held record (volatile-ttl only
// after every key closer to expiry); size maxmemory so that it does not
// evict. TestEveryKeyHasATTL and TestClusterEveryKeyHasATTL list every key
// written (SCAN, PTTL) after a run with every kind and find a TTL on each
// but the markers.
//
// Redis Cluster (a client of type *redis.ClusterClient): a check's keys and
// the marker it reads must share one hash slot, so a global rule's marker
// has one copy per slot, ClusterMarkerKey: "rl:marker:{<tag>}:<rule>" with
// <tag> the shortest base-36 numeral hashing to the slot (precomputed). A
// check, and a share record's write, read the copy of their own slot: one
// script call, no cross-slot access. The store, not the agent, fans a
// marker out: WriteMarker writes all 16384 copies, one script call per copy
// (pipelines of 1024, which go-redis splits per master), and returns the
// lowest version any copy holds. The fan-out runs in the background, one
// per rule at a time (the newest waiting write next): a Create is waited
// for, up to 10 s (the ledger confirms it by its version); a renewal only
// within the caller's budget, after which WriteMarker returns the version
// the copies already hold, so the agent's tick is never held by it. Alternatives considered: copies only in the slots that hold
// keys (a key in a new slot would enforce its floor until the agent heard of
// it); a hash tag per marker shard in the bucket key (breaks the client hash
// tag users rely on); a cross-slot script (allow-cross-slot-keys, Redis 7:
// fails while a slot migrates). The copies cost writes, not checks:
// TestClusterGlobal logs one fan-out (EVALSHA per copy, INFO commandstats).
// So a renewal that changes nothing but the lease is fanned out only once
// FanoutEvery has passed since the last fan-out or half its lease is gone;
// in between the copies keep the earlier (earlier ending, so safe) lease.
// A sharded sync agent's store (WithMarkerSlots, ShardSlots) writes only
// the copies of its shard's slot range, so each copy belongs to one shard:
// checks are unchanged (TestMarkerSlots; sync/agent, "Shards").
//
// The lease on the store clock: each copy's lease runs on the clock of the
// master holding it (the script reads TIME there), and is capped at that
// master's TIME read before the fan-out plus the lease, so a fan-out that
// takes longer than one write (it runs past the caller's budget, up to
// 10 s) never ends a copy's lease later than a write applied at its start.
//
// RunID on a Cluster is "cluster-" and a digest of the slot map with every
// master's run id (INFO server per master, CLUSTER SLOTS): it changes on a
// failover, a master's restart and a slot migration, so the agent treats
// each as a store reset (StoreReset): it re-asserts every record, then
// re-creates the marker. A Create names such a run id, and each copy
// applies only on the master that view put in its slot, with that master's
// run id. Until then: a promoted replica may lack the last writes its master
// confirmed (replication is asynchronous; a lowering lost would raise a
// share), but every marker copy it holds carries the old master's run id,
// so its slots enforce the floor; a migrated slot's copies arrive with the
// source master's run id and enforce the floor on the target likewise. Keys
// move with their values; a check during a migration may get ASK or MOVED
// (the store sends it again through the Cluster client, which follows
// them) or TRYAGAIN (its keys split between the two masters: an error the
// failure policy answers, for that check alone; a multi-call script call
// answered TRYAGAIN is sent again one call at a time, so that the calls of
// the slot whose keys are in one place succeed). TestClusterFaults runs a
// region on 3 masters with a replica each and checks that no check enforces
// more than its key's bound through a slot migration and a master kill that
// loses a confirmed lowering; TestAgentsWithRedisCluster in sync/agent runs
// the agents' scenario with one region on a Cluster. On a connection error the store has go-redis
// reload its slot map (at most every 200 ms), so checks follow a promoted
// replica at once.
//
// Failure domains (lane.go). On a Cluster each master is a failure domain
// of its own (Domain: the master the client's slot map has for a key's
// slot), with its own lane: its own queue and workers, whose pipelines go
// to that master's own go-redis client, and its own record of when it last
// answered (the Activity keeps one per address), round trip and scripts in
// flight. So a master that is killed, stopped or slow fails, and holds,
// only the calls of its own keys: another master's calls never share a
// pipeline with its calls (a Cluster pipeline waits for its slowest
// master, and retries a failed master's commands after backoffs), never
// queue behind its workers, and are never blamed for its silence. A Do
// over several masters waits for each one's calls concurrently. The
// enforcer keeps a circuit breaker per domain (regional, DomainStore), and
// Load is per domain too (DomainLoad). A replica promoted in place of a
// master is a new domain, found once go-redis reloads its slot map.
// TestClusterMasterFailureFailsOnlyItsKeys in regional stops a master,
// kills another and leaves a slot half migrated under load, and finds no
// check of the other masters' keys answered but by Redis.
//
// State layout. Token bucket, leaky bucket, fixed and sliding window state
// is one Redis string per key of little-endian unsigned integers (6 bytes
// unless said): token bucket t (millionths of a token), l (last refill, ms),
// 12 bytes; a global token bucket t, l, e (4 bytes: the units it last
// enforced; its capacity and rate are those units' share of the rule's
// global ones), 16 bytes, and with a share record also the record's
// incarnation (3 bytes), sequence (5 bytes) and units*2+release (4 bytes),
// 28 bytes. (The 24- and 36-byte global layouts of earlier versions, with
// the capacity and rate instead of e, are still read.) A regional token
// bucket of at most 8000 tokens (8*10^9 millionths) whose TTL is under
// 5*10^8 ms (5.8 days) is instead one 19-digit decimal, 10^18 + t*10^9 +
// (l mod 10^9), which Redis keeps as an integer (no string allocation); l
// is read back as the time within 5*10^8 ms of now congruent to it, which
// is l itself since the key expires first (a clock step back by more than
// that reads as a step forward: it mints at most a capacity, as one does).
// Leaky bucket t (level), l; fixed window w (window index), n (count);
// sliding window w, c (count in w), p (count in w-1); a global window
// with a share record adds the record's incarnation, sequence and
// units*2+release as a token bucket does: 24 bytes, and 28 for a sliding
// window, whose c and p then take 5 bytes each (30 bytes, 6 each, when a
// count reaches 2^40; also read, as written by earlier versions). The sliding log
// is a sorted set. A marker is 5 6-byte integers (inc, seq with bit 47 set
// for a boot marker, units, applied at, lease end) and the run id.
//
// Memory, measured with MEMORY USAGE on Redis 7.0 (jemalloc) for the
// typical key rl:{user:42}:orders-free (go test -v -run TestMemoryUsage
// ./regional/redisstore/): a token bucket 72 bytes (88 in the 12-byte
// layout), leaky bucket and fixed window 88, sliding window 104, a global
// token bucket 104 with or without a share record (120 in the 36-byte
// layout), a global fixed or sliding window with a share record 104 (the
// sliding one 120 in the 30-byte layout), a sliding log 120 after one
// request (one member per token), a marker 152. What sets them: the key entry (24) and the key (32 for this
// one) are fixed; an integer-encoded value costs 16, an embedded string of
// n bytes the jemalloc class of 20+n (32 up to 12 bytes, 48 up to 28, 64
// up to 44). A share record within 100 bytes would need its whole state in
// 12 bytes (96 bits), and it holds 8 bytes of version (incarnation and
// sequence, which order the writes and tell the marker's records from
// older ones), up to 27 bits of units and Release, the tokens (up to 48
// bits) and the refill time: even with the time kept modulo 2^32 (the Hold
// bounds a record's age) and e as one bit (floor or the record's units),
// about 170 bits. The TTL (Hold) costs the expires table's entry, which
// MEMORY USAGE does not count. A hash {t, l} takes 104 whatever the field
// names (its listpack falls in the 32-byte class). Writes are one SET with
// PX (KEEPTTL for a check of a key holding a record that is not a Release
// record: it keeps its Hold), so Redis 6.0 or later is needed. A rule whose algorithm changes should get
// a new key (for example a rule version in Key's extras): the layouts
// differ and a mismatch is an error.
//
// Concurrent Check and Do calls are pipelined: a channel feeds a fixed
// number of worker goroutines, each draining up to the batch size of pending
// script calls into one pipeline of EVALSHA commands (after one
// runtime.Gosched, so that the handlers runnable at that moment join it).
// A call costs its caller no allocation of its own: a Do's call, with its
// done channel (one value, sent by the worker as its last touch of it),
// comes from a pool and goes back once its caller has received that value,
// and each worker reuses its pipeline's buffers and go-redis Pipeline. The
// worker, not the caller, does the I/O. A caller that finds a worker idle
// and sends its pipeline itself ("leader flushes") saves the worker's
// wake-up, but it cannot give up while it reads (go-redis reads until its
// deadline, and a timed-out read closes the connection), so its own
// budget could not end its wait early; and it sends smaller pipelines:
// measured with ratelimitd at 16 callers (a build that did so, against
// this one, alternating, 3 to 5 runs each), 2.8-3.1 checks per Redis read
// against 4.2 with the workers, and about a fifth more CPU and a tenth
// more context switches per check (medians 60 against 50 us, 1.2 against
// 1.05): the batching a worker's yield gathers is worth more than the
// wake-ups it costs. Each waiting caller has one timer (from a pool, stopped
// unfired when the answer comes first), not a shared ticker: a timer that
// never fires costs no wake-up, a ticker waking the waiting callers would.
// The calls of one Do
// (a CheckLimits batch) go into one pipeline together, and all the calls of
// a pipeline (the Dos and Checks of every caller the worker drained), two
// or more, into one script call: the multi-call script (multiSrc) evaluates
// each call as the check script does (all-or-nothing within a call,
// independent between calls, in order) with one TIME for all, and
// concatenates their replies, which the store splits back. In it a call of
// one token bucket costs Redis about a quarter less than alone (the EVALSHA
// and TIME are shared; BenchmarkCheck/parallel's redis-cpu-µs/op, 48
// checks per pipeline: 9.0 -> 6.2 µs, medians of 6 runs alternating). On a
// Redis Cluster a pipeline holds the calls of one master (its lane: see
// "Failure domains" above),
// and they share a script call only within one hash slot (one per slot). A
// Redis-side error in one call (a bad state, WRONGTYPE) is caught in the
// script (pcall) and fails only that call, with that error reply
// (TestSharedScriptCallIsolatesErrors); an
// invalid call fails before sending, as alone. A pipeline of one call is
// one check script call. On NOSCRIPT the
// scripts are loaded and the call retried (ScriptLoads counts the loads);
// Warm loads the scripts and opens the connections the workers' pipelines
// use (go-redis's pipeline pool, one per worker) before the first check. The go-redis client's own retries may re-run a script whose reply
// was lost; configure MaxRetries to taste (on a Cluster a master's pipeline
// goes to its node client, which has the Cluster's MaxRetries; a call sent
// again after MOVED, ASK or TRYAGAIN is not retried on errors). A check's reply is read as a
// list of integers: any other (a bug) fails its call with ErrBadReply, and
// go-redis stops reading that connection there, failing the calls behind it
// in the pipeline with the same error.
//
// Closed idle connections. Redis closes a client idle past its timeout
// (CONFIG SET timeout), and a restart closes them all; an enforcer idle
// meanwhile must not send its next checks into them (with no client
// retries each would fail, answered by the failure policy: a limit
// bypass). go-redis's pool peeks at an idle connection's socket before
// handing it out and dials anew for one its peer closed; the Activity's
// connections expose their socket for that (syscall.Conn), except under
// TLS, where go-redis does not look (a record waiting there could block
// the look): keep Redis's timeout at 0 with TLS. A connection closed in the
// instant between that look and the write still fails its pipeline (EOF),
// which is not sent again: an EOF or a reset before any reply byte does
// not tell a Redis that closed the connection before our write arrived
// (nothing ran) from one that ran the scripts and then died (a restart,
// a crash), and a retry of the latter would charge the buckets twice.
// TestIdleConnectionsClosedByRedis and TestIdleConnectionsAfterRestart
// send a burst after each with no check failing.
//
// Budgets. Do takes a Budget with two parts, measured apart: Queue, the wait
// for a worker (this process's own load), and RoundTrip, Redis. A call past
// Queue fails with ErrQueueTimeout and is never sent. A sent call fails with
// ErrTimeout only when Redis has answered nothing, to anyone, for RoundTrip
// plus what this process itself explains: 5x its network lag (a probe times
// a byte through a local socket pair, the way a reply reaches a worker; a
// probe that stopped ticking means the whole process was paused) and twice
// the time Redis needs for the scripts in flight (Redis runs them one after
// another and writes one event-loop turn's replies together). With an
// Activity only the scripts written count: a worker dialing, or waiting in
// a new connection's handshake (its HELLO written, Redis silent: a
// stopped Redis accepts connections into its kernel backlog), has put no
// script in Redis, so that silence is Redis's (TestHandshakeSilenceIsRedis,
// TestStoppedRedisBehindNewConnections); and the time per script is
// measured only by pipelines that dialed no connection, each raising it by
// at most three eighths (a pipeline answered after a stall measured the
// stall, and an estimate that high would excuse the next one). While Redis
// keeps answering, a call behind this process's backlog may wait until
// Queue + RoundTrip has passed, then fails with ErrQueueTimeout: overload,
// not a store failure. Given an Activity (WithActivity, with the client's
// connections dialed through its Dialer) the store hears Redis on every
// reply, not only when a pipeline completes, and before blaming a silence
// it asks the kernel whether a reply waits unread in a socket (then Redis
// has answered and this process is behind). With WatchLocalRedis (a Redis
// on this host; KeepWatchingLocalRedis looks again while none is watched,
// for a Redis down at start or restarted) a silence during which Redis was waiting for a CPU
// (runnable and hardly running, from /proc/PID/schedstat and stat) is
// overload too: the call waits up to Queue + RoundTrip, then fails with
// ErrQueueTimeout; a Redis that sleeps, is stopped, runs a long script or
// is gone still fails it with ErrTimeout. A caller's ctx ends its wait
// at once whatever Redis does; a call answered after it was sent may still
// have run in Redis.
//
// Script cost. A script's top level runs on every EVALSHA, and every table
// and closure it builds is built and collected per call (about 1,000
// instructions each on Redis 7), so the check script keeps its helpers few
// and builds those of a kind of bucket (token or leaky bucket, window,
// global) only at the first bucket of that kind; helpers return several
// values rather than tables, struct formats are literals, the plans of
// all buckets are one table, and a call of one regional token bucket takes
// a path with no plans at all. Such a call is about 78,000 instructions in
// Redis (86,000 in the decimal layout), of which the EVALSHA, TIME, GET and
// SET are 39,000; a global check adds INFO server (the run id), about
// 65,000. In the multi-call script a call costs about 23,000 fewer (the
// EVALSHA and TIME are shared, and a call's keys and arguments are read at
// offsets, no tables built: 62,600 per call of one token bucket in the
// decimal layout, 32 calls per script call, against 85,800 alone).
// TestScriptCost measures each path (see its doc).
//
// Embedded servers. The scripts also run on an in-process miniredis (the
// local stack without redis-server), whose Lua (gopher-lua) has no struct
// library and which answers that INFO server is not supported. The scripts
// then pack the same bytes in plain Lua (string.byte, string.char, exact
// arithmetic on doubles; on Redis they keep struct, which is faster), and
// the run id is EmbeddedRunID, fixed: an embedded server's data dies with
// its process, so no marker can come back from another run. RunID falls
// back only on that answer; a network error is an error. miniredis expires
// keys only as its clock advances with ClockTTL(true) (or FastForward), and
// its MEMORY USAGE is not Redis's.
//
// Model is the same logic in pure Go: the specification the differential
// test holds the scripts to, and a store for simulations in virtual time.
package redisstore
