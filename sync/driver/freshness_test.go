package driver

import (
	"errors"
	"testing"

	"github.com/apportion/apportion/sync/ledger"
)

func TestFreshness(t *testing.T) {
	rep := func(inc, seq uint64, keys ...string) ledger.Report {
		r := ledger.Report{From: "a", Inc: inc, Seq: seq}
		for _, k := range keys {
			r.Keys = append(r.Keys, ledger.KeyReport{Key: k})
		}
		return r
	}
	var f freshness
	steps := []struct {
		name string
		r    ledger.Report
		ok   bool
	}{
		{"first", rep(2, 5, "k1", "k2"), true},
		{"repeat", rep(2, 5, "k1", "k2"), false},
		{"older sequence", rep(2, 4, "k9"), false},
		{"older incarnation", rep(1, 900, "k9"), false},
		{"next part of the split report", rep(2, 5, "k3", "k4"), true},
		{"earlier part again", rep(2, 5, "k1", "k2"), false},
		{"next report", rep(2, 6), true},
		{"keyless repeat", rep(2, 6), false},
		{"newer incarnation", rep(3, 1, "k1"), true},
		{"previous incarnation's newest", rep(2, 6), false},
	}
	for _, st := range steps {
		err := f.check(st.r)
		if st.ok != (err == nil) {
			t.Fatalf("%s: check = %v, want ok=%v", st.name, err, st.ok)
		}
		if err != nil && !errors.Is(err, ErrReplayed) {
			t.Fatalf("%s: %v does not wrap ErrReplayed", st.name, err)
		}
		if err == nil {
			f = f.accepted(st.r)
		}
	}
}
