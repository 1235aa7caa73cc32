package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/redis/go-redis/v9"
)

// scriptError is an error Redis answered (as go-redis returns one).
type scriptError string

func (e scriptError) Error() string { return string(e) }
func (scriptError) RedisError()     {}

var _ redis.Error = scriptError("")

// TestRefreshWrite: a script error on one key (its whole pipelined call
// fails) does not keep the other held records from their refresh; a
// failure to reach Redis is returned whole.
func TestRefreshWrite(t *testing.T) {
	recs := []redisstore.ShareRecord{{Key: "a", Inc: 1, Seq: 1}, {Key: "bad", Inc: 1, Seq: 2}, {Key: "c", Inc: 1, Seq: 3}}
	answer := func(recs []redisstore.ShareRecord, fail error) ([]redisstore.WindowApplied, error) {
		var vs []redisstore.WindowApplied
		for _, r := range recs {
			if r.Key == "bad" {
				return nil, fmt.Errorf("redisstore: write share of %q: %w", r.Key, fail)
			}
			vs = append(vs, redisstore.WindowApplied{Version: redisstore.Version{Inc: r.Inc, Seq: r.Seq}})
		}
		return vs, nil
	}
	calls := 0
	vs, err := refreshWrite(recs, func(rs []redisstore.ShareRecord) ([]redisstore.WindowApplied, error) {
		calls++
		return answer(rs, scriptError("ERR redisstore: bad state in bad"))
	})
	if err != nil || calls != 4 {
		t.Fatalf("script error: err %v after %d calls, want nil after 1 + 3", err, calls)
	}
	if vs[0].Version.Seq != 1 || vs[1] != (redisstore.WindowApplied{}) || vs[2].Version.Seq != 3 {
		t.Fatalf("answers %+v, want a and c written, bad not", vs)
	}
	down := errors.New("dial tcp: connection refused")
	calls = 0
	if _, err := refreshWrite(recs, func(rs []redisstore.ShareRecord) ([]redisstore.WindowApplied, error) {
		calls++
		return answer(rs, down)
	}); !errors.Is(err, down) || calls != 1 {
		t.Fatalf("network error: err %v after %d calls, want it after 1", err, calls)
	}
}

// TestRefreshHeld: the records the ledger holds confirmed are written
// again once half the Hold has passed since they were sent, refreshBatch
// per call (the rest due at the next tick), same version, with the Hold;
// a write not confirmed is not (the ledger resends it), and a refresh the
// store fails is looked at again at the next tick. The ledger then
// reports the refresh's time (Refreshed), so nothing is due until half a
// Hold later.
func TestRefreshHeld(t *testing.T) {
	fs := &failingStore{memStore: newMemStore(&world{}, "a")}
	cfg := DefaultConfig()
	a := &Agent{cfg: cfg, store: fs, start: time.Now(), rules: map[string]*ruleState{},
		results: make(chan func(context.Context), 1),
		logs:    logsample.New(slog.New(slog.DiscardHandler), time.Minute)}
	a.m = newMetrics("a", nil, a)
	lcfg := ledger.DefaultConfig()
	regions := []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}}
	l, err := ledger.New(lcfg, "a", regions, ledger.Start{Inc: 1, RunID: "run"}, a.now())
	if err != nil {
		t.Fatal(err)
	}
	st := &ruleState{Rule: &driver.Rule{ID: "r", Led: l}, rule: globalRule(), spec: Spec{Units: lcfg.Units}}
	a.rules["r"] = st
	n := refreshBatch + 10
	for i := range n {
		l.Usage(a.now(), fmt.Sprintf("k%05d", i), 100, 5, 0)
	}
	var cs []ledger.Confirmation
	written := 0
	for _, w := range l.Tick(a.now()).Writes {
		if w.Key == ledger.MarkerKey || w.Key == "k00003" { // k00003's write stays unconfirmed
			continue
		}
		written++
		cs = append(cs, ledger.Confirmation{Key: w.Key, Version: w.Version})
	}
	l.SharesApplied(a.now(), cs)
	if written != n-1 {
		t.Fatalf("%d keys written and confirmed, want %d", written, n-1)
	}
	refresh := func() {
		t.Helper()
		a.refreshHeld(context.Background())
		if st.holds.refreshing {
			(<-a.results)(context.Background())
		}
	}
	half := recordHold(cfg) / 2
	refresh()
	if len(fs.calls) != 0 {
		t.Fatalf("store calls %v before half the Hold", fs.calls)
	}
	a.start = a.start.Add(-half - time.Second) // half the Hold later
	fs.failFrom = 1
	refresh()
	if fmt.Sprint(fs.calls) != fmt.Sprint([]int{refreshBatch}) || st.holds.next != 0 {
		t.Fatalf("a failing refresh: calls %v, next %v; want one of %d and a look at the next tick", fs.calls, st.holds.next, refreshBatch)
	}
	fs.failFrom, fs.calls = 0, nil
	refresh()
	refresh()
	if fmt.Sprint(fs.calls) != fmt.Sprint([]int{refreshBatch, n - 1 - refreshBatch}) {
		t.Fatalf("store calls %v, want %d then %d records", fs.calls, refreshBatch, n-1-refreshBatch)
	}
	if h := recordHold(cfg); fmt.Sprint(fs.holds) != fmt.Sprint([]time.Duration{h, h, h}) {
		t.Fatalf("records written with the Holds %v, want %v", fs.holds, h)
	}
	refresh()
	if len(fs.calls) != 2 {
		t.Fatalf("store calls %v: a record written again before half a Hold since its refresh", fs.calls)
	}
	recs := fs.recs["r"]
	if len(recs) != n-1 {
		t.Fatalf("the store holds %d records, want %d", len(recs), n-1)
	}
	if _, ok := recs["k00003"]; ok {
		t.Fatal("the unconfirmed write was refreshed")
	}
	l.Held(func(name string, v ledger.Version, units int64, at time.Duration) bool {
		if r := recs[name]; r.v != (redisstore.Version{Inc: v.Inc, Seq: v.Seq}) || r.units != units || r.release {
			t.Fatalf("%s: the store holds %+v, the ledger wrote %v units at %v", name, r, units, v)
		}
		if at < half {
			t.Fatalf("%s: last sent at %v, want the refresh's time (after %v)", name, at, half)
		}
		return true
	})
}

