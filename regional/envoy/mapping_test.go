package envoy

import (
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
)

func TestCurrentLimit(t *testing.T) {
	const (
		second = rlsv3.RateLimitResponse_RateLimit_SECOND
		minute = rlsv3.RateLimitResponse_RateLimit_MINUTE
		hour   = rlsv3.RateLimitResponse_RateLimit_HOUR
		day    = rlsv3.RateLimitResponse_RateLimit_DAY
		week   = rlsv3.RateLimitResponse_RateLimit_WEEK
		month  = rlsv3.RateLimitResponse_RateLimit_MONTH
		year   = rlsv3.RateLimitResponse_RateLimit_YEAR
	)
	tests := []struct {
		name   string
		limit  int64
		period time.Duration
		n      uint32
		unit   rlsv3.RateLimitResponse_RateLimit_Unit
	}{
		{"fixed window 100 per minute (exact)", 100, time.Minute, 100, minute},
		{"fixed window 10 per second (exact)", 10, time.Second, 10, second},
		{"window 1000 per day (exact)", 1000, 24 * time.Hour, 1000, day},
		{"window 20 per week (exact)", 20, 7 * 24 * time.Hour, 20, week},
		{"window 5 per 30 days (exact month)", 5, 30 * 24 * time.Hour, 5, month},
		{"window 100 per 10s: per minute", 100, 10 * time.Second, 100, minute},
		{"token bucket 3, refill 1/s (3s): 3/MINUTE, never below limit_remaining", 3, 3 * time.Second, 3, minute},
		{"token bucket 20, refill 10/s (2s)", 20, 2 * time.Second, 20, minute},
		{"token bucket 5, refill 5/s (1s)", 5, time.Second, 5, second},
		{"token bucket 1000, refill 1/s (1000s)", 1000, 1000 * time.Second, 1000, hour},
		{"window 1 per 366 days: per year", 1, 366 * 24 * time.Hour, 1, year},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := currentLimit("r", tc.limit, tc.period.Milliseconds())
			if got.GetName() != "r" || got.GetRequestsPerUnit() != tc.n || got.GetUnit() != tc.unit {
				t.Fatalf("currentLimit(%d per %v) = %d/%v, want %d/%v", tc.limit, tc.period, got.GetRequestsPerUnit(), got.GetUnit(), tc.n, tc.unit)
			}
		})
	}
	if got := currentLimit("r", 0, 1000); got != nil {
		t.Errorf("limit 0: %v, want nil", got)
	}
	if got := currentLimit("r", 5, 0); got != nil {
		t.Errorf("period 0: %v, want nil", got)
	}
}
