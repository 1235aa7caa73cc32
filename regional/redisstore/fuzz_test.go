package redisstore

import (
	"encoding/binary"
	"errors"
	"math"
	"math/big"
	"regexp"
	"slices"
	"testing"
	"time"
)

// replyReader turns fuzz bytes into a reply of the shapes go-redis returns
// for a script (RESP2 and RESP3): int64, string, []any, nil, float64, bool,
// map[any]any, *big.Int and error elements, nested.
type replyReader struct{ b []byte }

func (r *replyReader) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *replyReader) int64() int64 {
	var buf [8]byte
	n := copy(buf[:], r.b)
	r.b = r.b[n:]
	return int64(binary.LittleEndian.Uint64(buf[:]))
}

func (r *replyReader) small() int64 {
	switch c := r.byte(); c {
	case 0xff:
		return r.int64()
	case 0xfe:
		return -int64(r.byte())
	default:
		return int64(c)
	}
}

func (r *replyReader) str() string {
	n := min(int(r.byte()), len(r.b))
	s := string(r.b[:n])
	r.b = r.b[n:]
	return s
}

func (r *replyReader) reply(depth int) any {
	switch r.byte() % 10 {
	case 0, 1: // integers are most of a script's replies
		return r.small()
	case 2:
		return r.str()
	case 3:
		if depth > 3 {
			return nil
		}
		n := int(r.byte() % 24)
		a := make([]any, n)
		for i := range a {
			a[i] = r.reply(depth + 1)
		}
		return a
	case 4:
		return nil
	case 5:
		return math.Float64frombits(uint64(r.int64()))
	case 6:
		return r.byte()%2 == 1
	case 7:
		if depth > 3 {
			return nil
		}
		m := map[any]any{}
		for n := int(r.byte() % 4); n > 0; n-- {
			m[r.str()] = r.reply(depth + 1)
		}
		return m
	case 8:
		return big.NewInt(r.int64())
	default:
		return replyError(r.str())
	}
}

// replyError stands for go-redis's error element of an array reply.
type replyError string

func (e replyError) Error() string { return string(e) }

// FuzzParseReplies: the parsers of the scripts' replies never panic, accept
// exactly the shapes the scripts return (Check: 1+5n integers, a list go-redis
// reads as integers before parseCheck sees it; a version:
// two integers >= 0), read them field by field, and refuse anything else
// with ErrBadReply.
func FuzzParseReplies(f *testing.F) {
	f.Add([]byte{3, 6, 0, 1, 0, 1, 0, 10, 0, 9, 0, 0, 0, 0}) // [1, 1, 10, 9, 0, 0]: one allowing bucket
	f.Add([]byte{3, 2, 0, 3, 0, 7})                          // [3, 7]: a version
	f.Add([]byte{3, 4, 0, 3, 0, 7, 0, 9, 0, 5})              // [3, 7, 9, 5]: a refused window record
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &replyReader{b: data}
		v := r.reply(0)
		a, isList := v.([]any)
		ints := isList
		for _, x := range a {
			_, ok := x.(int64)
			ints = ints && ok
		}
		// A Check reply that is not a list of integers is refused by
		// go-redis's reading (an IntSliceCmd): parseCheck sees integers.
		vals := make([]int64, 0, len(a))
		for _, x := range a {
			if i, ok := x.(int64); ok {
				vals = append(vals, i)
			}
		}
		for n := 0; n <= 3 && ints; n++ {
			allowed, res, err := parseCheck(vals, n, nil)
			if len(a) != 1+5*n {
				if !errors.Is(err, ErrBadReply) {
					t.Fatalf("parseCheck(%#v, %d) = %v, want ErrBadReply", v, n, err)
				}
				continue
			}
			if err != nil || len(res) != n || allowed != (a[0].(int64) == 1) {
				t.Fatalf("parseCheck(%#v, %d) = %v %v %v", v, n, allowed, res, err)
			}
			for i, x := range res {
				w := a[1+5*i:]
				if x != (Result{Allowed: w[0].(int64) == 1, Limit: w[1].(int64), Remaining: w[2].(int64), RetryAfterMs: w[3].(int64), ResetAfterMs: w[4].(int64)}) {
					t.Fatalf("parseCheck(%#v, %d): result %d is %+v", v, n, i, x)
				}
			}
		}
		ver, err := parseVersion(v)
		if ints && len(a) == 2 && a[0].(int64) >= 0 && a[1].(int64) >= 0 {
			if err != nil || ver != (Version{uint64(a[0].(int64)), uint64(a[1].(int64))}) {
				t.Fatalf("parseVersion(%#v) = %v %v", v, ver, err)
			}
		} else if !errors.Is(err, ErrBadReply) {
			t.Fatalf("parseVersion(%#v) = %v %v, want ErrBadReply", v, ver, err)
		}
		wa, err := parseWindowApplied(v)
		nonneg := ints
		for _, x := range a {
			nonneg = nonneg && x.(int64) >= 0
		}
		switch {
		case nonneg && len(a) == 2:
			if err != nil || wa != (WindowApplied{Version: Version{uint64(a[0].(int64)), uint64(a[1].(int64))}}) {
				t.Fatalf("parseWindowApplied(%#v) = %+v %v", v, wa, err)
			}
		case nonneg && len(a) == 4:
			want := WindowApplied{Version{uint64(a[0].(int64)), uint64(a[1].(int64))}, a[2].(int64), time.Duration(a[3].(int64)) * time.Millisecond}
			if err != nil || wa != want {
				t.Fatalf("parseWindowApplied(%#v) = %+v %v, want %+v", v, wa, err, want)
			}
		case !errors.Is(err, ErrBadReply):
			t.Fatalf("parseWindowApplied(%#v) = %+v %v, want ErrBadReply", v, wa, err)
		}
	})
}

