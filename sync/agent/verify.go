package agent

import (
	"errors"

	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/wire"
)

// Reasons of apportion_sync_reports_rejected_total about authentication and
// freshness (see metrics.go for the others).
const (
	ReasonUnsigned     = "unsigned"      // no signature, from a region that must sign
	ReasonUnknownKey   = "unknown_key"   // signed, but no public key is configured for the region
	ReasonBadSignature = "bad_signature" // forged, altered or truncated
	ReasonReplayed     = driver.ReasonReplayed
	ReasonImplausible  = driver.ReasonImplausible
)

// reasons lists every reason, so that each series exists from the start.
var reasons = []string{ReasonMalformed, ReasonUnsigned, ReasonUnknownKey, ReasonBadSignature, ReasonReplayed,
	ReasonUnknownRule, ReasonUnknownReg, ReasonRegions, ReasonStale, ReasonFrozen, ReasonBackwards, ReasonImplausible, ReasonOverflow, ReasonLayout, ReasonOther}

// openReason maps a wire.Verifier.Open error to its reason.
func openReason(err error) string {
	switch {
	case errors.Is(err, wire.ErrUnsigned):
		return ReasonUnsigned
	case errors.Is(err, wire.ErrUnknownKey):
		return ReasonUnknownKey
	case errors.Is(err, wire.ErrBadSignature):
		return ReasonBadSignature
	}
	return ReasonMalformed
}
