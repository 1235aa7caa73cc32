package driver

import (
	"slices"
	"strings"

	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

// supersede drops from a batch what a later report of the same rule
// carries again: a key report of an earlier report whose key a later report
// of the same rule and incarnation also reports (a tick's report, then the
// report of the same keys' confirmations, in one flush), and an earlier
// report left with no key whose closures the later one carries too. The
// batch is published as one message, so the receiver reads both anyway,
// the later one last.
//
// Safety does not depend on it, because it is what the network may do:
// an earlier report cut down to some of its keys is a report split into
// parts one of which was lost (each part repeats the header, acks and
// closures, and the ledger takes the parts of one sequence number as one),
// and a report dropped whole is a report lost. Neither loses information:
// every key dropped is reported later in the same message with its state
// as of that later report (counters are cumulative, a position and demand
// of a later sequence replace the earlier ones), and a closure, once
// carried, is in every report until acknowledged. Sync bytes: a hot key
// written every interval was reported twice per message.
//
// It filters the reports' key slices in place (the ledger builds a new
// report for every output and keeps none) and returns the batch without
// the dropped reports, in order.
func supersede(rs []wire.RuleReport) []wire.RuleReport {
	if len(rs) < 2 {
		return rs
	}
	// The common batch holds one report per rule: nothing to do.
	dup := false
	for i := 1; i < len(rs) && !dup; i++ {
		for j := range i {
			if rs[j].Rule == rs[i].Rule {
				dup = true
				break
			}
		}
	}
	if !dup {
		return rs
	}
	drop := make([]bool, len(rs))
	for i := len(rs) - 2; i >= 0; i-- {
		e := &rs[i].Report
		// The later reports of the rule and incarnation; first: the first
		// of them that stays, for its closures. Their keys have been cut
		// already to those no report after them has, so the keys of the
		// later reports are their union, each report's sorted by name.
		var later [][]ledger.KeyReport
		first := -1
		for j := i + 1; j < len(rs); j++ {
			if rs[j].Rule != rs[i].Rule || rs[j].Report.Inc != e.Inc {
				continue
			}
			if len(rs[j].Report.Keys) > 0 {
				later = append(later, rs[j].Report.Keys)
			}
			if first < 0 && !drop[j] {
				first = j
			}
		}
		if first < 0 {
			continue
		}
		for _, ks := range later {
			e.Keys = without(e.Keys, ks)
		}
		if len(e.Keys) == 0 && closuresWithin(e.Closes, rs[first].Report.Closes) {
			drop[i] = true
		}
	}
	out := rs[:0]
	for i, r := range rs {
		if !drop[i] {
			out = append(out, r)
		}
	}
	return out
}

// without filters keys (sorted by name) in place to those not in of
// (sorted by name).
func without(keys, of []ledger.KeyReport) []ledger.KeyReport {
	out := keys[:0]
	j := 0
	for _, k := range keys {
		for j < len(of) && of[j].Key < k.Key {
			j++
		}
		if j < len(of) && of[j].Key == k.Key {
			continue
		}
		out = append(out, k)
	}
	return out
}

// closuresWithin reports whether every closure of cs is in of (both sorted
// by Key, Region, Inc, as a report carries them).
func closuresWithin(cs, of []ledger.Closure) bool {
	for _, c := range cs {
		if _, ok := slices.BinarySearchFunc(of, c, compareClosure); !ok {
			return false
		}
	}
	return true
}

func compareClosure(a, b ledger.Closure) int {
	if c := strings.Compare(a.Key, b.Key); c != 0 {
		return c
	}
	if c := strings.Compare(a.Region, b.Region); c != 0 {
		return c
	}
	switch {
	case a.Inc < b.Inc:
		return -1
	case a.Inc > b.Inc:
		return 1
	}
	if a.Retire < b.Retire {
		return -1
	} else if a.Retire > b.Retire {
		return 1
	}
	return 0
}
