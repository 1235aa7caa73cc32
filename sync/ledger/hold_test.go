package ledger

import "testing"

// TestHoldCancelsWhatTheStoreRefused: the giver's lowering is refused by
// the store (a window that has used more than the lowered share allows);
// Hold cancels the unconfirmed part of the gift, so a later confirmation
// never publishes it, bounds the gifts that follow by what is above the
// hold, and ends when its time is up.
func TestHoldCancelsWhatTheStoreRefused(t *testing.T) {
	c := newCluster(t, 2)
	c.l[1].Usage(c.now, "k", 100, 100, 0) // r1 has all the demand
	c.deliver(0, c.l[1].Tick(c.now+10*ms).Report)
	c.now += c.cfg.Interval
	c.l[0].Usage(c.now, "k", 100, 1, 0) // r0 knows the key
	out := c.l[0].Tick(c.now)
	var lowered *Write
	for i, w := range out.Writes {
		if w.Key == "k" {
			lowered = &out.Writes[i]
		}
	}
	base := c.l[0].Base()
	if lowered == nil || lowered.Units >= base {
		t.Fatalf("no lowering: %+v", out.Writes)
	}
	// The store refuses: the key has used base-10 units' worth.
	hold := base - 10
	c.l[0].Hold(c.now, "k", hold, 10*c.cfg.Interval)
	if p := c.l[0].Position("k").Units; p != hold {
		t.Fatalf("after the hold the position is %d, want %d (cancelled down to the hold)", p, hold)
	}
	// A late confirmation of the refused version publishes only the part
	// that was not cancelled.
	rep := c.l[0].ShareApplied(c.now, "k", lowered.Version).Report
	if g := gaveTo(rep, "k", "r1"); g != base-hold {
		t.Fatalf("published gift %d, want %d (what is above the hold)", g, base-hold)
	}
	// The next ticks write the raised-back position and give nothing more.
	for i := 0; i < 5; i++ {
		c.now += c.cfg.Interval
		c.l[1].Usage(c.now, "k", 100, 100, 0)
		c.deliver(0, c.l[1].Tick(c.now).Report)
		out := c.l[0].Tick(c.now)
		for _, w := range out.Writes {
			if w.Key == "k" && w.Units < hold {
				t.Fatalf("tick %d writes %d units, below the hold %d", i, w.Units, hold)
			}
		}
		c.confirm(0, out)
	}
	// Once the hold ends, the rest is given.
	c.now += 10 * c.cfg.Interval
	for i := 0; i < 3; i++ {
		c.now += c.cfg.Interval
		c.l[1].Usage(c.now, "k", 100, 100, 0)
		c.deliver(0, c.l[1].Tick(c.now).Report)
		c.confirm(0, c.l[0].Tick(c.now))
	}
	if p := c.l[0].Position("k").Units; p >= hold {
		t.Fatalf("after the hold ended the position is still %d (hold %d)", p, hold)
	}
	if s := c.sum("k"); s > c.cfg.Units {
		t.Fatalf("sum %d > %d", s, c.cfg.Units)
	}
}
