package live

import (
	"fmt"
	"strings"

	"github.com/apportion/apportion/simulations/report"
)

// Table is the comparison table (virtual ideal, virtual ledger, live) with
// how the run was played and the overshoot the live clock alone may show.
func (r *Result) Table() string {
	var b strings.Builder
	in := r.Live
	b.WriteString(report.Table(r.Result))
	policy := "fail-open"
	if in.FailureMode == "closed" {
		policy = "answered by the failure policy (closed: rejected)"
	}
	fmt.Fprintf(&b, "live: %d requests in %.1f s on %s (x%g speed, scale %.4g: rate %g/s, burst %g, peak offered %.0f req/s); %d errors, %d %s\n",
		in.Requests, in.WallS, in.Redis, in.Speed, in.Scale, in.Rate, in.Burst, in.PeakLoad, in.Errors, in.FailOpen, policy)
	fmt.Fprintf(&b, "live: send lag p99 %.1f ms (max %.1f), call latency p99 %.1f ms (max %.1f)\n", in.LagP99Ms, in.LagMaxMs, in.LatP99Ms, in.LatMaxMs)
	tol := in.Tolerance()
	fmt.Fprintf(&b, "live: overshoot the clock alone may show (rate x max latency / bound): 1s %+.2f%%, 10s %+.2f%%, 60s %+.2f%%\n",
		100*tol[0], 100*tol[1], 100*tol[2])
	if in.FirstError != "" {
		fmt.Fprintf(&b, "live: first error: %s\n", in.FirstError)
	}
	for _, n := range in.Notes {
		fmt.Fprintf(&b, "note: %s\n", n)
	}
	return b.String()
}

// Files are the outputs for --out: the simulator's files for the three
// columns (summary.*, series.csv, result.json, charts) plus live.txt (the
// table with the live notes) and live.json (the run's Info).
func (r *Result) Files() ([]report.File, error) {
	fs, err := report.RunFiles(r.Result)
	if err != nil {
		return nil, err
	}
	return append(fs, report.File{Name: "live.txt", Data: []byte(r.Table())}, report.File{Name: "live.json", Data: report.JSON(r.Live)}), nil
}
