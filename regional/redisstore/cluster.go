package redisstore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Redis Cluster support (see the package doc, "Redis Cluster"): a global
// rule's marker has one copy per hash slot, so that the one script of a
// check finds the marker in its own slot.

// Slots is the number of Redis Cluster hash slots.
const Slots = 16384

// FanoutEvery is how often, at most, a marker renewal that changes nothing
// but the lease is written to every slot's copy in a Cluster: renewals in
// between leave the copies' earlier, shorter leases in place.
const FanoutEvery = time.Second

// fanoutTimeout bounds one marker fan-out to every slot's copy, sent
// fanoutChunk copies per pipeline.
const (
	fanoutTimeout = 10 * time.Second
	fanoutChunk   = 1024
)

// crc16 is CRC-16/XMODEM, the Redis Cluster key hash.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for j := 0; j < 8; j++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// HashSlot is the Redis Cluster slot of key: CRC16 of its hash tag (the
// part between the first '{' and the next '}', if not empty) or of the whole
// key, modulo 16384.
func HashSlot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	return int(crc16(key) % Slots)
}

// slotTags[s] is the shortest base-36 numeral whose hash slot is s (the
// first found counting up), the hash tag of slot s's marker copies.
var slotTags = sync.OnceValue(func() []string {
	tags := make([]string, Slots)
	left := Slots
	for i := int64(0); left > 0; i++ {
		t := strconv.FormatInt(i, 36)
		if s := crc16(t) % Slots; tags[s] == "" {
			tags[s] = t
			left--
		}
	}
	return tags
})

// ClusterMarkerKey is the copy of rule's marker that a check of key reads
// in a Redis Cluster: "rl:marker:{<tag>}:<rule id escaped as in Key>", where
// <tag> is a fixed string hashing to key's slot, so key and the copy share a
// slot.
func ClusterMarkerKey(ruleID, key string) string { return slotMarkerKey(ruleID, HashSlot(key)) }

func slotMarkerKey(ruleID string, slot int) string {
	var b strings.Builder
	b.WriteString("rl:marker:{")
	b.WriteString(slotTags()[slot])
	b.WriteString("}:")
	escape(&b, ruleID, true)
	return b.String()
}

// markerKeyFor is the marker key a script touching key reads.
func (s *Store) markerKeyFor(ruleID, key string) string {
	if s.cluster != nil {
		return ClusterMarkerKey(ruleID, key)
	}
	return MarkerKey(ruleID)
}

// clusterView is one reading of the cluster: which master serves each slot,
// and that master's address and run id.
type clusterView struct {
	owner   []uint16 // slot -> index in addrs/runs
	addrs   []string
	runs    []string
	created time.Time
}

// fanout is the last marker write that reached every slot's copy.
type fanout struct {
	ver   Version
	units int64
	at    time.Time // local clock, when it started (its leases count from before then)
	done  time.Time // local clock, when every copy had answered
	lease time.Duration
}

type clusterState struct {
	reloadAt atomic.Int64 // unix ns of the last slot map reload clusterTrouble started
	mu       sync.Mutex
	views    map[string]*clusterView // by run id (the newest few)
	latest   *clusterView
	fanned   map[string]fanout  // by rule
	running  map[string]*fanJob // by rule: the fan-out in flight
	pending  map[string]*fanJob // by rule: the next one
	wg       sync.WaitGroup     // the fan-outs running
}

