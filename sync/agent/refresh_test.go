package agent

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
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