// failingStore is a memStore whose WriteShares calls fail from call
// failFrom on (1-based; 0: never), and which records each call's size.
type failingStore struct {
	*memStore
	calls    []int
	holds    []time.Duration // each call's records' Hold (the first's)
	failFrom int
}

func (s *failingStore) WriteShares(ctx context.Context, rule string, recs []redisstore.ShareRecord) ([]redisstore.Version, error) {
	s.calls = append(s.calls, len(recs))
	if len(recs) > 0 {
		s.holds = append(s.holds, recs[0].Hold)
	}
	if s.failFrom > 0 && len(s.calls) >= s.failFrom {
		return nil, errors.New("memstore: down")
	}
	return s.memStore.WriteShares(ctx, rule, recs)
}

// TestApplyWritesChunks: a rule's records go to the store writeChunk at a
// time, in the ledger's order, each chunk confirmed as it is answered; a failed call ends the rule's record writes for the flush
// (what follows is not confirmed: the ledger retries it), and the marker
// is written and confirmed either way.
func TestApplyWritesChunks(t *testing.T) {
	for _, failFrom := range []int{0, 2} {
		fs := &failingStore{memStore: newMemStore(&world{}, "a"), failFrom: failFrom}
		cfg := DefaultConfig()
		a := &Agent{cfg: cfg, store: fs, start: time.Now(), rules: map[string]*ruleState{},
			logs: logsample.New(slog.New(slog.DiscardHandler), time.Minute)}
		a.m = newMetrics("a", nil, a)
		r := &driver.Rule{ID: "r"}
		a.rules["r"] = &ruleState{Rule: r, rule: globalRule(), spec: Spec{Units: 1000}}
		n := 2*writeChunk + 5
		var ws []ledger.Write
		for i := range n {
			ws = append(ws, ledger.Write{Key: fmt.Sprintf("k%06d", i), Units: 10, Version: ledger.Version{Inc: 1, Seq: uint64(i + 1)}})
		}
		ws = append(ws, ledger.Write{Key: ledger.MarkerKey, Units: 10, Version: ledger.Version{Inc: 1, Seq: 1}, Marker: &ledger.MarkerWrite{Create: true,
			Lease: time.Second, RunID: fs.runID}})
		res := a.applyWrites(context.Background(), map[*driver.Rule][]ledger.Write{r: ws})[r]
		wantCalls := []int{writeChunk, writeChunk, 5}
		confirmed := n
		if failFrom == 2 {
			wantCalls, confirmed = []int{writeChunk, writeChunk}, writeChunk
		}
		if fmt.Sprint(fs.calls) != fmt.Sprint(wantCalls) {
			t.Fatalf("failFrom %d: store calls of %v records, want %v", failFrom, fs.calls, wantCalls)
		}
		cs := res.Confirmations
		if len(cs) != confirmed+1 || cs[len(cs)-1].Key != ledger.MarkerKey {
			t.Fatalf("failFrom %d: %d confirmations (last %+v), want %d records and the marker", failFrom, len(cs), cs[len(cs)-1], confirmed)
		}
		for i, c := range cs[:confirmed] {
			if c.Key != ws[i].Key || c.Version != ws[i].Version {
				t.Fatalf("failFrom %d: confirmation %d is %+v, want %s at %v", failFrom, i, c, ws[i].Key, ws[i].Version)
			}
		}
	}
}
