package envoy

import (
	"math"
	"time"

	"github.com/apportion/apportion/regional"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/types/known/durationpb"
)

// binding is the status of r's binding rule, or nil when no enforced rule
// bound (no rule matched, or only shadow rules did).
func binding(r regional.Response) *regional.Status {
	if r.RuleID == "" {
		return nil
	}
	for i := range r.Statuses {
		if st := &r.Statuses[i]; st.RuleID == r.RuleID {
			if st.Shadow {
				return nil
			}
			return st
		}
	}
	return nil
}

// descriptorStatus maps one check's answer. A failure-policy answer that
// allows (fail_open) is OK like any other allowed answer.
func descriptorStatus(r regional.Response) *rlsv3.RateLimitResponse_DescriptorStatus {
	st := &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
	if !r.Allowed {
		st.Code = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	b := binding(r)
	if b == nil {
		return st
	}
	st.CurrentLimit = currentLimit(b.RuleID, b.Limit, b.WindowMs)
	st.LimitRemaining = clampUint32(b.Remaining)
	reset := b.ResetAfterMs
	if !r.Allowed && b.RetryAfterMs >= 0 {
		reset = b.RetryAfterMs
	}
	if reset >= 0 {
		st.DurationUntilReset = durationpb.New(time.Duration(reset) * time.Millisecond)
	}
	return st
}

// units are Envoy's units, shortest first, with envoyproxy/ratelimit's
// lengths (a month of 30 days, a year of 365).
var units = [...]struct {
	unit rlsv3.RateLimitResponse_RateLimit_Unit
	d    time.Duration
}{
	{rlsv3.RateLimitResponse_RateLimit_SECOND, time.Second},
	{rlsv3.RateLimitResponse_RateLimit_MINUTE, time.Minute},
	{rlsv3.RateLimitResponse_RateLimit_HOUR, time.Hour},
	{rlsv3.RateLimitResponse_RateLimit_DAY, 24 * time.Hour},
	{rlsv3.RateLimitResponse_RateLimit_WEEK, 7 * 24 * time.Hour},
	{rlsv3.RateLimitResponse_RateLimit_MONTH, 30 * 24 * time.Hour},
	{rlsv3.RateLimitResponse_RateLimit_YEAR, 365 * 24 * time.Hour},
}

// unitOf is the shortest unit at least as long as period (YEAR beyond a year).
func unitOf(period time.Duration) rlsv3.RateLimitResponse_RateLimit_Unit {
	for _, u := range units {
		if period <= u.d {
			return u.unit
		}
	}
	return units[len(units)-1].unit
}

// currentLimit is the rule's limit as Envoy's RateLimit: requests_per_unit
// is the limit in tokens (a window's limit, a bucket's capacity) and unit
// the shortest unit at least as long as the rule's period (the window, or
// the time a bucket takes to refill from empty). Exact for a window of one
// unit (an imported rule: 20 per 1m is 20/MINUTE); otherwise consistent
// with the rule's state: limit_remaining never exceeds requests_per_unit,
// and the rule is full again (remaining back to requests_per_unit) within
// one unit, so duration_until_reset never exceeds it. A token bucket of capacity 3 refilling 1/s (a 3 s
// period) is 3/MINUTE. It is nil when there is no limit to express.
func currentLimit(name string, limit, periodMs int64) *rlsv3.RateLimitResponse_RateLimit {
	if limit <= 0 || periodMs <= 0 {
		return nil
	}
	return &rlsv3.RateLimitResponse_RateLimit{Name: name, RequestsPerUnit: clampUint32(limit),
		Unit: unitOf(time.Duration(periodMs) * time.Millisecond)}
}

func clampUint32(v int64) uint32 {
	return uint32(min(max(v, 0), math.MaxUint32))
}
