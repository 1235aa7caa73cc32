package rules

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"
)

// Algorithm names a limiting algorithm.
type Algorithm string

// The algorithms an enforcer implements.
const (
	TokenBucket   Algorithm = "token_bucket"   // capacity + refill_per_second
	SlidingWindow Algorithm = "sliding_window" // limit per window, two-window counter
	FixedWindow   Algorithm = "fixed_window"   // limit per window
	SlidingLog    Algorithm = "sliding_log"    // limit per window, exact log
	LeakyBucket   Algorithm = "leaky_bucket"   // meter: capacity + refill_per_second (leak rate)
)

// Scope says whether each region enforces the whole limit or a share of it.
type Scope string

// Scopes.
const (
	Regional Scope = "regional"
	Global   Scope = "global"
)

// FailureMode says what a rule does while the store is unreachable.
type FailureMode string

// Failure modes.
const (
	FailOpen   FailureMode = "open"   // allow and count (default)
	FailClosed FailureMode = "closed" // deny
	FailLocal  FailureMode = "local"  // conservative in-process limiter
)

// Priority says whether a rule's checks may be shed under overload.
type Priority string

// Priorities.
const (
	PriorityHigh Priority = "high" // never shed (the default)
	PriorityLow  Priority = "low"  // shed first under overload
)

// Rule is one rate-limit rule, stored as one JSON document (docs/design.md section 4).
type Rule struct {
	ID string `json:"id"`
	// Match selects the requests the rule applies to: "resource" and attribute
	// names (tier, ip, api_key, ...) to an exact value or "*" (any value,
	// attribute must be present). An empty Match matches every request.
	Match map[string]string `json:"match,omitempty"`
	// Key lists the request parts that name a bucket: "client_key" (default),
	// "resource", or attribute names.
	Key       []string  `json:"key,omitempty"`
	Algorithm Algorithm `json:"algorithm"`
	// Capacity and RefillPerSecond configure token_bucket and leaky_bucket.
	Capacity        int64   `json:"capacity,omitempty"`
	RefillPerSecond float64 `json:"refill_per_second,omitempty"`
	// Limit and Window configure the window algorithms.
	Limit  int64    `json:"limit,omitempty"`
	Window Duration `json:"window,omitempty"`

	Scope Scope `json:"scope,omitempty"`
	// Regions weighs the regions' static shares of a global rule.
	Regions map[string]float64 `json:"regions,omitempty"`
	// MinShare is the fraction of a region's static share that is its floor.
	MinShare    float64     `json:"min_share,omitempty"`
	FailureMode FailureMode `json:"failure_mode,omitempty"`
	Shadow      bool        `json:"shadow,omitempty"`
	// Priority says whether checks of this rule may be shed while the
	// enforcer is overloaded: "high" (the default) always goes to the
	// store; "low" is answered without the store (rejected, never admitted
	// unchecked) while the enforcer's queue or the store's latency is past
	// its threshold.
	Priority Priority `json:"priority,omitempty"`
	// LocalBatch takes this many tokens at a time from the store (0: off).
	LocalBatch int64 `json:"local_batch,omitempty"`
	// Split spreads a hot key over this many sub-buckets (0 or 1: off).
	Split int `json:"split,omitempty"`
}

// Source delivers rule sets. Run calls update with the first complete, valid
// rule set and then with every new one, until ctx is done. A source never
// delivers a set containing an invalid rule: it logs the bad document and
// keeps the last good version. update is called from one goroutine at a time.
type Source interface {
	Run(ctx context.Context, update func([]Rule)) error
}

// Sentinel errors.
var (
	ErrInvalid          = errors.New("rules: invalid rule")
	ErrUnknownAlgorithm = errors.New("rules: unknown algorithm")
)

// Duration is a window length written as a Go duration string ("1s", "1m",
// "1h", "24h") in JSON and YAML.
type Duration time.Duration

// String writes the duration in its shortest exact form in the largest unit
// that divides it: "1m" rather than "1m0s", "90m", "24h", "1500ms".
func (d Duration) String() string {
	v := time.Duration(d)
	for _, u := range []struct {
		unit time.Duration
		name string
	}{{time.Hour, "h"}, {time.Minute, "m"}, {time.Second, "s"}, {time.Millisecond, "ms"}} {
		if v != 0 && v%u.unit == 0 {
			return strconv.FormatInt(int64(v/u.unit), 10) + u.name
		}
	}
	return v.String()
}

// MarshalJSON writes the duration as a string (see String).
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(d.String())
}

// UnmarshalJSON reads a duration string such as "1m".
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return &durationError{fmt.Sprintf("must be a duration string such as \"1s\" or \"1m\", got %s", b)}
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return &durationError{fmt.Sprintf("%q is not a duration such as \"1s\", \"1m\", \"1h\" or \"24h\"", s)}
	}
	*d = Duration(v)
	return nil
}

// durationError is the error of Duration.UnmarshalJSON; the parser turns it
// into a FieldError naming "window".
type durationError struct{ msg string }

func (e *durationError) Error() string { return "window " + e.msg }

// Clone returns a deep copy of r.
func (r Rule) Clone() Rule {
	r.Match = maps.Clone(r.Match)
	r.Key = slices.Clone(r.Key)
	r.Regions = maps.Clone(r.Regions)
	return r
}

// KeyValues returns the request's values of the parts in r.Key, in order:
// the client key for "client_key", the resource for "resource" and the
// attribute for any other name. ok is false when an attribute named in Key is
// missing from attrs (the rule then has no bucket for the request).
func (r *Rule) KeyValues(clientKey, resource string, attrs map[string]string) (parts []string, ok bool) {
	return r.AppendKeyValues(make([]string, 0, len(r.Key)), clientKey, resource, attrs)
}

// AppendKeyValues is KeyValues appending to dst, for callers that reuse a buffer.
func (r *Rule) AppendKeyValues(dst []string, clientKey, resource string, attrs map[string]string) ([]string, bool) {
	for _, p := range r.Key {
		switch p {
		case PartClientKey:
			dst = append(dst, clientKey)
		case PartResource:
			dst = append(dst, resource)
		default:
			v, ok := attrs[p]
			if !ok {
				return dst, false
			}
			dst = append(dst, v)
		}
	}
	return dst, true
}

// Coordinated reports whether the sync agents coordinate the rule's shares
// (the share ledger): a global token_bucket, fixed_window or sliding_window.
// Other global rules (leaky_bucket, sliding_log) enforce their static share.
func (r Rule) Coordinated() bool {
	return r.Scope == Global && (r.Algorithm == TokenBucket || r.Algorithm == FixedWindow || r.Algorithm == SlidingWindow)
}

// StaticShare returns the fraction of the rule's limit that region enforces
// when no dynamic share is set: for a global rule its weight divided by the
// sum of the weights (ok false, 0 when the region is not listed: it has no
// share); for a regional rule 1 (every region enforces the whole limit).
func (r Rule) StaticShare(region string) (weightFraction float64, ok bool) {
	if r.Scope != Global {
		return 1, true
	}
	w, ok := r.Regions[region]
	if !ok || w <= 0 {
		return 0, false
	}
	var sum float64
	for _, name := range slices.Sorted(maps.Keys(r.Regions)) { // fixed order: same float sum everywhere
		sum += r.Regions[name]
	}
	return w / sum, true
}
