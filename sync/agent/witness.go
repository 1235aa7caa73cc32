package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The witness keys (the sync/ledger package doc: Two regions and the
// witness). Each agent renews a key of its own in etcd by compare-and-swap
// every WitnessLease/4, reads its peers' keys with every registry poll,
// and takes a silent peer's key when a ledger asks (driver.Ports.Take).
// Only the keys' revisions count: their values (who wrote them, when) are
// for people reading etcd and are never parsed.

// witnessKeys is the etcd side of the witness: EtcdRegistry implements it.
// An agent whose registry does not runs without a witness (WitnessLease 0).
type witnessKeys interface {
	// renewWitness writes region's key by compare-and-swap at rev, or over
	// whatever is there if rev is 0 (the agent's first write). It returns
	// the key's new revision; taken reports that the key was not at rev
	// and holds neither value nor ours (an earlier write of this agent
	// whose answer was lost, or that was cut short), in which case it was
	// written again over the taker's revision.
	renewWitness(ctx context.Context, region string, rev int64, value, ours string) (newRev int64, taken bool, err error)
	// readWitness returns the revision of every witness key of this
	// agent's shard group, by region, as the last registry poll read them.
	readWitness() map[string]int64
	// takeWitness replaces region's key if it is at rev.
	takeWitness(ctx context.Context, region string, rev int64, value string) (bool, error)
}

// WitnessPrefix returns the prefix of the witness keys: the registry prefix
// with ".witness/" in place of its final "/" (the default:
// /ratelimit/registry.witness/). A key is the prefix and the region's name,
// and for a sharded agent "#" and its group's token.
func (r *EtcdRegistry) WitnessPrefix() string {
	return strings.TrimSuffix(r.prefix, "/") + ".witness/"
}

func (r *EtcdRegistry) witnessKey(region string) string {
	if r.shard.plain() {
		return r.WitnessPrefix() + region
	}
	return r.WitnessPrefix() + region + "#" + r.shard.token()
}

func (r *EtcdRegistry) renewWitness(ctx context.Context, region string, rev int64, value, ours string) (int64, bool, error) {
	key := r.witnessKey(region)
	put := clientv3.OpPut(key, value)
	if rev != 0 {
		tr, err := r.kv.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", rev)).Then(put).Commit()
		if err != nil {
			return 0, false, err
		}
		if tr.Succeeded {
			return tr.Header.Revision, false, nil
		}
	}
	// The first write, or the key moved: write over what is there now. A
	// key holding a value this agent wrote (a renewal whose answer was
	// lost) was not taken: a take writes the taker's value.
	g, err := r.kv.Get(ctx, key)
	if err != nil {
		return 0, false, err
	}
	var cur int64
	taken := rev != 0
	if len(g.Kvs) > 0 {
		cur = g.Kvs[0].ModRevision
		if v := string(g.Kvs[0].Value); v == value || ours != "" && v == ours {
			taken = false
		}
	}
	tr, err := r.kv.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", cur)).Then(put).Commit()
	if err != nil {
		return 0, false, err
	}
	if !tr.Succeeded {
		return 0, false, fmt.Errorf("%w: witness key %s changed while it was written; tried again at the next renewal", ErrRegistry, key)
	}
	return tr.Header.Revision, taken, nil
}

// readWitness returns the witness keys' revisions as the last Records
// call read them: the registry poll reads them in its own transaction.
func (r *EtcdRegistry) readWitness() map[string]int64 {
	r.recs.mu.Lock()
	defer r.recs.mu.Unlock()
	return r.recs.witness
}

// witnessRevs returns the revision of every witness key of this agent's
// shard group among kvs (a read of WitnessPrefix), by region.
func (r *EtcdRegistry) witnessRevs(kvs []*mvccpb.KeyValue) map[string]int64 {
	out := make(map[string]int64, len(kvs))
	for _, kv := range kvs {
		// A region name has no "#" (rules.Validate): a key with one is a
		// shard group's, its token after the "#".
		region, token, sharded := strings.Cut(strings.TrimPrefix(string(kv.Key), r.WitnessPrefix()), "#")
		if sharded == r.shard.plain() || sharded && token != r.shard.token() {
			continue // another shard group's
		}
		out[region] = kv.ModRevision
	}
	return out
}

func (r *EtcdRegistry) takeWitness(ctx context.Context, region string, rev int64, value string) (bool, error) {
	key := r.witnessKey(region)
	tr, err := r.kv.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", rev)).Then(clientv3.OpPut(key, value)).Commit()
	if err != nil {
		return false, err
	}
	return tr.Succeeded, nil
}

// witnessState is the loop goroutine's state of this region's key.
type witnessState struct {
	keys     witnessKeys // nil: no witness
	mine     int64       // the revision this agent wrote last (0: none yet)
	renewing bool
	last     time.Time // when the last renewal was sent
	// unsure is the value of a renewal that failed without an answer (it
	// may have been written): found in the key, it is ours, not a take.
	unsure string
	nonce  string // this agent's, in every value it writes
	count  uint64 // values written
}

// renewWitness renews this region's key every WitnessLease/4 (every
// second while it has none), off the loop goroutine; the result is fed to the
// driver on the loop: WitnessLost first if the key had been taken, then
// the renewal.
func (a *Agent) renewWitness(ctx context.Context) {
	w := &a.wit
	every := a.lcfg.WitnessLease / 4
	if w.mine == 0 {
		every = time.Second // none written yet: try again soon, not at every tick
	}
	if w.keys == nil || w.renewing || time.Since(w.last) < every {
		return
	}
	w.renewing, w.last = true, time.Now()
	sent, mine, unsure, value := a.now(), w.mine, w.unsure, a.witnessValue("renewed by")
	keys := w.keys
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		rev, taken, err := keys.renewWitness(cctx, a.cfg.Region, mine, value, unsure)
		cancel()
		a.post(ctx, func(context.Context) {
			w.renewing = false
			if err != nil {
				w.unsure = value
				a.m.witness.WithLabelValues("error").Inc()
				a.logs.Log(slog.LevelWarn, "witness-renew", "renewing this region's witness key in etcd failed", logKeyErr, err)
				return
			}
			w.mine, w.unsure = rev, ""
			if taken {
				a.m.witness.WithLabelValues("taken").Inc()
				a.log.Warn("this region's witness key was taken by its peer (it had heard nothing from us); the ledgers alive then will start new incarnations")
				a.drv.WitnessLost()
			} else {
				a.m.witness.WithLabelValues("renewed").Inc()
			}
			a.drv.WitnessRenewed(sent)
		})
	})
}

