// Package report turns simulation results into a terminal table, CSV, JSON
// and charts (SVG, and PNG drawn with the standard library only).
//
// Invariant: every output is a pure function of the result, so the same
// result always yields byte-identical files.
package report

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/apportion/apportion/simulations"
	"github.com/apportion/apportion/simulations/sim"
)

func pct(x float64) string { return fmt.Sprintf("%+.2f%%", 100*x) }

// convergence summarises the convergence times: "reach R s, settle M/X s"
// (means over the shifts that did; max), with the number of shifts whose
// shares never settled.
func convergence(s sim.StrategyResult, shifts int) string {
	if !s.HasShares {
		return "n/a"
	}
	if shifts == 0 {
		return "-"
	}
	stat := func(xs []float64) (mean, mx float64, ok, never int) {
		for _, c := range xs {
			if c < 0 {
				never++
				continue
			}
			ok++
			mean += c
			mx = math.Max(mx, c)
		}
		if ok > 0 {
			mean /= float64(ok)
		}
		return
	}
	rm, _, rok, _ := stat(s.Reach)
	sm, sx, sok, snever := stat(s.Convergence)
	out := "reach never"
	if rok > 0 {
		out = fmt.Sprintf("reach %.1f s", rm)
	}
	switch {
	case sok == 0:
		out += ", settle never"
	case snever > 0:
		out += fmt.Sprintf(", settle %.1f/%.1f s (%d of %d never)", sm, sx, snever, shifts)
	default:
		out += fmt.Sprintf(", settle %.1f/%.1f s", sm, sx)
	}
	return out
}

// Table writes the comparison table.
func Table(res *sim.Result) string {
	var b bytes.Buffer
	fmt.Fprintf(&b, "scenario %s  seed %d  %v  %d regions  rate %g/s  burst %g  keys %d  shifts %d\n",
		res.Scenario, res.Seed, time.Duration(res.DurationS*1e9), len(res.Regions), res.Rate, res.Burst, res.Keys, len(res.Targets))
	b.WriteString(clockNote(res))
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "strategy\tovershoot 1s\t10s\t60s\tutilization (of ideal)\twrongly rejected\tconvergence\tsync B/key/s\tactive keys")
	for _, s := range res.Strategies {
		bpk, keys := "0", "-"
		if s.SyncBytes > 0 {
			bpk = fmt.Sprintf("%.0f", s.BytesPerKeySecond)
			keys = fmt.Sprintf("%.1f", s.ActiveKeysMean)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.2f%%\t%.2f%%\t%s\t%s\t%s\n", s.Name, pct(s.Overshoot[0]), pct(s.Overshoot[1]), pct(s.Overshoot[2]),
			100*s.Utilization, s.WronglyRejectedPct, convergence(s, len(res.Targets)), bpk, keys)
	}
	tw.Flush()
	b.WriteString(quotaLine(res))
	return b.String()
}

// quotaLine is, for a fixed-window rule (a quota), the most each strategy
// admitted for one key in one window, against the limit.
func quotaLine(res *sim.Result) string {
	if res.RuleWindowS <= 0 {
		return ""
	}
	var parts []string
	for _, s := range res.Strategies {
		parts = append(parts, fmt.Sprintf("%s %d", s.Name, s.WindowMax))
	}
	return fmt.Sprintf("quota %g per %v: most admitted in one window: %s\n", res.Burst, time.Duration(res.RuleWindowS*1e9), strings.Join(parts, ", "))
}

// clockNote says when the scenario runs clocks outside the clock guarantee.
func clockNote(res *sim.Result) string {
	if len(res.OutsideClockGuarantee) == 0 {
		return ""
	}
	return "outside the clock guarantee (the ledger's bounds do not apply): " + strings.Join(res.OutsideClockGuarantee, "; ") + "\n"
}

// Markdown writes the comparison table as a Markdown table.
func Markdown(res *sim.Result) string {
	var b strings.Builder
	if n := clockNote(res); n != "" {
		b.WriteString(n + "\n")
	}
	b.WriteString("| strategy | overshoot 1 s | 10 s | 60 s | utilization (of ideal) | wrongly rejected | convergence | sync B/key/s |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, s := range res.Strategies {
		bpk := "0"
		if s.SyncBytes > 0 {
			bpk = fmt.Sprintf("%.0f (%.1f keys)", s.BytesPerKeySecond, s.ActiveKeysMean)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %.2f%% | %.2f%% | %s | %s |\n", s.Name, pct(s.Overshoot[0]), pct(s.Overshoot[1]), pct(s.Overshoot[2]),
			100*s.Utilization, s.WronglyRejectedPct, convergence(s, len(res.Targets)), bpk)
	}
	if q := quotaLine(res); q != "" {
		b.WriteString("\n" + q)
	}
	return b.String()
}

