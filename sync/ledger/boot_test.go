package ledger

import "testing"

// markerCreate is the marker Create among out's writes (nil: none).
func markerCreate(out Output) *Write {
	for i, w := range out.Writes {
		if w.Create() {
			return &out.Writes[i]
		}
	}
	return nil
}

// TestBootFlag: only a region's first incarnation flags its marker Create
// Boot (the store may then fill keys enforced at the floor), and only before
// any marker of it was confirmed and before any store reset; a later
// incarnation, a retry after a reset and a re-create after a reset are not
// boots (an empty Redis looks like a first boot to the store).
func TestBootFlag(t *testing.T) {
	c := newCluster(t, 2) // start: each ledger's first Tick creates its marker, confirmed
	c.now += c.cfg.Interval

	fresh := func(region int) *Ledger {
		t.Helper()
		st, err := c.reg.Start(c.spec[region].Name)
		if err != nil {
			t.Fatal(err)
		}
		st.RunID = "run1"
		l, err := New(c.cfg, c.spec[region].Name, c.spec, st, c.now)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	// A later incarnation of r0 (the registry gave the first to c.l[0]).
	l := fresh(0)
	if l.inc == 1 {
		t.Fatalf("setup: a second start got incarnation 1")
	}
	if w := markerCreate(l.Tick(c.now)); w == nil || w.Marker.Boot {
		t.Fatalf("incarnation %d: want a marker Create not flagged Boot, got %+v", l.inc, w)
	}

	// A first incarnation: Boot on its first Create and its retries, not
	// after a store reset.
	c2 := &cluster{t: t, cfg: c.cfg, spec: c.spec}
	var err error
	if c2.reg, err = NewRegistry(c2.cfg, c2.spec); err != nil {
		t.Fatal(err)
	}
	c = c2
	first := fresh(1)
	if first.inc != 1 {
		t.Fatalf("setup: a fresh registry's first start got incarnation %d", first.inc)
	}
	if w := markerCreate(first.Tick(c.now)); w == nil || !w.Marker.Boot {
		t.Fatalf("first incarnation's first Create: want Boot, got %+v", w)
	}
	c.now += c.cfg.RetryWrite + c.cfg.Interval
	if w := markerCreate(first.Tick(c.now)); w == nil || !w.Marker.Boot {
		t.Fatalf("first incarnation's retried Create: want Boot, got %+v", w)
	}
	first.StoreReset(c.now, "run2")
	recreated := false
	for range 3 {
		c.now += c.cfg.RetryWrite + c.cfg.Interval
		w := markerCreate(first.Tick(c.now))
		if w != nil && w.Marker.Boot {
			t.Fatalf("Create after a store reset flagged Boot: %+v", w)
		}
		recreated = recreated || w != nil && w.Marker.RunID == "run2"
	}
	if !recreated { // the marker comes back after the reset, only without the flag
		t.Fatal("no marker Create for the reset store (run2) within 3 retries")
	}
}
