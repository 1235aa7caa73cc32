// Package rules holds the rate-limit rule model, its validation, the matching
// index and the sources that deliver rule sets (a file, etcd).
//
// Invariant: a rule that fails validation is never applied. Every error names
// the field that is wrong (see FieldError), and a source that meets a bad
// document keeps serving the last good rule set.
package rules

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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

// Rule is one rate-limit rule, stored as one JSON document (DESIGN.md section 4).
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

// MarshalJSON writes the duration as a string.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON reads a duration string such as "1m".
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("window must be a duration string such as \"1s\" or \"1m\"")
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("window %q is not a duration such as \"1s\" or \"1m\"", s)
	}
	*d = Duration(v)
	return nil
}
