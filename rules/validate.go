package rules

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"time"
	"unicode/utf8"
)

// Limits on the values of a rule. They are those of the store: tokens are
// held in thousandths and every intermediate value of the store's arithmetic
// stays below 2^53, the exact-integer range of a Lua number (the store
// refuses a bucket outside them, and regional/redisstore's tests check that
// the two sets of limits agree). They also keep documents small.
const (
	MaxIDLen         = 128
	MaxNameLen       = 128  // a key part, match key, or region name
	MaxMatchValueLen = 1024 // a match value
	// MaxCapacity is 2^38 thousandths of a token, in whole tokens.
	MaxCapacity = (1 << 38) / 1000
	// MaxLimit is 2^40 tokens per window; Limit x Window (in ms) must also
	// stay at most MaxLimitWindowMs.
	MaxLimit         = 1 << 40
	MaxLimitWindowMs = 1 << 52
	// MinRefillPerSecond is one thousandth of a token per second; a refill
	// is held in whole thousandths (truncated), at most 2^40.
	MinRefillPerSecond = 0.001
	MaxRefillPerSecond = 1e9
	MaxSplit           = 64
	MaxWeight          = 1e9 // a region's weight: sums of weights stay finite
	MinWindow          = time.Millisecond
	MaxWindow          = 366 * 24 * time.Hour
)

// Request parts a rule can name besides attributes.
const (
	PartClientKey = "client_key" // the request's client key (Key only)
	PartResource  = "resource"   // the request's resource (Key and Match)
	MatchAny      = "*"          // match value: attribute present, any value
)

// FieldError is a validation error that names the offending field.
type FieldError struct {
	RuleID string
	Field  string // JSON name, e.g. "capacity" or "match.tier"; "" for the whole document
	Msg    string
	// Item is the 1-based position of the rule in a list parsed by
	// ParseRules, or 0 when the rule did not come from a list.
	Item int
}

