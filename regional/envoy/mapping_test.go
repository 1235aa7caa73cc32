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
	)
	ms := func(d time.Duration) int64 { return d.Milliseconds() }
	tests := []struct {
		name   string
		limit  int64
		period time.Duration
		n      uint32
		unit   rlsv3.RateLimitResponse_RateLimit_Unit
	}{
		{"fixed window 100 per minute", 100, time.Minute, 100, minute},
		{"fixed window 10 per second", 10, time.Second, 10, second},
		{"window 1000 per day", 1000, 24 * time.Hour, 1000, day},
		{"window 100 per 10s", 100, 10 * time.Second, 600, minute},
		{"window 100 per 5s", 100, 5 * time.Second, 20, second},
		{"token bucket 20, refill 10/s (2s)", 20, 2 * time.Second, 10, second},
		{"token bucket 5, refill 0.5/s (10s)", 5, 10 * time.Second, 30, minute},
		{"token bucket 1000, refill 1/s (1000s)", 1000, 1000 * time.Second, 3600, hour},
		{"token bucket 7, refill 3/s (2333ms)", 7, 2333 * time.Millisecond, 3, second},
		{"window 2 per 2h", 2, 2 * time.Hour, 1, hour},
		{"slow: 1 per 10 days rounds up to 1/DAY", 1, 240 * time.Hour, 1, day},
		{"1 per 20s: nearer a minute", 1, 20 * time.Second, 3, minute},
		{"1 per 7s rounds to 0/SECOND: next unit", 1, 7 * time.Second, 9, minute},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := currentLimit("r", tc.limit, ms(tc.period))
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
