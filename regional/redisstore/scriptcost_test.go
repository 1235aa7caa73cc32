package redisstore

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// costPath is one common path of the check script: the buckets of one
// call, for key tag i, and what a key needs before its checks (a share
// record).
type costPath struct {
	name    string
	buckets func(i int) []Bucket
	seed    func(ctx context.Context, s *Store, buckets []Bucket) error
	src     string // a script to run instead of the check (with its keys and arguments)
	multi   int    // > 0: this many calls (of consecutive key tags) per script call, the multi-call script
}

const costKeys = 1000

// costBare is the part "bare": a 12-byte token bucket's check and write
// in the fewest Lua steps (struct only, so Redis only).
const costBare = `
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local cost, slack = tonumber(ARGV[1]), tonumber(ARGV[3])
local a, b = tonumber(ARGV[5]), tonumber(ARGV[6])
local t, l = struct.unpack('<I6I6', redis.call('GET', KEYS[1]))
local capU = a * 1000
local el = now - l
if el < 0 then el = 0 end
if t < capU then
  if el >= math.ceil((capU - t) / b) then t = capU else t = t + el * b end
end
local ok = cost * 1000000 <= t
if ok then t = t - cost * 1000000 end
redis.call('SET', KEYS[1], struct.pack('<I6I6', t, now), 'PX', math.max(math.ceil(capU / b) + slack, 1000))
return {1, ok and 1 or 0, math.floor(a / 1000), math.floor(t / 1000000), 0, math.ceil((capU - t) / b)}
`

var costGlobal = &Global{Rule: "g", Units: 1000000, Floor: 25000}

func costPaths() []costPath {
	tag := func(i int) string { return fmt.Sprintf("bench:%d", i) }
	tb := func(c, r int64) func(int) []Bucket {
		return func(i int) []Bucket {
			return []Bucket{{Key: Key(tag(i), "tb"), Algorithm: rules.TokenBucket, Capacity: c, Rate: r}}
		}
	}
	win := func(a rules.Algorithm, g *Global) func(int) []Bucket {
		return func(i int) []Bucket {
			b := window(Key(tag(i), "w"), a, 1_000_000_000, time.Minute)
			b.Global = g
			return []Bucket{b}
		}
	}
	global := func(i int) []Bucket {
		return []Bucket{{Key: Key(tag(i), "g"), Algorithm: rules.TokenBucket, Capacity: 1e11, Rate: 1e11, Global: costGlobal}}
	}
	record := func(ctx context.Context, s *Store, bs []Bucket) error {
		b := bs[0]
		r := ShareRecord{Key: b.Key, Inc: 1, Seq: 1, Units: 400000, Capacity: b.Capacity, Rate: b.Rate,
			Total: b.Global.Units, Floor: b.Global.Floor, Hold: time.Hour}
		if b.Algorithm != rules.TokenBucket {
			r.Algorithm, r.Limit, r.Window, r.Capacity, r.Rate = b.Algorithm, b.Limit, b.Window, 0, 0
			_, err := s.WriteWindowShares(ctx, b.Global.Rule, []ShareRecord{r})
			return err
		}
		_, err := s.WriteShares(ctx, b.Global.Rule, []ShareRecord{r})
		return err
	}
	// the parts of a call: what the 12-byte token bucket's call costs
	// before any of the check's Lua runs, and the commands it calls
	part := func(name, src string) costPath {
		return costPath{name: "part/" + name, buckets: tb(100_000_000_000, 100_000_000_000), src: src}
	}
	return []costPath{
		{name: "return1"},
		part("args", "return 1"),
		part("TIME", "redis.call('TIME') return 1"),
		part("TIME+GET", "redis.call('TIME') redis.call('GET', KEYS[1]) return 1"),
		part("TIME+GET+SET", "redis.call('TIME') redis.call('SET', KEYS[1], redis.call('GET', KEYS[1]), 'PX', 100000) return 1"),
		part("INFO", "local s = redis.call('INFO', 'server') return string.match(s, 'run_id:(%x+)') and 1"),
		part("bare", costBare),
		{name: "token_bucket/decimal", buckets: tb(1_000_000, 1_000_000_000)},
		{name: "token_bucket/12byte", buckets: tb(100_000_000_000, 100_000_000_000)},
		{name: "leaky_bucket", buckets: func(i int) []Bucket {
			return []Bucket{{Key: Key(tag(i), "lb"), Algorithm: rules.LeakyBucket, Capacity: 1e11, Rate: 1e11}}
		}},
		{name: "fixed_window", buckets: win(rules.FixedWindow, nil)},
		{name: "sliding_window", buckets: win(rules.SlidingWindow, nil)},
		{name: "global_token_bucket/marker", buckets: global},
		{name: "global_token_bucket/record", buckets: global, seed: record},
		{name: "global_sliding_window/record", buckets: win(rules.SlidingWindow, costGlobal), seed: record},
		{name: "token_bucket/decimal/32calls", buckets: tb(1_000_000, 1_000_000_000), multi: 32},
		{name: "multi/tb+sw+fw", buckets: func(i int) []Bucket {
			return []Bucket{
				{Key: Key(tag(i), "tb"), Algorithm: rules.TokenBucket, Capacity: 1_000_000, Rate: 1_000_000_000},
				window(Key(tag(i), "sw"), rules.SlidingWindow, 1_000_000_000, time.Minute),
				window(Key(tag(i), "fw"), rules.FixedWindow, 1_000_000_000, time.Hour),
			}
		}},
	}
}

