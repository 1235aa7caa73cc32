package sim

import (
	"math"
	"time"
)

// WindowMax scores admissions recorded outside the simulator (rlsim live)
// exactly as a run scores a strategy: for every admission, the cost admitted
// per key in the closed window ending at it, over burst + rate x W.
// Admissions of one key must be added in non-decreasing time.
type WindowMax struct {
	bounds [3]float64
	max    [3]float64
	wins   map[string]*win
}

// NewWindowMax returns a WindowMax for a rule of rate tokens/s and burst tokens.
func NewWindowMax(rate, burst float64) *WindowMax {
	w := &WindowMax{wins: map[string]*win{}}
	for i, W := range Windows {
		w.bounds[i] = burst + rate*W.Seconds()
	}
	return w
}

// Add records an admission of cost tokens for key at t.
func (w *WindowMax) Add(t time.Duration, key string, cost int64) {
	x := w.wins[key]
	if x == nil {
		x = &win{}
		w.wins[key] = x
	}
	x.add(int64(t), cost, &w.bounds, &w.max)
}

// Overshoot returns, per window of Windows, the maximum of admitted /
// (burst + rate x W) - 1 so far (-1 with no admission).
func (w *WindowMax) Overshoot() []float64 {
	out := make([]float64, len(Windows))
	for k := range Windows {
		out[k] = round(w.max[k]-1, 6)
	}
	return out
}

// ConvergeSample is the period at which shares are sampled for convergence.
const ConvergeSample = convergeSample

// Converge returns, for shares sampled every ConvergeSample from time 0 and
// each shift, the reach and settle times in seconds (-1: never), as a run
// computes them (see metrics.convergence).
func Converge(conv [][]float64, shifts []Shift) (reach, settle []float64) {
	for si, sh := range shifts {
		from := int(math.Ceil(sh.At / convergeSample.Seconds()))
		to := len(conv)
		if si+1 < len(shifts) {
			to = int(math.Ceil(shifts[si+1].At / convergeSample.Seconds()))
		}
		to = min(to, len(conv))
		r := -1.0
		for k := from; k < to; k++ {
			if within(conv[k], sh) {
				r = float64(k)*convergeSample.Seconds() - sh.At
				break
			}
		}
		reach = append(reach, round(r, 3))
		at := -1.0
		for k := to - 1; k >= from; k-- {
			if !within(conv[k], sh) {
				break
			}
			at = float64(k)*convergeSample.Seconds() - sh.At
		}
		settle = append(settle, round(at, 3))
	}
	return reach, settle
}