// clusterRunID reads the cluster's masters (INFO server, CLUSTER MYID) and
// slots (CLUSTER SLOTS) and returns a run id that changes whenever any slot
// changes master or any master's run id changes (a failover, a restart, a
// slot migration): "cluster-" and 24 hex digits of a SHA-256 of the slot
// map. The view it names is kept for WriteMarker's Create.
func (s *Store) clusterRunID(ctx context.Context) (string, error) {
	type master struct{ addr, run string }
	var mu sync.Mutex
	byID := map[string]master{}
	err := s.cluster.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		info, err := c.Info(ctx, "server").Result()
		if err != nil {
			return err
		}
		run, err := parseRunID(info)
		if err != nil {
			return err
		}
		id, err := c.ClusterMyID(ctx).Result()
		if err != nil {
			return err
		}
		mu.Lock()
		byID[id] = master{c.Options().Addr, run}
		mu.Unlock()
		return nil
	})
	if err != nil {
		s.cluster.ReloadState(ctx)
		return "", fmt.Errorf("redisstore: cluster run id: %w", err)
	}
	ranges, err := s.cluster.ClusterSlots(ctx).Result()
	if err != nil {
		s.clusterTrouble(err)
		return "", fmt.Errorf("redisstore: cluster run id: %w", err)
	}
	slices.SortFunc(ranges, func(a, b redis.ClusterSlot) int { return a.Start - b.Start })
	v := &clusterView{owner: make([]uint16, Slots), created: time.Now()}
	index := map[string]int{}
	var canon strings.Builder
	covered := 0
	for _, r := range ranges {
		if len(r.Nodes) == 0 || r.Start < 0 || r.End >= Slots || r.End < r.Start {
			return "", fmt.Errorf("%w: CLUSTER SLOTS range %d-%d", ErrBadReply, r.Start, r.End)
		}
		m, ok := byID[r.Nodes[0].ID]
		if !ok {
			// The client's view of the masters is behind CLUSTER SLOTS.
			s.cluster.ReloadState(ctx)
			return "", fmt.Errorf("redisstore: cluster run id: slots %d-%d served by %s, not a master the client knows yet", r.Start, r.End, r.Nodes[0].Addr)
		}
		i, ok := index[m.run]
		if !ok {
			i = len(v.addrs)
			index[m.run] = i
			v.addrs = append(v.addrs, m.addr)
			v.runs = append(v.runs, m.run)
		}
		for sl := r.Start; sl <= r.End; sl++ {
			v.owner[sl] = uint16(i)
		}
		covered += r.End - r.Start + 1
		fmt.Fprintf(&canon, "%d-%d:%s;", r.Start, r.End, m.run)
	}
	if covered != Slots {
		return "", fmt.Errorf("redisstore: cluster run id: %d of %d slots served", covered, Slots)
	}
	sum := sha256.Sum256([]byte(canon.String()))
	id := "cluster-" + hex.EncodeToString(sum[:12])
	cs := &s.cs
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if old := cs.views[id]; old != nil {
		cs.latest = old
		return id, nil
	}
	if len(cs.views) >= 8 {
		var oldest string
		for k, x := range cs.views {
			if oldest == "" || x.created.Before(cs.views[oldest].created) {
				oldest = k
			}
		}
		delete(cs.views, oldest)
	}
	cs.views[id] = v
	cs.latest = v
	return id, nil
}

// writeMarkerCluster is WriteMarker on a Cluster: the marker is written to
// every slot's copy, one script call per copy, pipelined (go-redis groups
// them by master). A Create names the run id of a view read by RunID: each
// copy applies only on the master that view says serves its slot, with that
// master's run id, and a renewal too applies only there. Each copy's lease
// ends at the latest at its master's TIME read before the fan-out plus the
// lease, so however long the fan-out takes, no copy's lease ends later than
// a single write applied at the start would. A renewal that changes nothing
// but the lease is fanned out only when the copies' last lease is half gone
// or FanoutEvery has passed; in between the copies keep the earlier, earlier
// ending lease, and the version returned is the one they hold. It returns
// the lowest version any copy holds afterwards.
func (s *Store) writeMarkerCluster(ctx context.Context, rule string, m Marker, now any) (Version, error) {
	cs := &s.cs
	start := time.Now()
	cs.mu.Lock()
	last, had := cs.fanned[rule]
	view := cs.latest
	if m.Create {
		view = cs.views[m.RunID]
	}
	cs.mu.Unlock()
	if m.Create && view == nil {
		// A run id this store never read, or one read long ago: the
		// cluster has changed since, and the ledger will hear a new one.
		return Version{}, nil
	}
	if !m.Create && had && last.ver.Inc == m.Inc && !m.Version().Less(last.ver) && last.units == m.Units &&
		start.Sub(last.done) < FanoutEvery && last.at.Add(last.lease).Sub(start) >= m.Lease/2 {
		return last.ver, nil
	}
	if view == nil {
		if _, err := s.clusterRunID(ctx); err != nil {
			return Version{}, err
		}
		cs.mu.Lock()
		view = cs.latest
		cs.mu.Unlock()
	}
	// Anchors: each master's clock now, before any copy is written.
	caps := make([]any, len(view.addrs))
	for i := range caps {
		caps[i] = ""
	}
	if now == "" {
		err := s.cluster.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			i := slices.Index(view.addrs, c.Options().Addr)
			if i < 0 {
				return nil
			}
			tm, err := c.Time(ctx).Result()
			if err != nil {
				return err
			}
			caps[i] = tm.UnixMilli() + m.Lease.Milliseconds()
			return nil
		})
		if err != nil {
			return Version{}, fmt.Errorf("redisstore: write marker of %q: master clocks: %w", rule, err)
		}
		for i, c := range caps {
			if c == "" {
				return Version{}, fmt.Errorf("redisstore: write marker of %q: master %s not reachable", rule, view.addrs[i])
			}
		}
	}
	job := &fanJob{rule: rule, m: m, view: view, caps: caps, now: now, start: start, done: make(chan struct{})}
	held := Version{}
	if had {
		held = last.ver
	}
	cs.mu.Lock()
	if cs.running[rule] != nil {
		// One fan-out per rule at a time: this one goes next (the newest
		// waiting one wins; its anchors are already read).
		if old := cs.pending[rule]; old != nil {
			old.ver = cs.fanned[rule].ver // superseded: never sent
			close(old.done)
		}
		cs.pending[rule] = job
	} else {
		cs.running[rule] = job
		cs.wg.Add(1)
		go s.runFanouts(job)
	}
	cs.mu.Unlock()
	// A Create is waited for (the ledger confirms it by the version, and
	// re-issues it with a newer one after its RetryWrite); a renewal only
	// within the caller's budget: meanwhile the copies hold held or more.
	wait := ctx
	if m.Create {
		var cancel context.CancelFunc
		wait, cancel = context.WithTimeout(context.WithoutCancel(ctx), fanoutTimeout)
		defer cancel()
	}
	select {
	case <-job.done:
		return job.ver, job.err
	case <-wait.Done():
		return held, nil
	}
}