// TestScriptCost measures what Redis spends per check script call on the
// common paths, with the arguments the enforcer passes (Redis TIME, slack
// 1s), over 1000 keys that already exist (a first round runs the script
// with EVAL, which neither measure counts). Two measures, both load-proof:
//
//	REDISSTORE_SCRIPTCOST=callgrind go test -count=1 -run TestScriptCost -v ./regional/redisstore/
//
// runs redis-server under valgrind --tool=callgrind --toggle-collect=
// evalShaCommand and reports the instructions per EVALSHA (all of it: the
// Lua, the GETs and SETs it calls, the reply)
// (REDISSTORE_SCRIPTCOST_OUT=dir keeps each profile there, for
// callgrind_annotate), and
//
//	REDISSTORE_SCRIPTCOST=usec go test -count=1 -run TestScriptCost -v ./regional/redisstore/
//
// usec_per_call of INFO commandstats over 50,000 calls per path, pipelined
// 16 deep. "return1" is EVALSHA of a script that returns 1: the fixed cost;
// part/... run a script of one part of a call with the 12-byte token
// bucket's keys and arguments: "args" only returns 1, the others call
// the commands the check does (and "INFO" what a global check adds to
// learn the server's run id), and "bare" is a token bucket check with no
// helpers, shadow, layouts or clock handling: about the least a script
// doing the check's work can cost.
func TestScriptCost(t *testing.T) {
	mode := os.Getenv("REDISSTORE_SCRIPTCOST")
	if mode != "callgrind" && mode != "usec" {
		t.Skip("set REDISSTORE_SCRIPTCOST=callgrind or usec")
	}
	calls := 50000
	if mode == "callgrind" {
		calls = 4000
	}
	for _, p := range costPaths() {
		t.Run(p.name, func(t *testing.T) {
			var rc *redis.Client
			var stop func() int64
			if mode == "callgrind" {
				rc, stop = startCallgrindRedis(t)
			} else {
				r := testutil.StartRedis(t)
				rc = redis.NewClient(&redis.Options{Addr: r.Addr})
				t.Cleanup(func() { rc.Close() })
			}
			n := calls
			if p.multi > 0 { // as many decisions, in pipelines of 16
				n = max(calls/p.multi/16*16, 16)
			}
			n = runCostPath(t, rc, p, n)
			if mode == "callgrind" {
				ir := stop()
				if p.multi > 0 {
					t.Logf("%s: %d instructions per call, %d per decision (%d script calls of %d calls, %d in evalShaCommand)", p.name, ir/int64(n), ir/int64(n*p.multi), n, p.multi, ir)
					return
				}
				t.Logf("%s: %d instructions per call (%d calls, %d in evalShaCommand)", p.name, ir/int64(n), n, ir)
				return
			}
			us := commandstat(t, rc, "evalsha", "usec_per_call")
			t.Logf("%s: %.2f usec_per_call (%d calls)", p.name, us, n)
		})
	}
}

