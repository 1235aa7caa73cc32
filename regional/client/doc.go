// Package client is the Go client of the apportion enforcer
// (ratelimit.v1.RateLimiter over gRPC), for services written in Go that ask
// the limiter before doing work, and the gRPC server interceptors that do
// so before every call of a Go gRPC service.
//
// A Client is built with functional options: the enforcer's address
// (WithAddress), TLS (WithTLS), a deadline for every call (WithTimeout), what
// to answer when the enforcer cannot be asked (WithFailurePolicy: open by
// default) and coalescing of concurrent checks into CheckLimits batches
// (WithBatching). Check and CheckBatch return concrete Decision values.
//
// The Client dials with DialOptions: a reconnect backoff bounded at 1s
// instead of gRPC's default (growing to 120s, calls failing at once
// meanwhile), so after an outage it answers from the enforcer again within
// about a second of the enforcer serving. A connection of your own to the
// enforcer (WithConn, the HTTP middleware's) should be dialed with them too.
//
// The server interceptors send the rate-limit headers of the enforcer's
// HTTP API (regional/header) as header metadata.
//
// Invariants:
//   - The enforcer being unreachable, slow or not ready never turns into an
//     error for the caller: the Client answers from its failure policy
//     (allow by default, deny with FailClosed) and says so in
//     Decision.Unreachable. Only a bad request (ErrInvalidRequest, naming the
//     field) and the caller's own context ending are errors.
//   - CheckBatch validates every request before it sends any: a batch with
//     an invalid request counts nothing.
//   - With batching on, one request never affects another in the same
//     batch: a request the enforcer refuses as invalid fails alone, and the
//     rest of the batch is asked again without it.
//   - Every goroutine a Client starts is stopped by Close.
package client