// feedWitness feeds the peers' witness keys, as the registry poll read
// them, to the driver on the loop.
func (a *Agent) feedWitness() {
	if a.wit.keys == nil {
		return
	}
	for region, rev := range a.wit.keys.readWitness() {
		if region != a.cfg.Region {
			a.drv.WitnessSeen(region, rev)
		}
	}
}

// Take takes a silent peer's witness key (a ledger asked: the peer has
// been silent, and its key unchanged, for the witness's reclaim wait).
func (p ports) Take(region string, rev int64) {
	a, ctx := p.a, p.a.ctx
	if a.wit.keys == nil {
		return // no witness: the ledgers' WitnessLease is 0 and never ask
	}
	keys, value := a.wit.keys, a.witnessValue("taken by")
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		ok, err := keys.takeWitness(cctx, region, rev, value)
		cancel()
		if err != nil {
			a.logs.Log(slog.LevelWarn, "witness-take", "taking a silent peer's witness key failed; it is retried", "peer", region, logKeyErr, err)
		}
		a.post(ctx, func(context.Context) {
			if ok {
				a.m.witnessTakes.Inc()
				a.log.Warn("took a silent peer's witness key: its share is reclaimed", "peer", region)
			}
			a.drv.Taken(region, rev, ok)
		})
	})
}

// witnessValue is the value written to a witness key: who and when, for
// people, and this agent's nonce and a count, so that the agent knows its
// own writes (renewWitness).
func (a *Agent) witnessValue(what string) string {
	a.wit.count++
	return fmt.Sprintf("%s %s at %s (agent %s, write %d)", what, a.cfg.Region, time.Now().UTC().Format(time.RFC3339Nano), a.wit.nonce, a.wit.count)
}

// randomNonce is 8 random bytes in hex.
func randomNonce() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