// fanJob is one marker write to every slot's copy.
type fanJob struct {
	rule  string
	m     Marker
	view  *clusterView
	caps  []any // per master: the latest lease end ("" none)
	now   any
	start time.Time
	done  chan struct{} // closed when ver and err are set
	ver   Version
	err   error
}

// runFanouts runs job, then the rule's pending jobs, one after another.
func (s *Store) runFanouts(job *fanJob) {
	cs := &s.cs
	defer cs.wg.Done()
	for job != nil {
		job.ver, job.err = s.fanOut(job)
		close(job.done)
		cs.mu.Lock()
		next := cs.pending[job.rule]
		delete(cs.pending, job.rule)
		if next == nil {
			delete(cs.running, job.rule)
		} else {
			cs.running[job.rule] = next
		}
		cs.mu.Unlock()
		job = next
	}
}

// fanOut writes job's marker to every slot's copy (those of WithMarkerSlots'
// range) and returns the lowest version a copy holds afterwards.
func (s *Store) fanOut(job *fanJob) (Version, error) {
	m, view, caps, rule := job.m, job.view, job.caps, job.rule
	create := createArg(m)
	// The copies may take longer than the caller's budget for one write
	// (16384 script calls): every lease is already capped by its anchor
	// and every copy is ordered by its version, so a copy applied late
	// grants nothing an on-time write would not.
	ctx, cancel := context.WithTimeout(s.ctx, fanoutTimeout)
	defer cancel()
	// In chunks: one pipeline of 16384 scripts would hold a busy master's
	// connection past the client's write timeout.
	var low Version
	lo, hi := s.opts.markerSlots()
	for from := lo; from < hi; from += fanoutChunk {
		cmds := s.evalShas(ctx, s.marker, min(fanoutChunk, hi-from), func(i int) []string { return []string{slotMarkerKey(rule, from+i)} },
			func(i int) []any {
				o := view.owner[from+i]
				return []any{m.Inc, m.Seq, m.Units, m.Lease.Milliseconds(), create, view.runs[o], job.now, caps[o], view.runs[o]}
			})
		for i, c := range cmds {
			r, err := c.Result()
			if err != nil {
				return Version{}, fmt.Errorf("redisstore: write marker of %q, slot %d: %w", rule, from+i, err)
			}
			v, err := parseVersion(r)
			if err != nil {
				return Version{}, err
			}
			if from+i == lo || v.Less(low) {
				low = v
			}
		}
	}
	if low == m.Version() {
		s.cs.mu.Lock()
		s.cs.fanned[rule] = fanout{ver: low, units: m.Units, at: job.start, done: time.Now(), lease: m.Lease}
		s.cs.mu.Unlock()
	}
	return low, nil
}

// Version is m's version.
func (m Marker) Version() Version { return Version{m.Inc, m.Seq} }

// clusterTrouble reloads the client's slot map, at most every 200 ms and in
// the background, when a call failed with anything but a Redis error reply
// (a master gone: go-redis otherwise keeps sending that master's slots to
// it until its own periodic reload; MOVED it handles itself).
func (s *Store) clusterTrouble(err error) {
	if s.cluster == nil || err == nil {
		return
	}
	var rerr redis.Error
	if errors.As(err, &rerr) && !strings.HasPrefix(rerr.Error(), "CLUSTERDOWN") {
		return
	}
	now := time.Now().UnixNano()
	last := s.cs.reloadAt.Load()
	if now-last < int64(200*time.Millisecond) || !s.cs.reloadAt.CompareAndSwap(last, now) {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(s.ctx, 2*time.Second)
		defer cancel()
		s.cluster.ReloadState(ctx)
	}()
}
