// Package ratelimitv1 is the generated Go code of ratelimit.proto, the wire
// API of the enforcer (service ratelimit.v1.RateLimiter: CheckLimit and
// CheckLimits). Do not edit the .pb.go files: change ratelimit.proto and run
// `make proto`.
package ratelimitv1
