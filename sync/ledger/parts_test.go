package ledger

import (
	"fmt"
	"reflect"
	"slices"
	"testing"
)

// TestOwedReportParts builds the same owed reports of two identical
// ledgers, one whole (OwedReport) and one by parts of 5 keys
// (OwedReportParts): every part has the whole report's header and at most
// 5 keys, more is true but for the last, and the parts' keys in order are
// the whole report's keys; and the ledgers stay identical (the next
// reports agree too).
func TestOwedReportParts(t *testing.T) {
	mk := func() *cluster {
		c := newCluster(t, 3)
		for range 4 {
			c.exchange()
		}
		c.l[0].DeferReports()
		return c
	}
	whole, byParts := mk(), mk()
	split := 0
	for step := range 6 {
		for _, c := range []*cluster{whole, byParts} {
			c.now += c.cfg.Interval
			for i := range 23 {
				c.l[0].Usage(c.now, fmt.Sprintf("k%02d", i), 100, int64(10+i*step), 0)
			}
			c.confirm(0, c.l[0].Tick(c.now))
		}
		want := whole.l[0].OwedReport(whole.now)
		var keys []KeyReport
		parts, more := 0, false
		for p, m := range byParts.l[0].OwedReportParts(byParts.now, 5) {
			parts, more = parts+1, m
			if want == nil {
				t.Fatalf("step %d: a part %+v where no report is owed", step, p)
			}
			h, wh := *p, *want
			h.Keys, wh.Keys = nil, nil
			if !reflect.DeepEqual(h, wh) {
				t.Fatalf("step %d: part %d header %+v, want %+v", step, parts, h, wh)
			}
			if len(p.Keys) > 5 || m && len(p.Keys) != 5 {
				t.Fatalf("step %d: part %d of %d keys, more %v", step, parts, len(p.Keys), m)
			}
			for _, k := range p.Keys { // the part's slices are used again
				k.Gave, k.Applied = slices.Clone(k.Gave), slices.Clone(k.Applied)
				keys = append(keys, k)
			}
		}
		if want == nil {
			continue
		}
		if more || parts != max(1, (len(want.Keys)+4)/5) {
			t.Fatalf("step %d: %d parts (more %v after the last) for %d keys", step, parts, more, len(want.Keys))
		}
		if len(keys) != len(want.Keys) || len(keys) > 0 && !reflect.DeepEqual(keys, want.Keys) {
			t.Fatalf("step %d: the parts' keys differ from the whole report's (%d and %d keys)", step, len(keys), len(want.Keys))
		}
		if parts > 1 {
			split++
		}
	}
	if split == 0 {
		t.Fatal("no report was split into parts")
	}
}