// luaRunID is how the scripts read the run id: Lua's
// string.match(info, 'run_id:(%x+)'), leftmost match, greedy.
var luaRunID = regexp.MustCompile(`run_id:([0-9A-Fa-f]+)`)

// FuzzParseRunID: RunID reads an INFO server reply exactly as the scripts
// do, so a marker's RunID and the script's agree on any server.
func FuzzParseRunID(f *testing.F) {
	f.Add("# Server\r\nredis_version:7.2.4\r\nrun_id:8c1f3dd2a1c5e6b1e0f1b7c4d9a2e3f4a5b6c7d8\r\ntcp_port:6379\r\n")
	f.Fuzz(func(t *testing.T, info string) {
		got, err := parseRunID(info)
		m := luaRunID.FindStringSubmatch(info)
		if m == nil {
			if !errors.Is(err, ErrBadReply) {
				t.Fatalf("parseRunID(%q) = %q %v; the scripts find no run id", info, got, err)
			}
			return
		}
		if err != nil || got != m[1] {
			t.Fatalf("parseRunID(%q) = %q %v; the scripts read %q", info, got, err, m[1])
		}
	})
}

// FuzzSplitMulti: splitting a multi-call script's reply never panics and
// gives every call either its own check reply (1+5n integers, the first 0
// or 1), a script error it reported itself (-1, a length, that many
// bytes), or ErrBadReply; when no call has ErrBadReply the parts cover the
// reply exactly, in order.
func FuzzSplitMulti(f *testing.F) {
	f.Add([]byte{3, 6, 0, 1, 0, 1, 0, 10, 0, 9, 0, 0, 0, 0}, []byte{1})
	f.Add([]byte{3, 9, 0, 1, 0, 1, 0, 10, 0, 9, 0, 0, 0, 0, 0, 0x7f, 0, 2, 0, 104, 0, 105}, []byte{1, 1})
	f.Fuzz(func(t *testing.T, data, buckets []byte) {
		v, ok := (&replyReader{b: data}).reply(0).([]any)
		if !ok || len(buckets) == 0 || len(buckets) > 8 {
			return
		}
		vals := make([]int64, 0, len(v))
		for _, x := range v {
			i, ok := x.(int64)
			if !ok {
				return // go-redis refuses it before splitMulti
			}
			if i == 0x7f {
				i = -1 // the fuzzer's way to a script error's marker
			}
			vals = append(vals, i)
		}
		u := make([]*item, len(buckets))
		for k, b := range buckets {
			u[k] = &item{n: int(b % 4)}
		}
		splitMulti(vals, u)
		off, bad := 0, false
		for k, it := range u {
			switch {
			case errors.Is(it.err, ErrBadReply):
				bad = true
			case it.err != nil:
				var se scriptError
				if !errors.As(it.err, &se) || off+2+len(se) > len(vals) || vals[off] != -1 || vals[off+1] != int64(len(se)) {
					t.Fatalf("call %d: error %v not the reply's own at %d of %v", k, it.err, off, vals)
				}
				off += 2 + len(se)
			default:
				if len(it.val) != 1+5*it.n || (it.val[0] != 0 && it.val[0] != 1) || !slices.Equal(it.val, vals[off:off+len(it.val)]) {
					t.Fatalf("call %d of %d buckets: %v at %d of %v", k, it.n, it.val, off, vals)
				}
				off += len(it.val)
			}
		}
		if !bad && off != len(vals) {
			t.Fatalf("the calls cover %d of %d integers and none is ErrBadReply", off, len(vals))
		}
	})
}
