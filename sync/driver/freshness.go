package driver

import (
	"errors"
	"fmt"
	"strings"

	"github.com/apportion/apportion/sync/ledger"
)

// freshness is the newest report accepted from one peer for one rule: its
// incarnation, sequence number and last key. A signature proves who sent a
// report, not when: a recorded report verifies forever. The driver therefore
// passes a peer's rule report to the ledger only if it is newer than the
// newest accepted, by incarnation then sequence, or, for the parts of one
// report that wire.EncodeSplit cut by keys (same incarnation and sequence,
// keys in ascending ranges), if its keys start after the last accepted key.
// Replayed, repeated and reordered reports are dropped (the ledger
// tolerates loss), so a recorded report can neither keep a dead region
// looking alive nor bring back an older state. Incarnations come from the
// registry and only grow; sequence numbers only grow within one.
type freshness struct {
	inc, seq uint64
	lastKey  string
	any      bool
}

// ErrReplayed is the error of a report dropped as ReasonReplayed.
var ErrReplayed = errors.New("driver: replayed report")

// check returns an error (wrapping ErrReplayed) if r is not newer than f.
func (f freshness) check(r ledger.Report) error {
	switch {
	case !f.any || r.Inc > f.inc || r.Inc == f.inc && r.Seq > f.seq:
		return nil
	case r.Inc < f.inc:
		return fmt.Errorf("%w: incarnation %d, already accepted %d", ErrReplayed, r.Inc, f.inc)
	case r.Seq < f.seq:
		return fmt.Errorf("%w: sequence %d of incarnation %d, already accepted %d", ErrReplayed, r.Seq, r.Inc, f.seq)
	case len(r.Keys) > 0 && r.Keys[0].Key > f.lastKey:
		return nil // the next part of a split report
	}
	return fmt.Errorf("%w: report %d of incarnation %d repeated", ErrReplayed, r.Seq, r.Inc)
}

// accepted returns f advanced past r.
func (f freshness) accepted(r ledger.Report) freshness {
	last := ""
	if n := len(r.Keys); n > 0 {
		// A copy: the key is a string of the decoded message, which it
		// would keep alive (a whole message, up to a part's megabyte, per
		// peer and rule) until the peer's next report.
		last = strings.Clone(r.Keys[n-1].Key)
	}
	return freshness{inc: r.Inc, seq: r.Seq, lastKey: last, any: true}
}
