package driver

import (
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

// TestReceiveByWindows runs two regions twice, the same demand at the same
// times: in one world each peer message is decoded whole and merged with
// one Receive, in the other it is merged a window of 3 keys at a time
// (wire.DecodeWindowsFromOwned, as the agent and the simulator read
// messages). Each window reads as a part of a report its sender split, so
// both worlds move the shares to the same place: every key ends with the
// same units in both (within Hysteresis), a holding more than b as its
// demand asks, and the regions' units never sum above the limit in either.
func TestReceiveByWindows(t *testing.T) {
	const keys, window = 20, 3
	cfg := ledger.DefaultConfig()
	specs := []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}}
	type world struct {
		p       map[string]*fakePorts
		d       map[string]*Driver
		r       map[string]*Rule
		windows int // messages merged
	}
	mk := func() *world {
		reg, err := ledger.NewRegistry(cfg, specs)
		if err != nil {
			t.Fatal(err)
		}
		w := &world{p: map[string]*fakePorts{}, d: map[string]*Driver{}, r: map[string]*Rule{}}
		for _, n := range []string{"a", "b"} {
			w.p[n] = &fakePorts{t: t, sync: true}
			w.d[n] = New(n, w.p[n])
			w.r[n] = w.d[n].Add("r1")
			w.d[n].Started(w.r[n], newLedger(t, n, reg, cfg, specs, 0))
		}
		return w
	}
	whole, byWin := mk(), mk()
	// deliver hands every message published since the last call to the
	// other region, whole or by windows.
	deliver := func(w *world, windowed bool) {
		for _, from := range []string{"a", "b"} {
			to := "b"
			if from == "b" {
				to = "a"
			}
			msgs := w.p[from].msgs
			w.p[from].msgs = nil
			for _, m := range msgs {
				b, err := wire.Encode(m)
				if err != nil {
					t.Fatal(err)
				}
				if !windowed {
					dm, err := wire.Decode(b, w.d[to].Lists())
					if err != nil {
						t.Fatal(err)
					}
					w.d[to].Receive(dm)
					w.windows++
					continue
				}
				_, seq, err := wire.DecodeWindowsFromOwned(from, b, w.d[to].Lists(), window)
				if err != nil {
					t.Fatal(err)
				}
				for wm := range seq {
					if n := len(wm.Rules[0].Report.Keys); n > window {
						t.Fatalf("a window of %d keys", n)
					}
					w.d[to].Receive(wm)
					w.windows++
				}
			}
		}
	}
	units := func(w *world, n string) map[string]int64 {
		out := map[string]int64{}
		w.r[n].Led.Each(func(k string, s ledger.Share) { out[k] = s.Units })
		return out
	}
	for step := 1; step <= 100; step++ {
		now := time.Duration(step) * 100 * time.Millisecond
		for _, w := range []*world{whole, byWin} {
			for _, n := range []string{"a", "b"} {
				w.p[n].now = now
				var us []Usage
				for i := range keys {
					adm := int64(1) // b: a tenth of a's demand
					if n == "a" {
						adm = 10
					}
					us = append(us, Usage{Rule: "r1", Key: fmt.Sprintf("k%02d", i), Rate: 100, Admitted: adm})
				}
				w.d[n].Tick(us)
			}
			deliver(w, w == byWin)
			ua, ub := units(w, "a"), units(w, "b")
			for k, u := range ua {
				if u+ub[k] > cfg.Units {
					t.Fatalf("step %d: %s: a %d + b %d > %d units", step, k, u, ub[k], cfg.Units)
				}
			}
		}
	}
	if byWin.windows <= whole.windows {
		t.Fatalf("merged %d windows against %d whole messages: the reports were not split", byWin.windows, whole.windows)
	}
	for _, n := range []string{"a", "b"} {
		uw, uv := units(whole, n), units(byWin, n)
		if len(uw) != keys || len(uv) != keys {
			t.Fatalf("%s holds %d keys whole, %d by windows, want %d", n, len(uw), len(uv), keys)
		}
		for k, u := range uw {
			if d := u - uv[k]; d > cfg.Hysteresis || -d > cfg.Hysteresis {
				t.Errorf("%s %s: %d units with whole messages, %d by windows", n, k, u, uv[k])
			}
		}
	}
	a, b := units(byWin, "a")["k00"], units(byWin, "b")["k00"]
	if a <= b {
		t.Errorf("by windows, a (demand 10x b's) holds %d units and b %d", a, b)
	}
	t.Logf("k00: whole a=%d b=%d, by windows a=%d b=%d; %d windows merged against %d messages",
		units(whole, "a")["k00"], units(whole, "b")["k00"], a, b, byWin.windows, whole.windows)
}

// TestPublishParts: an owed report of more than SendWindow keys leaves a
// part of SendWindow keys at a time, each part a message of its own with
// the report's sequence number, the keys in name order across the parts;
// a smaller one leaves in one message. (Without pacing: with it, a
// ledger whose peer has acknowledged nothing yet sends PaceKeys keys at
// first, ledger/pace.go.)
func TestPublishParts(t *testing.T) {
	d, p, _, _ := setup(t, true, func(c *ledger.Config) { c.PaceKeys = 0 })
	keys := SendWindow + SendWindow/4
	p.msgs = nil
	p.now = 100 * time.Millisecond
	us := make([]Usage, keys)
	for i := range us {
		us[i] = Usage{Rule: "r1", Key: fmt.Sprintf("k%06d", i), Rate: 100, Admitted: 5}
	}
	d.Tick(us)
	var seq uint64
	n, last := 0, ""
	for i, m := range p.msgs {
		if len(m.Rules) != 1 || m.Rules[0].Rule != "r1" {
			t.Fatalf("message %d: %d rule reports", i, len(m.Rules))
		}
		r := m.Rules[0].Report
		if i == 0 {
			seq = r.Seq
		}
		if r.Seq != seq || len(r.Keys) > SendWindow {
			t.Fatalf("message %d: seq %d (first %d), %d keys", i, r.Seq, seq, len(r.Keys))
		}
		for _, k := range r.Keys {
			if k.Key <= last {
				t.Fatalf("message %d: key %q after %q", i, k.Key, last)
			}
			last = k.Key
			n++
		}
	}
	if len(p.msgs) != 2 || n != keys {
		t.Fatalf("%d messages with %d keys, want 2 with %d", len(p.msgs), n, keys)
	}
	// A report of fewer keys: one message.
	p.msgs = nil
	p.now += 100 * time.Millisecond
	d.Tick(us[:10])
	if len(p.msgs) != 1 {
		t.Fatalf("a report of 10 keys in %d messages", len(p.msgs))
	}
	// SetSendWindow(3): a report of 10 keys in parts of 3, 3, 3 and 1.
	d, p, _, _ = setup(t, true)
	d.SetSendWindow(3)
	p.msgs = nil
	p.now = 100 * time.Millisecond
	d.Tick(us[:10])
	var sizes []int
	for _, m := range p.msgs {
		sizes = append(sizes, len(m.Rules[0].Report.Keys))
	}
	if fmt.Sprint(sizes) != "[3 3 3 1]" {
		t.Fatalf("with a send window of 3, a report of 10 keys left as parts of %v keys", sizes)
	}
}
