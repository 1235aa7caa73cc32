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

// TestHeldRecords: a held record gives back the record written (its
// template shared by the records of a write), a Release record is no
// longer held, and the templates stay bounded when the rule's parameters
// change write after write (compacted to the ones in use).
func TestHeldRecords(t *testing.T) {
	a := &Agent{start: time.Now()}
	st := &ruleState{}
	want := map[string]redisstore.ShareRecord{}
	at := a.start.Add(90 * time.Minute)
	for w := 0; w < 5*maxTemplates; w++ {
		var recs []redisstore.ShareRecord
		var vs []redisstore.WindowApplied
		for k := 0; k < 3; k++ {
			r := redisstore.ShareRecord{Key: fmt.Sprintf("k%d", (w+k)%7), Inc: 2, Seq: uint64(w*3 + k + 1), Units: int64(w + k),
				Capacity: int64(1000 * (w + 1)), Rate: 500, Total: 100, Floor: 10, Hold: time.Hour}
			recs = append(recs, r)
			vs = append(vs, redisstore.WindowApplied{Version: redisstore.Version{Inc: r.Inc, Seq: r.Seq}})
			want[r.Key] = r
		}
		if w%10 == 9 { // a Release record of a held key
			r := want["k0"]
			r.Seq, r.Release = uint64(1_000_000+w), true
			recs = append(recs, r)
			vs = append(vs, redisstore.WindowApplied{Version: redisstore.Version{Inc: r.Inc, Seq: r.Seq}})
			delete(want, "k0")
		}
		a.noteHeld(st, recs, vs, at)
		if len(st.holds.tmpls) > maxTemplates {
			t.Fatalf("write %d: %d templates, more than %d", w, len(st.holds.tmpls), maxTemplates)
		}
	}
	if len(st.holds.held) != len(want) {
		t.Fatalf("%d records held, want %d", len(st.holds.held), len(want))
	}
	for k, h := range st.holds.held {
		if got := st.holds.record(k, h); got != want[k] {
			t.Fatalf("held %+v, want %+v", got, want[k])
		}
		if h.since() != 90*time.Minute {
			t.Fatalf("held at %v, want 90m", h.since())
		}
	}
}

// failingStore is a memStore whose WriteShares calls fail from call
// failFrom on (1-based; 0: never), and which records each call's size.
type failingStore struct {
	*memStore
	calls    []int
	failFrom int
}

func (s *failingStore) WriteShares(ctx context.Context, rule string, recs []redisstore.ShareRecord) ([]redisstore.Version, error) {
	s.calls = append(s.calls, len(recs))
	if s.failFrom > 0 && len(s.calls) >= s.failFrom {
		return nil, errors.New("memstore: down")
	}
	return s.memStore.WriteShares(ctx, rule, recs)
}

// TestApplyWritesChunks: a rule's records go to the store writeChunk at a
// time, in the ledger's order, each chunk confirmed and held as it is
// answered; a failed call ends the rule's record writes for the flush
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
		ws = append(ws, ledger.Write{Key: ledger.MarkerKey, Units: 10, Version: ledger.Version{Inc: 1, Seq: 1}, Create: true,
			Lease: time.Second, RunID: fs.runID})
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
		if held := len(a.rules["r"].holds.held); held != confirmed {
			t.Fatalf("failFrom %d: %d records held, want %d", failFrom, held, confirmed)
		}
	}
}