func g(x float64) string { return strconv.FormatFloat(x, 'g', -1, 64) }

// SummaryCSV has one row per strategy. convergence_s lists the settle time
// after each shift (Result.Targets), -1 for a shift whose shares never
// settled; it is empty for a strategy without shares (n/a).
func SummaryCSV(res *sim.Result) []byte {
	var b bytes.Buffer
	w := csv.NewWriter(&b)
	_ = w.Write([]string{"scenario", "seed", "strategy", "overshoot_1s", "overshoot_10s", "overshoot_60s", "utilization",
		"wrongly_rejected", "wrongly_rejected_pct", "convergence_s", "requests", "offered", "admitted", "sync_bytes",
		"bytes_per_key_second", "active_keys_mean"})
	for _, s := range res.Strategies {
		var conv []string
		for _, c := range s.Convergence {
			conv = append(conv, g(c))
		}
		_ = w.Write([]string{res.Scenario, strconv.FormatUint(res.Seed, 10), s.Name, g(s.Overshoot[0]), g(s.Overshoot[1]), g(s.Overshoot[2]),
			g(s.Utilization), strconv.FormatInt(s.WronglyRejected, 10), g(s.WronglyRejectedPct), strings.Join(conv, " "),
			strconv.FormatInt(s.Requests, 10), strconv.FormatInt(s.Offered, 10), strconv.FormatInt(s.Admitted, 10),
			strconv.FormatInt(s.SyncBytes, 10), g(s.BytesPerKeySecond), g(s.ActiveKeysMean)})
	}
	w.Flush()
	return b.Bytes()
}

// SeriesCSV has one row per sample: the tracked key's demand, the limit,
// every strategy's admitted rate and the ledger's share of every region.
func SeriesCSV(res *sim.Result) []byte {
	var b bytes.Buffer
	w := csv.NewWriter(&b)
	head := []string{"time_s", "demand", "limit"}
	for _, s := range res.Strategies {
		head = append(head, "admitted_"+s.Name)
	}
	for _, s := range res.Strategies {
		if s.Name == "ledger" {
			for _, r := range res.Regions {
				head = append(head, "share_"+r)
			}
		}
	}
	_ = w.Write(head)
	for i := range res.Demand {
		row := []string{g(float64(i) * res.SampleS), g(res.Demand[i]), g(res.Rate)}
		for _, s := range res.Strategies {
			row = append(row, g(s.AdmittedRate[i]))
		}
		for _, s := range res.Strategies {
			if s.Name == "ledger" {
				for r := range res.Regions {
					v := ""
					if i < len(s.Shares) {
						v = g(s.Shares[i][r])
					}
					row = append(row, v)
				}
			}
		}
		_ = w.Write(row)
	}
	w.Flush()
	return b.Bytes()
}

// JSON is the whole result, indented.
func JSON(v any) []byte {
	b, _ := json.MarshalIndent(v, "", " ")
	return append(b, '\n')
}

func timeAxis(res *sim.Result, n int) ([]float64, string, float64) {
	unit, div := "time (s)", 1.0
	switch {
	case res.DurationS > 4*3600:
		unit, div = "time (h)", 3600
	case res.DurationS > 600:
		unit, div = "time (min)", 60
	}
	xs := make([]float64, n)
	for i := range xs {
		xs[i] = float64(i) * res.SampleS / div
	}
	return xs, unit, div
}

// AdmittedChart plots every strategy's admitted rate of the tracked key
// against the limit and the demand.
func AdmittedChart(res *sim.Result) *Chart {
	xs, unit, _ := timeAxis(res, len(res.Demand))
	limit := make([]float64, len(xs))
	for i := range limit {
		limit[i] = res.Rate
	}
	c := &Chart{Title: fmt.Sprintf("%s: admitted rate of %s vs the limit", res.Scenario, res.TrackedKey), XLabel: unit, YLabel: "tokens/s"}
	c.Series = append(c.Series, Series{Name: "limit", X: xs, Y: limit, Gray: true}, Series{Name: "demand", X: xs, Y: res.Demand, Gray: true, Dashed: true})
	for _, s := range res.Strategies {
		c.Series = append(c.Series, Series{Name: s.Name, X: xs, Y: s.AdmittedRate})
	}
	return c
}