func (e *FieldError) Error() string {
	var b strings.Builder
	b.WriteString("rules: ")
	switch {
	case e.RuleID != "" && e.Item > 0:
		fmt.Fprintf(&b, "rule %q (item %d): ", e.RuleID, e.Item)
	case e.RuleID != "":
		fmt.Fprintf(&b, "rule %q: ", e.RuleID)
	case e.Item > 0:
		fmt.Fprintf(&b, "item %d: ", e.Item)
	}
	if e.Field != "" {
		b.WriteString(e.Field)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// Unwrap makes errors.Is(err, ErrInvalid) true.
func (e *FieldError) Unwrap() error { return ErrInvalid }

// algorithmError is the FieldError of an unknown algorithm; it also matches
// ErrUnknownAlgorithm.
type algorithmError struct{ FieldError }

func (e *algorithmError) Unwrap() []error {
	return []error{&e.FieldError, ErrUnknownAlgorithm}
}

// Normalize fills defaults: key ["client_key"], scope regional, failure_mode
// open. It also writes empty maps as nil and split 1 (one bucket, that is,
// off) as 0, so equal rules compare and marshal equal.
func (r *Rule) Normalize() {
	if len(r.Key) == 0 {
		r.Key = []string{PartClientKey}
	}
	if r.Scope == "" {
		r.Scope = Regional
	}
	if r.FailureMode == "" {
		r.FailureMode = FailOpen
	}
	if len(r.Match) == 0 {
		r.Match = nil
	}
	if len(r.Regions) == 0 {
		r.Regions = nil
	}
	if r.Split == 1 {
		r.Split = 0
	}
}

// Validate checks a rule and returns the first problem as a *FieldError that
// names the JSON field (an unknown algorithm also matches
// ErrUnknownAlgorithm). Validate does not modify r; empty key, scope and
// failure_mode are accepted as their defaults (see Normalize).
func (r *Rule) Validate() error {
	fe := func(field, format string, args ...any) error {
		return &FieldError{RuleID: r.ID, Field: field, Msg: fmt.Sprintf(format, args...)}
	}
	if r.ID == "" {
		return fe("id", "required")
	}
	if msg := checkName(r.ID, MaxIDLen); msg != "" {
		return &FieldError{Field: "id", Msg: msg}
	}
	if strings.Trim(r.ID, ".") == "" {
		return &FieldError{Field: "id", Msg: fmt.Sprintf("%q is not allowed (it is a path element)", r.ID)}
	}

	for _, k := range slices.Sorted(maps.Keys(r.Match)) {
		v := r.Match[k]
		field := "match." + k
		if k == "" {
			field = "match"
		}
		switch {
		case k == PartClientKey:
			return fe(field, "rules cannot match on the client key; match on resource or attributes and use key [\"client_key\"] to get a bucket per client")
		case checkName(k, MaxNameLen) != "":
			return fe(field, "match key is not a valid attribute name: %s", checkName(k, MaxNameLen))
		case v == "":
			return fe(field, "value is empty; use an exact value, or \"*\" for any value")
		case len(v) > MaxMatchValueLen:
			return fe(field, "value is %d bytes, over the limit of %d", len(v), MaxMatchValueLen)
		case v != MatchAny && strings.Contains(v, MatchAny):
			return fe(field, "value %q: patterns are not supported; use an exact value, or \"*\" alone for any value", v)
		}
	}

	for i, p := range r.Key {
		field := fmt.Sprintf("key[%d]", i)
		if msg := checkName(p, MaxNameLen); msg != "" {
			return fe(field, "%s (use \"client_key\", \"resource\" or an attribute name)", msg)
		}
		if slices.Index(r.Key, p) != i {
			return fe(field, "%q is listed twice", p)
		}
	}

	switch r.Algorithm {
	case "":
		return fe("algorithm", "required; one of %s", algorithmList)
	case TokenBucket, LeakyBucket:
		if err := r.validateBucket(fe); err != nil {
			return err
		}
	case SlidingWindow, FixedWindow, SlidingLog:
		if err := r.validateWindow(fe); err != nil {
			return err
		}
	default:
		return &algorithmError{FieldError{RuleID: r.ID, Field: "algorithm",
			Msg: fmt.Sprintf("unknown algorithm %q; use one of %s", r.Algorithm, algorithmList)}}
	}

	switch r.Scope {
	case "", Regional:
		if len(r.Regions) > 0 {
			return fe("regions", "only a global rule has regions (set scope \"global\", or remove regions)")
		}
		if r.MinShare != 0 {
			return fe("min_share", "only a global rule has min_share (set scope \"global\", or remove min_share)")
		}
	case Global:
		if len(r.Regions) == 0 {
			return fe("regions", "a global rule needs at least one region with a weight, e.g. {\"us-east\": 1}")
		}
		for _, name := range slices.Sorted(maps.Keys(r.Regions)) {
			w := r.Regions[name]
			field := "regions." + name
			if name == "" {
				field = "regions"
			}
			if msg := checkName(name, MaxNameLen); msg != "" {
				return fe(field, "region name: %s", msg)
			}
			if math.IsNaN(w) || w <= 0 || w > MaxWeight {
				return fe(field, "weight must be a finite number above 0, at most %g, got %v", MaxWeight, w)
			}
		}
		if math.IsNaN(r.MinShare) || r.MinShare < 0 || r.MinShare > 1 {
			return fe("min_share", "must be between 0 and 1, got %v", r.MinShare)
		}
		if err := r.validateShares(fe); err != nil {
			return err
		}
	default:
		return fe("scope", "unknown scope %q; use \"regional\" or \"global\"", r.Scope)
	}

	switch r.FailureMode {
	case "", FailOpen, FailClosed, FailLocal:
	default:
		return fe("failure_mode", "unknown failure mode %q; use \"open\", \"closed\" or \"local\"", r.FailureMode)
	}
	switch r.Priority {
	case "", PriorityHigh, PriorityLow:
	default:
		return fe("priority", "unknown priority %q; use \"high\" (the default) or \"low\"", r.Priority)
	}
	switch {
	case r.LocalBatch == 0 || r.LocalBatch == 1:
	case r.LocalBatch < 0:
		return fe("local_batch", "must be at least 2 (tokens taken from the store at a time; 0 or 1: off), got %d", r.LocalBatch)
	case r.Algorithm != TokenBucket:
		return fe("local_batch", "only a token_bucket can take tokens in advance, not %s", r.Algorithm)
	case r.LocalBatch > r.Capacity:
		return fe("local_batch", "%d is above capacity %d (a batch larger than the bucket could never be taken)", r.LocalBatch, r.Capacity)
	}
	switch {
	case r.Split == 0 || r.Split == 1:
	case r.Split < 0 || r.Split > MaxSplit:
		return fe("split", "must be between 2 and %d (sub-buckets of a hot key; 0 or 1: off), got %d", MaxSplit, r.Split)
	case r.Algorithm != TokenBucket:
		return fe("split", "only a token_bucket can be split, not %s", r.Algorithm)
	case r.Scope == Global:
		return fe("split", "a global rule cannot be split (its shares are coordinated per key)")
	case r.LocalBatch > 1:
		return fe("split", "split and local_batch do not combine; use one")
	case int64(float64(r.Capacity)*1000/float64(r.Split)) < 1 || int64(r.RefillPerSecond*1000/float64(r.Split)) < 1:
		return fe("split", "%d sub-buckets of capacity %d and refill %v fall below the store's unit (a thousandth of a token)", r.Split, r.Capacity, r.RefillPerSecond)
	}
	return nil
}

var algorithmList = `"token_bucket", "sliding_window", "fixed_window", "sliding_log", "leaky_bucket"`

func (r *Rule) validateBucket(fe func(string, string, ...any) error) error {
	a := r.Algorithm
	switch {
	case r.Capacity == 0:
		return fe("capacity", "required for %s (the burst size, at least 1)", a)
	case r.Capacity < 0:
		return fe("capacity", "must be at least 1, got %d (negative)", r.Capacity)
	case r.Capacity > MaxCapacity:
		return fe("capacity", "must be at most %d (2^38 thousandths of a token, the store's limit), got %d", int64(MaxCapacity), r.Capacity)
	}
	switch f := r.RefillPerSecond; {
	case math.IsNaN(f) || math.IsInf(f, 0):
		return fe("refill_per_second", "must be a finite number, got %v", f)
	case f == 0:
		return fe("refill_per_second", "required for %s and must be above 0 (a bucket that never refills would block for ever)", a)
	case f < 0:
		return fe("refill_per_second", "must be above 0, got %v", f)
	case f < MinRefillPerSecond:
		return fe("refill_per_second", "must be at least %g (one thousandth of a token per second, the store's unit), got %v", MinRefillPerSecond, f)
	case f > MaxRefillPerSecond:
		return fe("refill_per_second", "must be at most %g, got %v", MaxRefillPerSecond, f)
	}
	if r.Limit != 0 {
		return fe("limit", "not used by %s (it takes capacity and refill_per_second)", a)
	}
	if r.Window != 0 {
		return fe("window", "not used by %s (it takes capacity and refill_per_second)", a)
	}
	return nil
}

func (r *Rule) validateWindow(fe func(string, string, ...any) error) error {
	a := r.Algorithm
	switch {
	case r.Limit == 0:
		return fe("limit", "required for %s (requests per window, at least 1)", a)
	case r.Limit < 0:
		return fe("limit", "must be at least 1, got %d (negative)", r.Limit)
	case r.Limit > MaxLimit:
		return fe("limit", "must be at most %d, got %d", int64(MaxLimit), r.Limit)
	}
	w := time.Duration(r.Window)
	switch {
	case w == 0:
		return fe("window", "required for %s and must be above 0, a duration such as \"1s\", \"1m\", \"1h\"", a)
	case w < MinWindow:
		return fe("window", "must be at least 1ms, got %s", w)
	case w%time.Millisecond != 0:
		return fe("window", "must be a whole number of milliseconds, got %s", w)
	case w > MaxWindow:
		return fe("window", "must be at most %s, got %s", MaxWindow, w)
	case r.Limit > MaxLimitWindowMs/w.Milliseconds():
		return fe("limit", "%d over %s is beyond the store's range (limit x window in ms must be at most 2^52: at most %d for this window)", r.Limit, Duration(w), MaxLimitWindowMs/w.Milliseconds())
	}
	if r.Capacity != 0 {
		return fe("capacity", "not used by %s (it takes limit and window)", a)
	}
	if r.RefillPerSecond != 0 {
		return fe("refill_per_second", "not used by %s (it takes limit and window)", a)
	}
	return nil
}

// validateShares refuses a global rule whose static share in some region
// rounds to nothing in the store's units (a region that could never admit
// anything, and a bucket the store would refuse): each region's share of the
// capacity and refill (in thousandths) or of the limit must be at least 1.
// A global token bucket, fixed window and sliding window are exempt: they
// are coordinated (Coordinated), the store holds their global capacity and
// rate or limit and applies the region's share itself, and a region whose
// share is below one unit is given more by demand (an enforcer run with
// static global shares checks its own share when it loads the rule).
func (r *Rule) validateShares(fe func(string, string, ...any) error) error {
	for _, name := range slices.Sorted(maps.Keys(r.Regions)) {
		f, ok := r.StaticShare(name)
		if !ok {
			continue
		}
		switch r.Algorithm {
		case LeakyBucket:
			if int64(float64(r.Capacity)*1000*f) < 1 {
				return fe("capacity", "region %s's static share (%.3g of %d) is below one thousandth of a token; raise capacity or the region's weight", name, f, r.Capacity)
			}
			if int64(r.RefillPerSecond*1000*f) < 1 {
				return fe("refill_per_second", "region %s's static share (%.3g of %v) is below one thousandth of a token per second; raise refill_per_second or the region's weight", name, f, r.RefillPerSecond)
			}
		case SlidingLog:
			if int64(float64(r.Limit)*f) < 1 {
				return fe("limit", "region %s's static share (%.3g of %d) rounds to 0 requests per window; raise limit or the region's weight", name, f, r.Limit)
			}
		}
	}
	return nil
}

// checkName returns "" when s is 1..max characters of [A-Za-z0-9_.-], and
// otherwise what is wrong with it: the first other character (the whole
// rune, not a byte of it) and its byte offset in s.
func checkName(s string, max int) string {
	if s == "" {
		return "empty"
	}
	if len(s) > max {
		return fmt.Sprintf("%d characters, over the limit of %d", len(s), max)
	}
	for i, c := range s {
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '.' || c == '-' {
			continue
		}
		const only = "use only the ASCII letters, digits, '_', '.' and '-'"
		if c == utf8.RuneError {
			if _, n := utf8.DecodeRuneInString(s[i:]); n == 1 {
				return fmt.Sprintf("%q has the byte 0x%02x, which is not UTF-8, at byte offset %d; %s", s, s[i], i, only)
			}
		}
		return fmt.Sprintf("%q has character %q (%U) at byte offset %d; %s", s, c, c, i, only)
	}
	return ""
}

// CheckFloors refuses a coordinated global rule (Coordinated) in which some
// region can never hold one whole token of the limit (a token bucket's
// capacity, a window's limit): the floors of the other regions (min_share x
// their weight share, never lent) leave it less than one even when it holds
// everything else, and a region holding less than one token admits nothing.
// With a capacity of 1, any min_share above 0 does that to every region:
// the rule admits nothing anywhere. It is a check for new rules: the rule
// store runs it on every put, after Validate, and rlctl rules validate with
// it; rules already stored are not refused when read (Validate does not run
// it): the enforcer loads them and logs a warning naming each.
func (r Rule) CheckFloors() error {
	if !r.Coordinated() || r.MinShare <= 0 {
		return nil
	}
	limit, field := r.Limit, "limit"
	if r.Algorithm == TokenBucket {
		limit, field = r.Capacity, "capacity"
	}
	if limit < 1 {
		return nil
	}
	worst, most, others := "", 0.0, 0.0
	for _, n := range slices.Sorted(maps.Keys(r.Regions)) {
		share, _ := r.StaticShare(n)
		rest := 1 - share // the other regions' weight share
		if best := float64(limit) * (1 - r.MinShare*rest); best < 1-1e-9 && (worst == "" || best < most) {
			worst, most, others = n, best, rest
		}
	}
	if worst == "" {
		return nil
	}
	fix := "use min_share 0"
	if below := (1 - 1/float64(limit)) / others; below > 0 {
		fix = fmt.Sprintf("use a min_share below %.4g (or 0)", below)
	}
	return &FieldError{RuleID: r.ID, Field: "min_share", Msg: fmt.Sprintf(
		"%v leaves region %s at most %.3g of a token of the %s of %d (the other regions' floors, min_share x their weight share, are never lent), and a region holding less than one whole token admits nothing: %s",
		r.MinShare, worst, most, field, limit, fix)}
}
