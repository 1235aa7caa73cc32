package live

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"time"

	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/simulations/strategy"
)

// ErrUnsupported: the scenario uses something the live run cannot play.
var ErrUnsupported = errors.New("live: unsupported scenario")

// DefaultMaxLoad is the default cap on the total offered load, requests/s:
// what two shared cores sustain with every component on them.
const DefaultMaxLoad = 1500

// Options adjust a live run.
type Options struct {
	// Seed overrides the scenario's seed when non-zero.
	Seed uint64
	// Duration plays only the scenario's first Duration (scenario time,
	// before Speed) when non-zero.
	Duration time.Duration
	// Speed plays the scenario's timeline (demand changes, duration) this
	// many times faster (default 1); rates, delays and sync settings stay.
	Speed float64
	// MaxLoad caps the total offered load, requests/s (0:
	// DefaultMaxLoad; negative: no cap, which rlsim live refuses); above
	// it rate, burst and demand are scaled down by the same factor.
	MaxLoad float64
	// Progress receives one line per 10 s of replay (default: none).
	Progress io.Writer
	// LogWriter receives the enforcers' and agents' logs (default: none).
	LogWriter io.Writer
}

// Info describes how the live run was played, next to its metrics.
type Info struct {
	Scale    float64 `json:"scale"` // factor applied to rate, burst and demand
	Speed    float64 `json:"speed"`
	Rate     float64 `json:"rate"` // as played
	Burst    float64 `json:"burst"`
	PeakLoad float64 `json:"peak_load"` // offered requests/s, as played
	WallS    float64 `json:"wall_s"`    // replay time
	Requests int     `json:"requests"`
	Errors   int     `json:"errors"`    // calls that failed (counted as not admitted)
	FailOpen int     `json:"fail_open"` // answers by the failure policy (FailureMode's)
	// FailureMode is the rule's failure_mode: closed when a region's Redis
	// restarts in the run (its failure-policy answers are then rejections).
	FailureMode string   `json:"failure_mode"`
	LagP99Ms    float64  `json:"send_lag_p99_ms"`
	LagMaxMs    float64  `json:"send_lag_max_ms"`
	LatP99Ms    float64  `json:"latency_p99_ms"`
	LatMaxMs    float64  `json:"latency_max_ms"` // longest call: the slack of send times vs decision times
	Redis       string   `json:"redis"`          // "redis-server" or "miniredis"
	Notes       []string `json:"notes,omitempty"`
	FirstError  string   `json:"first_error,omitempty"`
}

// Tolerance returns, per overshoot window W, the overshoot the live run may
// show from its own clock alone: requests are timed when sent, decided up to
// LatMaxMs later, so a window of send times holds decisions of a window
// LatMaxMs longer: rate x latency / (burst + rate x W).
func (in Info) Tolerance() []float64 {
	var out []float64
	for _, W := range sim.Windows {
		out = append(out, in.Rate*in.LatMaxMs/1000/(in.Burst+in.Rate*W.Seconds()))
	}
	return out
}

// Result is a live run: Result.Strategies holds the simulator's ideal and
// ledger for the played scenario, then "live".
type Result struct {
	*sim.Result
	Live Info `json:"live"`
}

// request is one request of the schedule, as the simulator generated it.
type request struct {
	at     time.Duration
	region int
	key    int
	cost   int64
	ideal  bool // the ideal admitted it
}

// recorder is the ideal that also records the schedule: the reference stays
// strategy 0, so every other strategy's figures are unchanged.
type recorder struct {
	strategy.Ideal
	env  *sim.Env
	reqs []request
}

func (r *recorder) Start(env *sim.Env) error {
	r.env = env
	return r.Ideal.Start(env)
}

func (r *recorder) Admit(region, key int, cost int64) bool {
	ok := r.Ideal.Admit(region, key, cost)
	r.reqs = append(r.reqs, request{at: r.env.Now(), region: region, key: key, cost: cost, ideal: ok})
	return ok
}

// Run plays sc live and returns the live metrics next to the simulator's.
func Run(ctx context.Context, sc *scenario.Scenario, opt Options) (*Result, error) {
	if opt.Speed == 0 {
		opt.Speed = 1
	}
	if opt.MaxLoad == 0 {
		opt.MaxLoad = DefaultMaxLoad
	}
	played, factor, err := Scaled(sc, opt.Duration, opt.Speed, opt.MaxLoad)
	if err != nil {
		return nil, err
	}
	notes, err := unsupported(played)
	if err != nil {
		return nil, err
	}
	rec := &recorder{}
	strats := append([]sim.Strategy{rec}, strategy.All()[1:]...)
	vres, err := sim.Run(ctx, played, strats, sim.Options{Seed: opt.Seed})
	if err != nil {
		return nil, err
	}
	info := Info{FailureMode: failureMode(played), Scale: factor, Speed: opt.Speed, Rate: played.Rule.Rate, Burst: played.Rule.Burst,
		PeakLoad: math.Round(PeakLoad(played)), Notes: notes}
	if factor < 1 {
		info.Notes = append([]string{fmt.Sprintf("scaled: rate, burst and demand x %.4g (peak offered load %.0f req/s above --max-load %.0f)",
			factor, PeakLoad(played)/factor, opt.MaxLoad)}, info.Notes...)
	}
	keys := keyNames(played, rec)
	rp, err := replay(ctx, played, rec.reqs, keys, vres.Targets != nil, opt)
	if err != nil {
		return nil, err
	}
	info.WallS = round(rp.wall.Seconds(), 3)
	info.Redis = rp.redis
	live := score(played, vres, rec.reqs, keys, rp, &info)
	out := *vres
	out.Strategies = []sim.StrategyResult{vres.Strategies[0], vres.Strategies[len(vres.Strategies)-1], live}
	return &Result{Result: &out, Live: info}, nil
}

