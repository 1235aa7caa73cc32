package redisstore

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Deleting markers. A marker has no TTL (package doc), so the marker of a
// rule nobody coordinates any more would stay for good: one key per rule,
// 16384 per rule on a Cluster. Its writer deletes it once it no longer
// coordinates the rule (sync/agent: after the rule's ledger stopped), and
// lists the markers it holds (MarkerRules) to delete those of rules deleted
// while it was down. A check that still reads a deleted marker (its
// enforcer's rule set still has the rule) enforces the key's floor, as for
// any missing marker: deleting one never raises a share.

// markerScanCount is the COUNT of one SCAN of MarkerRules.
const markerScanCount = 1000

// markerPrefix starts every marker key, and no other key the store
// writes: a bucket key starts "rl:{" (Key).
const markerPrefix = "rl:marker:"

// DeleteMarker deletes rule's marker: on a Cluster every copy of the slots
// WriteMarker writes (WithMarkerSlots; all by default). A fan-out of the
// rule's marker in flight is waited for (within ctx) and one waiting
// behind it is dropped, so no copy written by an earlier WriteMarker of
// this store lands after the delete; the writer must not call WriteMarker
// for rule while DeleteMarker runs. A later WriteMarker Create of rule
// makes a new marker. Deleting a marker that does not exist is no error.
func (s *Store) DeleteMarker(ctx context.Context, rule string) error {
	if rule == "" {
		return fmt.Errorf("%w: rule is empty", ErrInvalidShare)
	}
	if s.cluster == nil {
		if err := s.client.Del(ctx, MarkerKey(rule)).Err(); err != nil {
			return fmt.Errorf("redisstore: delete marker of %q: %w", rule, err)
		}
		return nil
	}
	if err := s.stopFanouts(ctx, rule); err != nil {
		return err
	}
	lo, hi := s.opts.markerSlots()
	for from := lo; from < hi; from += fanoutChunk {
		n := min(fanoutChunk, hi-from)
		cmds, err := s.cluster.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i := range n {
				p.Del(ctx, slotMarkerKey(rule, from+i))
			}
			return nil
		})
		if err != nil {
			s.clusterTrouble(err)
			for i, c := range cmds {
				if c.Err() != nil {
					return fmt.Errorf("redisstore: delete marker of %q, slot %d: %w", rule, from+i, c.Err())
				}
			}
			return fmt.Errorf("redisstore: delete marker of %q: %w", rule, err)
		}
	}
	return nil
}

// stopFanouts drops rule's waiting fan-out, waits for the one running, and
// forgets the last one (a renewal after the delete must not be skipped as
// already fanned out).
func (s *Store) stopFanouts(ctx context.Context, rule string) error {
	cs := &s.cs
	for {
		cs.mu.Lock()
		if old := cs.pending[rule]; old != nil {
			old.ver = cs.fanned[rule].ver // superseded: never sent
			close(old.done)
			delete(cs.pending, rule)
		}
		job := cs.running[rule]
		if job == nil {
			delete(cs.fanned, rule)
			cs.mu.Unlock()
			return nil
		}
		cs.mu.Unlock()
		select {
		case <-job.done:
		case <-ctx.Done():
			return fmt.Errorf("redisstore: delete marker of %q: a fan-out still runs: %w", rule, ctx.Err())
		}
	}
}

// MarkerRules returns the ids of the rules that have a marker in the store,
// sorted: on a Cluster those with a copy in the slots WriteMarker writes
// (WithMarkerSlots), read with SCAN on every master. Keys that are not
// markers this store writes are ignored.
func (s *Store) MarkerRules(ctx context.Context) ([]string, error) {
	var mu sync.Mutex
	seen := map[string]bool{}
	scan := func(ctx context.Context, c redis.UniversalClient) error {
		it := c.Scan(ctx, 0, markerPrefix+"*", markerScanCount).Iterator()
		for it.Next(ctx) {
			if rule, ok := s.markerRule(it.Val()); ok {
				mu.Lock()
				seen[rule] = true
				mu.Unlock()
			}
		}
		return it.Err()
	}
	var err error
	if s.cluster != nil {
		err = s.cluster.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return scan(ctx, c) })
	} else {
		err = scan(ctx, s.client)
	}
	if err != nil {
		return nil, fmt.Errorf("redisstore: list markers: %w", err)
	}
	out := make([]string, 0, len(seen))
	for r := range seen {
		out = append(out, r)
	}
	slices.Sort(out)
	return out, nil
}

// markerRule returns the rule id of key if it is a marker this store
// writes: MarkerKey on a single server, a slot copy of its marker slots on
// a Cluster (slotMarkerKey).
func (s *Store) markerRule(key string) (string, bool) {
	rest, ok := strings.CutPrefix(key, markerPrefix)
	if !ok {
		return "", false
	}
	if s.cluster != nil {
		if !strings.HasPrefix(rest, "{") {
			return "", false
		}
		tag, r, ok := strings.Cut(rest[1:], "}:")
		if !ok || tag == "" {
			return "", false
		}
		lo, hi := s.opts.markerSlots()
		if sl := HashSlot(key); sl < lo || sl >= hi || slotTags()[sl] != tag {
			return "", false
		}
		rest = r
	} else if strings.HasPrefix(rest, "{") {
		return "", false
	}
	return unescapeRule(rest)
}

// unescapeRule reverses escape(rule, true); false if s is not such an
// escape of a non-empty rule id.
func unescapeRule(s string) (string, bool) {
	if s == "" || strings.ContainsAny(s, ":{}") {
		return "", false
	}
	if !strings.Contains(s, "%") {
		return s, true
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			b.WriteByte(s[i])
			continue
		}
		if i+3 > len(s) {
			return "", false
		}
		switch s[i+1 : i+3] {
		case "25":
			b.WriteByte('%')
		case "7B":
			b.WriteByte('{')
		case "7D":
			b.WriteByte('}')
		case "3A":
			b.WriteByte(':')
		default:
			return "", false
		}
		i += 2
	}
	return b.String(), true
}
