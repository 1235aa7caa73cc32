package agent

import (
	"errors"
	"fmt"
	"testing"

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