// SharesChart plots the ledger's share of every region (fraction of the
// limit its store enforces for the tracked key).
func SharesChart(res *sim.Result) *Chart {
	for _, s := range res.Strategies {
		if s.Name != "ledger" {
			continue
		}
		xs, unit, _ := timeAxis(res, len(s.Shares))
		c := &Chart{Title: fmt.Sprintf("%s: ledger share per region (%s)", res.Scenario, res.TrackedKey), XLabel: unit, YLabel: "share of the limit"}
		for r, name := range res.Regions {
			ys := make([]float64, len(s.Shares))
			for i := range ys {
				ys[i] = s.Shares[i][r]
			}
			c.Series = append(c.Series, Series{Name: name, X: xs, Y: ys})
		}
		return c
	}
	return nil
}

// File is one output file.
type File struct {
	Name string
	Data []byte
}

func charts(prefix string, c *Chart) ([]File, error) {
	p, err := c.PNG()
	if err != nil {
		return nil, err
	}
	return []File{{prefix + ".svg", c.SVG()}, {prefix + ".png", p}}, nil
}

// RunFiles returns every file of a run.
func RunFiles(res *sim.Result) ([]File, error) {
	fs := []File{
		{"summary.txt", []byte(Table(res))},
		{"summary.md", []byte(Markdown(res))},
		{"summary.csv", SummaryCSV(res)},
		{"series.csv", SeriesCSV(res)},
		{"result.json", JSON(res)},
	}
	a, err := charts("admitted", AdmittedChart(res))
	if err != nil {
		return nil, err
	}
	fs = append(fs, a...)
	if c := SharesChart(res); c != nil {
		s, err := charts("shares", c)
		if err != nil {
			return nil, err
		}
		fs = append(fs, s...)
	}
	return fs, nil
}

// SweepTable is the sweep's table: one row per value and strategy, with
// what Table says of a run above and below it: the clock note (once when
// every value has the same, else per value) and, for a fixed-window rule,
// the quota line of each value.
func SweepTable(pts []simulations.Point) string {
	var b bytes.Buffer
	same := true
	for _, p := range pts {
		same = same && clockNote(p.Result) == clockNote(pts[0].Result)
	}
	for i, p := range pts {
		if n := clockNote(p.Result); n != "" && !same {
			fmt.Fprintf(&b, "%s %s: %s", p.Param, p.Value, n)
		} else if n != "" && i == 0 {
			b.WriteString(n)
		}
	}
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "param\tvalue\tstrategy\tovershoot 1s\t10s\t60s\tutilization (of ideal)\twrongly rejected\tconvergence\tsync B/key/s")
	for _, p := range pts {
		for _, s := range p.Result.Strategies {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%.2f%%\t%.2f%%\t%s\t%.0f\n", p.Param, p.Value, s.Name, pct(s.Overshoot[0]), pct(s.Overshoot[1]), pct(s.Overshoot[2]),
				100*s.Utilization, s.WronglyRejectedPct, convergence(s, len(p.Result.Targets)), s.BytesPerKeySecond)
		}
	}
	tw.Flush()
	for _, p := range pts {
		if q := quotaLine(p.Result); q != "" {
			fmt.Fprintf(&b, "%s %s: %s", p.Param, p.Value, q)
		}
	}
	return b.String()
}

// SweepCSV has one row per value and strategy. convergence_mean_s is the
// mean settle time over the shifts whose shares settled (the table's
// "settle" mean, not its "reach"), -1 when none did (summary.csv's
// never), empty for a strategy without shares or a run without shifts.
// window_max (the last column) is, for a fixed-window rule, the most one
// key admitted in one window (StrategyResult.WindowMax; the quota line),
// empty for a token bucket.
func SweepCSV(pts []simulations.Point) []byte {
	var b bytes.Buffer
	w := csv.NewWriter(&b)
	_ = w.Write([]string{"param", "value", "x", "strategy", "overshoot_1s", "overshoot_10s", "overshoot_60s", "utilization", "wrongly_rejected_pct", "convergence_mean_s", "bytes_per_key_second", "window_max"})
	for _, p := range pts {
		for _, s := range p.Result.Strategies {
			wmax := ""
			if p.Result.RuleWindowS > 0 {
				wmax = strconv.FormatInt(s.WindowMax, 10)
			}
			_ = w.Write([]string{p.Param, p.Value, g(p.X), s.Name, g(s.Overshoot[0]), g(s.Overshoot[1]), g(s.Overshoot[2]),
				g(s.Utilization), g(s.WronglyRejectedPct), convMeanCSV(s), g(s.BytesPerKeySecond), wmax})
		}
	}
	w.Flush()
	return b.Bytes()
}