// keyNames returns the key names by index (the recorder saw them all).
func keyNames(sc *scenario.Scenario, rec *recorder) []string {
	var out []string
	if rec.env != nil {
		for _, k := range rec.env.Keys() {
			out = append(out, k.Name)
		}
	}
	return out
}

func round(x float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(x*p) / p
}

func percentile(xs []time.Duration, p float64) time.Duration {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

// score computes the live column from the decisions, as sim scores a strategy.
func score(sc *scenario.Scenario, vres *sim.Result, reqs []request, keys []string, rp *replayed, info *Info) sim.StrategyResult {
	sr := sim.StrategyResult{Name: "live"}
	idx := make([]int, len(reqs))
	for i := range idx {
		idx[i] = i
	}
	sort.SliceStable(idx, func(a, b int) bool { return rp.dec[idx[a]].sent < rp.dec[idx[b]].sent })
	wm := sim.NewWindowMax(sc.Rule.Rate, sc.Rule.Burst)
	quota := newQuota(sc.Rule.Window.D(), rp.start)
	sample := sc.Sample.D()
	series := make([]float64, len(vres.Demand))
	var lags, lats []time.Duration
	for _, i := range idx {
		q, d := reqs[i], rp.dec[i]
		sr.Requests++
		sr.Offered += q.cost
		lags = append(lags, d.sent-q.at)
		if d.err != nil {
			info.Errors++
			if info.FirstError == "" {
				info.FirstError = d.err.Error()
			}
		} else {
			lats = append(lats, d.recv-d.sent)
		}
		if d.failOpen {
			info.FailOpen++
		}
		if !d.allowed || d.err != nil {
			if q.ideal {
				sr.WronglyRejected++
			}
			continue
		}
		sr.Admitted += q.cost
		wm.Add(d.sent, keys[q.key], q.cost)
		quota.add(d.sent, q.key, q.cost)
		if q.key == 0 && len(series) > 0 {
			series[min(int(d.sent/sample), len(series)-1)] += float64(q.cost)
		}
	}
	info.Requests = len(reqs)
	info.LagP99Ms = round(float64(percentile(lags, 0.99))/1e6, 2)
	info.LagMaxMs = round(float64(slices.Max(append(lags, 0)))/1e6, 2)
	info.LatP99Ms = round(float64(percentile(lats, 0.99))/1e6, 2)
	info.LatMaxMs = round(float64(slices.Max(append(lats, 0)))/1e6, 2)
	sr.Rejected = sr.Offered - sr.Admitted
	sr.Overshoot = wm.Overshoot()
	sr.WindowMax = quota.max
	if ideal := vres.Strategies[0].Admitted; ideal > 0 {
		sr.Utilization = round(float64(sr.Admitted)/float64(ideal), 6)
	}
	if sr.Requests > 0 {
		sr.WronglyRejectedPct = round(100*float64(sr.WronglyRejected)/float64(sr.Requests), 4)
	}
	sr.AdmittedRate = sim.PerSecond(series, sample, sc.Duration.D()) // the last sample over the time it covers
	if rp.conv != nil {
		sr.HasShares = true
		sr.Reach, sr.Convergence = sim.Converge(rp.conv, vres.Targets)
		per := int(sample / sim.ConvergeSample)
		for k := 0; k < len(rp.conv) && len(sr.Shares) < len(series); k += per {
			sr.Shares = append(sr.Shares, rp.conv[k])
		}
	}
	sr.SyncBytes = rp.syncBytes
	sr.ActiveKeysMean = round(rp.activeMean, 3)
	sr.ActiveKeysMax = rp.activeMax
	if rp.activeMean > 0 {
		sr.BytesPerKeySecond = round(float64(rp.syncBytes)/(rp.activeMean*rp.wall.Seconds()), 3)
	}
	return sr
}

// quota scores a fixed-window rule live as the simulator does
// (StrategyResult.WindowMax): the most admitted for one key in one window
// of the rule. The windows are the stores': the store script's window
// index is the Redis clock's milliseconds over the window, and the stores'
// clock is this machine's, so a request sent at t (since start) counts in
// window (start + t) / W of the Unix epoch.
type quota struct {
	w     time.Duration // 0: no window rule
	start int64         // the replay's start, Unix ms
	cur   map[int][2]int64
	max   int64
}

func newQuota(w time.Duration, start time.Time) *quota {
	return &quota{w: w, start: start.UnixMilli(), cur: map[int][2]int64{}}
}

// add counts cost admitted for key at sent (in non-decreasing sent order).
func (x *quota) add(sent time.Duration, key int, cost int64) {
	if x.w <= 0 {
		return
	}
	idx := (x.start + sent.Milliseconds()) / x.w.Milliseconds()
	c := x.cur[key]
	if c[0] != idx {
		c = [2]int64{idx, 0}
	}
	c[1] += cost
	x.cur[key] = c
	x.max = max(x.max, c[1])
}
