package driver

import (
	"cmp"
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
// the later one last. (With ledger.DeferReports, which the driver sets,
// each ledger's reports of a batch are built as one when it leaves, so
// this finds nothing to drop; it stays for reports collected built.)
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
	// From the last report back: per rule and incarnation, the keys of
	// the reports after this one (each report's cut already to those no
	// later report has, so the keys after it are their union) and the
	// closures of the nearest one that stays.
	type ruleInc struct {
		rule string
		inc  uint64
	}
	type after struct {
		keys   [][]ledger.KeyReport
		closes []ledger.Closure
	}
	later := make(map[ruleInc]*after, len(rs))
	drop := make([]bool, len(rs))
	for i := len(rs) - 1; i >= 0; i-- {
		e := &rs[i].Report
		id := ruleInc{rs[i].Rule, e.Inc}
		a := later[id]
		if a == nil {
			a = &after{}
			later[id] = a
		} else {
			for _, ks := range a.keys {
				e.Keys = without(e.Keys, ks)
			}
			if len(e.Keys) == 0 && closuresWithin(e.Closes, a.closes) {
				drop[i] = true
				continue
			}
		}
		if len(e.Keys) > 0 {
			a.keys = append(a.keys, e.Keys)
		}
		a.closes = e.Closes
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
	return cmp.Or(strings.Compare(a.Key, b.Key), strings.Compare(a.Region, b.Region),
		cmp.Compare(a.Inc, b.Inc), cmp.Compare(a.Retire, b.Retire))
}