// runCostPath seeds p's keys, runs one round of EVAL over them, then calls
// EVALSHA calls times in pipelines of 16, and returns how many it ran.
func runCostPath(t *testing.T, rc *redis.Client, p costPath, calls int) int {
	ctx := context.Background()
	s, err := New(rc)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	sc := s.check
	if p.multi > 0 {
		sc = s.multi
	}
	keys := func(i int) []string { return nil }
	args := func(i int) []any { return nil }
	check := func(v []int64, i int) error { // the reply of script call i
		if ok, _, err := parseCheck(v, len(p.buckets(i)), nil); err != nil || !ok {
			return fmt.Errorf("allowed %v, %v", ok, err)
		}
		return nil
	}
	if p.buckets == nil {
		sc = redis.NewScript("return 1")
	} else {
		id, err := s.RunID(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.WriteMarker(ctx, costGlobal.Rule, Marker{Inc: 1, Seq: 1, Units: 500000, Lease: 24 * time.Hour, Create: true, RunID: id}); err != nil {
			t.Fatal(err)
		}
		var ks [costKeys][]string
		var as [costKeys][]any
		var its [costKeys]*item
		for i := range costKeys {
			bs := p.buckets(i)
			if err := validate(1, bs); err != nil {
				t.Fatal(err)
			}
			if p.seed != nil {
				if err := p.seed(ctx, s, bs); err != nil {
					t.Fatal(err)
				}
			}
			its[i] = &item{n: len(bs)}
			its[i].args = s.scriptArgs(its[i], 1, "", bs)
			ks[i], as[i] = splitEvalSha(its[i].args)
		}
		if p.multi > 0 {
			// script call i: the calls of key tags i*multi, i*multi+1, ...
			var mks [costKeys][]string
			var mas [costKeys][]any
			var groups [costKeys][]*item
			for i := range costKeys {
				for j := range p.multi {
					groups[i] = append(groups[i], its[(i*p.multi+j)%costKeys])
				}
				mks[i], mas[i] = splitEvalSha(s.multiArgs(groups[i]))
			}
			ks, as = mks, mas
			check = func(v []int64, i int) error {
				u := make([]*item, p.multi)
				for j, it := range groups[i%costKeys] {
					u[j] = &item{n: it.n}
				}
				splitMulti(v, u)
				for _, it := range u {
					if it.err != nil {
						return it.err
					}
					if ok, _, err := parseCheck(it.val, it.n, nil); err != nil || !ok {
						return fmt.Errorf("allowed %v, %v", ok, err)
					}
				}
				return nil
			}
		}
		keys = func(i int) []string { return ks[i%costKeys] }
		args = func(i int) []any { return as[i%costKeys] }
		src := checkSrc
		if p.multi > 0 {
			src = multiSrc
		}
		for i := range costKeys {
			v, err := rc.Eval(ctx, src, keys(i), args(i)...).Int64Slice()
			if err != nil {
				t.Fatalf("first round, key %d: %v", i, err)
			}
			if err := check(v, i); err != nil {
				t.Fatalf("first round, key %d: %v", i, err)
			}
		}
	}
	if p.src != "" {
		sc = redis.NewScript(p.src)
	}
	if err := sc.Load(ctx, rc).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rc.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < calls; i += 16 {
		pipe := rc.Pipeline()
		cmds := make([]*redis.Cmd, 16)
		for j := range cmds {
			cmds[j] = pipe.EvalSha(ctx, sc.Hash(), keys(i+j), args(i+j)...)
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
		if p.src == "" && p.buckets != nil {
			for j, c := range cmds {
				v, err := c.Int64Slice()
				if err != nil {
					t.Fatalf("call %d: %v", i+j, err)
				}
				if err := check(v, i+j); err != nil {
					t.Fatalf("call %d: %v", i+j, err)
				}
			}
		}
	}
	return calls
}

// splitEvalSha splits a check's command as the store writes it ("evalsha",
// hash, numkeys, keys..., args...) into its keys and its arguments.
func splitEvalSha(cmd []any) ([]string, []any) {
	nk := cmd[2].(int)
	keys := make([]string, nk)
	for i := range keys {
		keys[i] = cmd[3+i].(string)
	}
	return keys, cmd[3+nk:]
}

// commandstat reads one field of INFO commandstats for command cmd.
func commandstat(t testing.TB, rc *redis.Client, cmd, field string) float64 {
	stats, err := rc.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(stats, "\n") {
		if _, rest, ok := strings.Cut(l, "cmdstat_"+cmd+":"); ok {
			for _, f := range strings.Split(strings.TrimSpace(rest), ",") {
				if v, ok := strings.CutPrefix(f, field+"="); ok {
					x, err := strconv.ParseFloat(v, 64)
					if err != nil {
						t.Fatal(err)
					}
					return x
				}
			}
		}
	}
	t.Fatalf("no %s of %s in INFO commandstats", field, cmd)
	return 0
}

// startCallgrindRedis starts redis-server under callgrind, counting only
// inside evalShaCommand; stop shuts it down and returns the instructions
// counted.
func startCallgrindRedis(t *testing.T) (*redis.Client, func() int64) {
	bin := testutil.RedisServerPath(t)
	port := testutil.FreePort(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "callgrind.out")
	cmd := exec.Command("valgrind", "--tool=callgrind", "--toggle-collect=evalShaCommand", "--callgrind-out-file="+out,
		bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir)
	cmd.Stdout, cmd.Stderr = nil, nil
	if err := cmd.Start(); err != nil {
		t.Fatalf("valgrind: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
	})
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) { // polls
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("redis-server under valgrind did not answer within a minute")
		}
	}
	rc := redis.NewClient(&redis.Options{Addr: addr, ReadTimeout: time.Minute, WriteTimeout: time.Minute})
	t.Cleanup(func() { rc.Close() })
	ctx := context.Background()
	return rc, func() int64 {
		_ = rc.Shutdown(ctx).Err() // the connection closes: an error
		if err := <-done; err != nil {
			t.Fatalf("valgrind: %v", err)
		}
		done <- nil
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		if d := os.Getenv("REDISSTORE_SCRIPTCOST_OUT"); d != "" {
			// keep the profile, for callgrind_annotate
			if err := os.WriteFile(filepath.Join(d, strings.ReplaceAll(t.Name(), "/", "_")+".out"), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "summary: "); ok {
				ir, err := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
				if err != nil {
					t.Fatal(err)
				}
				return ir
			}
		}
		t.Fatal("no summary in the callgrind output")
		return 0
	}
}
