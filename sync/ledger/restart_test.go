package ledger

import (
	"errors"
	"fmt"
	"testing"
)

// An agent that loses its state comes back as a new incarnation at its floor,
// asserts its marker first, and reports only once the marker is durable; peers
// then freeze the old incarnation and ignore it.
func TestRestartNewIncarnation(t *testing.T) {
	c := newCluster(t, 3)
	c.use[1] = 50
	for i := 0; i < 4; i++ {
		c.exchange()
	}
	old := c.l[0]
	oldRep := old.Tick(c.now).Report
	if oldRep == nil {
		t.Fatal("setup: no report from r0")
	}

	st, err := c.reg.Start("r0")
	if err != nil {
		t.Fatal(err)
	}
	st.RunID = "run1"
	l, err := New(c.cfg, "r0", c.spec, st, c.now)
	if err != nil {
		t.Fatal(err)
	}
	if st.Inc != 2 || l.Base() != l.floor[0] {
		t.Fatalf("new incarnation %d with base %d, want 2 at the floor %d", st.Inc, l.Base(), l.floor[0])
	}
	out := l.Tick(c.now)
	var create *Write
	for i, w := range out.Writes {
		if w.Create() {
			create = &out.Writes[i]
		}
	}
	if create == nil || create.Version.Inc != 2 || create.Units != l.floor[0] {
		t.Fatalf("first output must create the marker at the floor: %+v", out.Writes)
	}
	if out.Report != nil {
		t.Fatalf("reported before its marker is durable")
	}
	c.now += c.cfg.Interval
	if l.Tick(c.now).Report != nil {
		t.Fatalf("reported before its marker is durable")
	}
	l.ShareApplied(c.now, MarkerKey, create.Version)
	c.now += c.cfg.Interval
	rep := l.Tick(c.now).Report
	if rep == nil || rep.Inc != 2 {
		t.Fatalf("no report once the marker is durable: %+v", rep)
	}
	// A peer seeing incarnation 2 freezes incarnation 1 and contributes.
	got, err := c.l[1].Receive(c.now, *rep)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Contributions) != 1 || got.Contributions[0].Of != (Incarnation{"r0", 1}) {
		t.Fatalf("want a contribution for r0/1, got %+v", got.Contributions)
	}
	if _, err := c.l[1].Receive(c.now, *oldRep); !errors.Is(err, ErrFrozenIncarnation) {
		t.Fatalf("report of the old incarnation: err %v", err)
	}
}

// TestForeignMarkerSupersedes: the store answers a marker write with a
// marker this incarnation never wrote (a higher incarnation's, or its own
// number with a sequence past its writes: the registry that numbered it
// went back, or another agent runs the region). The store refuses every
// marker of this incarnation from then on, so it fences, naming the
// marker (Output.Superseded); before, the answer was ignored as another
// incarnation's (or, with the same number, taken as its own marker
// confirmed), and the region held its floor for as long as it ran. Its
// own answers, and older ones, change nothing.
func TestForeignMarkerSupersedes(t *testing.T) {
	for _, tc := range []struct {
		name    string
		v       func(create Version) Version
		foreign bool
	}{
		{"its own", func(c Version) Version { return c }, false},
		{"an older incarnation's", func(c Version) Version { return Version{c.Inc - 1, 1 << 40} }, false},
		{"a newer incarnation's", func(c Version) Version { return Version{c.Inc + 1, 1} }, true},
		{"its number, a sequence it never wrote", func(c Version) Version { return Version{c.Inc, c.Seq + 1000} }, true},
	} {
		for _, batch := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/batch=%v", tc.name, batch), func(t *testing.T) {
				cfg := DefaultConfig()
				l, err := New(cfg, "a", []RegionSpec{{"a", 1}, {"b", 1}}, Start{Inc: 2, RunID: "r"}, 0)
				if err != nil {
					t.Fatal(err)
				}
				var create Version
				for _, w := range l.Tick(cfg.Interval).Writes {
					if w.Create() {
						create = w.Version
					}
				}
				if create == (Version{}) {
					t.Fatal("no marker create")
				}
				v := tc.v(create)
				var out Output
				if batch {
					out = l.SharesApplied(cfg.Interval, []Confirmation{{Key: MarkerKey, Version: v}})
				} else {
					out = l.ShareApplied(cfg.Interval, MarkerKey, v)
				}
				if tc.foreign {
					if !out.Fenced || out.Superseded != v || !l.Fenced() {
						t.Fatalf("store answer %v to a write of %v: fenced %v, superseded %v; want fenced by it", v, create, out.Fenced, out.Superseded)
					}
					return
				}
				if out.Fenced || l.Fenced() || out.Superseded != (Version{}) {
					t.Fatalf("store answer %v to a write of %v fenced the ledger", v, create)
				}
			})
		}
	}
}
