package sim

import "time"

// event is one scheduled callback. Ties in time run in scheduling order (seq),
// so a run is a pure function of the scenario and the seed.
type event struct {
	at  time.Duration
	seq uint64
	fn  func()
}

// engine is the virtual clock and its event heap (a binary min-heap of values,
// ordered by (at, seq)).
type engine struct {
	now time.Duration
	seq uint64
	q   []event
}

func (e *engine) less(i, j int) bool {
	a, b := &e.q[i], &e.q[j]
	return a.at < b.at || a.at == b.at && a.seq < b.seq
}

func (e *engine) at(t time.Duration, fn func()) {
	if t < e.now {
		t = e.now
	}
	e.seq++
	e.q = append(e.q, event{at: t, seq: e.seq, fn: fn})
	i := len(e.q) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !e.less(i, p) {
			break
		}
		e.q[i], e.q[p] = e.q[p], e.q[i]
		i = p
	}
}

// pop removes and returns the earliest event; ok is false when the heap is empty.
func (e *engine) pop() (event, bool) {
	n := len(e.q)
	if n == 0 {
		return event{}, false
	}
	top := e.q[0]
	e.q[0] = e.q[n-1]
	e.q[n-1] = event{}
	e.q = e.q[:n-1]
	n--
	i := 0
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && e.less(l, m) {
			m = l
		}
		if r < n && e.less(r, m) {
			m = r
		}
		if m == i {
			break
		}
		e.q[i], e.q[m] = e.q[m], e.q[i]
		i = m
	}
	return top, true
}