// convMeanCSV is sweep.csv's convergence_mean_s (SweepCSV).
func convMeanCSV(s sim.StrategyResult) string {
	if !s.HasShares || len(s.Convergence) == 0 {
		return ""
	}
	if m := meanConv(s); !math.IsNaN(m) {
		return g(m)
	}
	return "-1"
}

// meanConv is the mean settle time over the shifts that settled, NaN when
// none did (a point the charts skip).
func meanConv(s sim.StrategyResult) float64 {
	var sum float64
	var n int
	for _, c := range s.Convergence {
		if c >= 0 {
			sum += c
			n++
		}
	}
	if n == 0 {
		return math.NaN()
	}
	return sum / float64(n)
}

// SweepCharts plot utilization, the 1 s overshoot and the ledger's mean
// convergence against the swept value.
func SweepCharts(pts []simulations.Point) []*Chart {
	if len(pts) == 0 {
		return nil
	}
	param := pts[0].Param
	xl := param + " (ms)"
	switch param {
	case "rtt":
		xl = "rtt (factor of the delay matrix, or ms)"
	case "half-life":
		xl = "half-life of the demand estimate (ms)"
	}
	sc := pts[0].Result.Scenario
	util := &Chart{Title: fmt.Sprintf("%s: utilization vs %s", sc, param), XLabel: xl, YLabel: "utilization (% of ideal)"}
	over := &Chart{Title: fmt.Sprintf("%s: overshoot (1 s window) vs %s", sc, param), XLabel: xl, YLabel: "overshoot (%)"}
	conv := &Chart{Title: fmt.Sprintf("%s: ledger convergence vs %s", sc, param), XLabel: xl, YLabel: "mean convergence (s)"}
	for si, s := range pts[0].Result.Strategies {
		var xs, u, o, cv []float64
		for _, p := range pts {
			st := p.Result.Strategies[si]
			xs = append(xs, p.X)
			u = append(u, 100*st.Utilization)
			o = append(o, 100*st.Overshoot[0])
			cv = append(cv, meanConv(st))
		}
		util.Series = append(util.Series, Series{Name: s.Name, X: xs, Y: u})
		over.Series = append(over.Series, Series{Name: s.Name, X: xs, Y: o})
		if s.Name == "ledger" {
			conv.Series = append(conv.Series, Series{Name: s.Name, X: xs, Y: cv})
		}
	}
	return []*Chart{util, over, conv}
}

// SweepFiles returns every file of a sweep.
func SweepFiles(pts []simulations.Point) ([]File, error) {
	fs := []File{{"sweep.txt", []byte(SweepTable(pts))}, {"sweep.csv", SweepCSV(pts)}}
	type slim struct {
		Param, Value string
		X            float64
		Scenario     string
		Strategies   []sim.StrategyResult
	}
	var js []slim
	for _, p := range pts {
		st := make([]sim.StrategyResult, len(p.Result.Strategies))
		for i, s := range p.Result.Strategies {
			s.AdmittedRate, s.Shares = nil, nil
			st[i] = s
		}
		js = append(js, slim{p.Param, p.Value, p.X, p.Result.Scenario, st})
	}
	fs = append(fs, File{"sweep.json", JSON(js)})
	for i, c := range SweepCharts(pts) {
		f, err := charts("sweep-"+[]string{"utilization", "overshoot", "convergence"}[i], c)
		if err != nil {
			return nil, err
		}
		fs = append(fs, f...)
	}
	return fs, nil
}

// Write writes files into dir, creating it.
func Write(dir string, files []File) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("report: %w", err)
	}
	for _, f := range files {
		if err := os.WriteFile(filepath.Join(dir, f.Name), f.Data, 0o644); err != nil {
			return fmt.Errorf("report: %w", err)
		}
	}
	return nil
}
