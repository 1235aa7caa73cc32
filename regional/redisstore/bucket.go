package redisstore

import (
	"errors"
	"fmt"
	"time"

	"github.com/apportion/apportion/rules"
)

// Bucket is one matched rule's bucket for one request.
type Bucket struct {
	Key       string          // full Redis key, from Key()
	Algorithm rules.Algorithm // rules.TokenBucket, SlidingWindow, FixedWindow, SlidingLog, LeakyBucket
	Capacity  int64           // token_bucket, leaky_bucket: capacity in thousandths of a token
	Rate      int64           // token_bucket, leaky_bucket: refill (leak) rate in thousandths of a token per second
	Limit     int64           // window algorithms: tokens per window (whole tokens)
	Window    time.Duration   // window algorithms (whole milliseconds; at least 1 ms)
	Shadow    bool            // a shadow bucket never rejects the request; it consumes only when it itself would allow
	Global    *Global         // nil for regional buckets; only for token_bucket (Capacity and Rate are then the global ones), fixed_window and sliding_window (Limit is then the global one)
}

// Result is one bucket's answer. All durations are in milliseconds measured
// from the evaluation time (Redis TIME, or the WithClock time); when the
// clock has stepped back behind a bucket's stored time, from the bucket's
// stored time (the clamp).
type Result struct {
	Allowed      bool  // this bucket's own verdict (for shadow: the would-be verdict)
	Limit        int64 // whole tokens (capacity/1000 or Limit)
	Remaining    int64 // whole tokens left after this request (floor), never negative
	RetryAfterMs int64 // when rejected: ms until cost tokens would be available; leaky_bucket when allowed: the delay the caller should wait before proceeding (meter)
	ResetAfterMs int64 // ms until the bucket is full again / the window resets
}

// Never is the RetryAfterMs (or ResetAfterMs) of a bucket that cannot reach
// the state asked for without a configuration change: cost above the
// bucket's capacity or limit, or a share whose rate is zero.
const Never int64 = -1

// Limits on bucket parameters. They keep every intermediate value of the
// script's arithmetic below 2^53, where Lua's doubles are exact integers.
const (
	MaxCapacity = int64(1) << 38 // thousandths of a token (about 2.7e8 tokens)
	MaxRate     = int64(1) << 40 // thousandths of a token per second
	MaxCost     = int64(1) << 32 // whole tokens per request
	MaxLimit    = int64(1) << 40 // whole tokens per window
	// MaxLimitWindow bounds Limit x Window (in ms) for the window algorithms.
	MaxLimitWindow = int64(1) << 52
	// MaxVersion bounds a share's version; MaxTime bounds the clock (ms
	// since the Unix epoch; the year 10889). Stored state is 6-byte integers.
	MaxVersion = int64(1)<<48 - 1
	MaxTime    = int64(1)<<48 - 1
)

// Errors.
var (
	ErrInvalidBucket = errors.New("redisstore: invalid bucket")
	ErrInvalidCost   = errors.New("redisstore: invalid cost")
	ErrInvalidShare  = errors.New("redisstore: invalid share")
	ErrClosed        = errors.New("redisstore: store closed")
	ErrBadReply      = errors.New("redisstore: unexpected script reply")
	ErrClock         = errors.New("redisstore: clock out of range")
	// ErrQueueTimeout: the call waited for a worker past its budget and
	// was not sent; the process is overloaded, Redis may be fine.
	ErrQueueTimeout = errors.New("redisstore: queued past the budget, not sent")
	// ErrTimeout: Redis did not answer within the round-trip budget.
	ErrTimeout = errors.New("redisstore: redis round trip past the budget")
)

// Algorithm codes passed to the script.
const (
	algTokenBucket   = 1
	algSlidingWindow = 2
	algFixedWindow   = 3
	algSlidingLog    = 4
	algLeakyBucket   = 5
	// algGlobalTokenBucket is a token bucket with Global set (script only).
	algGlobalTokenBucket = 6
)

func algCode(a rules.Algorithm) int64 {
	switch a {
	case rules.TokenBucket:
		return algTokenBucket
	case rules.SlidingWindow:
		return algSlidingWindow
	case rules.FixedWindow:
		return algFixedWindow
	case rules.SlidingLog:
		return algSlidingLog
	case rules.LeakyBucket:
		return algLeakyBucket
	}
	return 0
}

// ValidateBucket reports whether the store can hold b (its key aside): an
// enforcer checks each rule's bucket once, when it loads the rule, so that a
// rule the store would refuse is answered on its own and never sent.
func ValidateBucket(b Bucket) error {
	if b.Key == "" {
		b.Key = "k"
	}
	return validate(1, []Bucket{b})
}

// validate checks a request's cost and buckets against the limits above and
// refuses a key that appears twice (one script evaluates all buckets from
// one snapshot, so two views of one key would disagree).
func validate(cost int64, buckets []Bucket) error {
	if cost < 1 || cost > MaxCost {
		return fmt.Errorf("%w: cost %d must be in [1, %d]", ErrInvalidCost, cost, MaxCost)
	}
	for i, b := range buckets {
		if b.Key == "" {
			return fmt.Errorf("%w: buckets[%d].Key is empty", ErrInvalidBucket, i)
		}
		switch algCode(b.Algorithm) {
		case algTokenBucket, algLeakyBucket:
			if b.Capacity < 1 || b.Capacity > MaxCapacity {
				return fmt.Errorf("%w: buckets[%d].Capacity %d must be in [1, %d] thousandths", ErrInvalidBucket, i, b.Capacity, MaxCapacity)
			}
			if b.Rate < 1 || b.Rate > MaxRate {
				return fmt.Errorf("%w: buckets[%d].Rate %d must be in [1, %d] thousandths per second", ErrInvalidBucket, i, b.Rate, MaxRate)
			}
		case algSlidingWindow, algFixedWindow, algSlidingLog:
			w := b.Window.Milliseconds()
			if w < 1 || time.Duration(w)*time.Millisecond != b.Window {
				return fmt.Errorf("%w: buckets[%d].Window %v must be a whole number of milliseconds, at least 1ms", ErrInvalidBucket, i, b.Window)
			}
			if b.Limit < 1 || b.Limit > MaxLimit || b.Limit > MaxLimitWindow/w {
				return fmt.Errorf("%w: buckets[%d].Limit %d must be in [1, 2^40] and Limit x Window(ms) at most 2^52", ErrInvalidBucket, i, b.Limit)
			}
		default:
			return fmt.Errorf("%w: buckets[%d].Algorithm %q: %w", ErrInvalidBucket, i, b.Algorithm, rules.ErrUnknownAlgorithm)
		}
		if err := validateGlobal(i, b); err != nil {
			return err
		}
		for j := 0; j < i; j++ {
			if buckets[j].Key == b.Key {
				return fmt.Errorf("%w: buckets[%d].Key %q repeats buckets[%d].Key", ErrInvalidBucket, i, b.Key, j)
			}
		}
	}
	return nil
}
