// Package middleware is the Go HTTP middleware for gateways written in Go:
// before a request reaches the handler it asks the region's enforcer
// (ratelimit.v1.RateLimiter/CheckLimit) and answers 429 Too Many Requests
// itself when the request is over a limit, with the same headers as the
// enforcer's HTTP API and the Envoy service (X-RateLimit-*, the IETF
// RateLimit-Policy and RateLimit fields, Retry-After: regional/header writes
// them all). A request whose cost is above what a rule can ever admit is
// answered 413 with a body saying so and no Retry-After: retrying cannot help.
//
// Invariant: the enforcer being unreachable never turns into an outage of
// the wrapped handler unless the caller asks for it (WithFailClosed): by
// default a failed or timed-out check lets the request through. A check
// the enforcer refuses as invalid is not such a failure: the client could
// choose it (an empty, over-long or non-UTF-8 key, a negative or huge
// cost) to go unlimited. The key, resource and attributes are fitted first
// (an empty key is the remote IP, an over-long or invalid value its hashed
// form: client.FitKey), and a check still refused answers the request 400,
// or 413 for a cost above the enforcer's maximum.
package middleware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/client"
	"github.com/apportion/apportion/regional/header"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Checker is the part of the generated RateLimiter client the middleware uses.
type Checker interface {
	CheckLimit(ctx context.Context, in *ratelimitv1.CheckLimitRequest, opts ...grpc.CallOption) (*ratelimitv1.CheckLimitResponse, error)
}

// Option configures the middleware.
type Option func(*config) error

type config struct {
	key        func(*http.Request) string
	resource   func(*http.Request) string
	attributes func(*http.Request) map[string]string
	cost       func(*http.Request) int64
	timeout    time.Duration
	failClosed bool
	log        *slog.Logger
}

// WithKey sets how a request names its client. Default: the remote IP.
func WithKey(f func(*http.Request) string) Option {
	return func(c *config) error {
		if f == nil {
			return errors.New("middleware: nil key function")
		}
		c.key = f
		return nil
	}
}

// WithResource sets the resource of a request. Default: "METHOD /path".
func WithResource(f func(*http.Request) string) Option {
	return func(c *config) error {
		if f == nil {
			return errors.New("middleware: nil resource function")
		}
		c.resource = f
		return nil
	}
}

// WithAttributes sets the attributes used by rule matching (tier, api_key,
// ...). Default: none.
func WithAttributes(f func(*http.Request) map[string]string) Option {
	return func(c *config) error { c.attributes = f; return nil }
}

// WithCost sets the cost of a request in tokens. Default: 1.
func WithCost(f func(*http.Request) int64) Option {
	return func(c *config) error { c.cost = f; return nil }
}

// WithTimeout bounds each check. Default: 25ms.
func WithTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("middleware: timeout must be positive, got %v", d)
		}
		c.timeout = d
		return nil
	}
}

// WithFailClosed answers 503 when the enforcer cannot be asked. Default:
// off (fail open: the request goes through).
func WithFailClosed() Option {
	return func(c *config) error { c.failClosed = true; return nil }
}

// WithLogger sets the logger for failed checks. Default: slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error { c.log = l; return nil }
}

func remoteIP(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// New returns middleware that checks every request with c before next.
func New(c Checker, opts ...Option) (func(http.Handler) http.Handler, error) {
	if c == nil {
		return nil, errors.New("middleware: nil checker")
	}
	cfg := &config{
		key:      remoteIP,
		resource: func(r *http.Request) string { return r.Method + " " + r.URL.Path },
		timeout:  25 * time.Millisecond,
		log:      slog.Default(),
	}
	for _, o := range opts {
		if err := o(cfg); err != nil {
			return nil, err
		}
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// The key, resource and attributes may come from the client
			// (a header, the path): an empty key is the remote IP, an
			// over-long or invalid one its hashed form (client.FitKey), so
			// that no client can make the enforcer refuse the check and
			// so go unlimited.
			key := cfg.key(r)
			if key == "" {
				key = remoteIP(r)
			}
			req := &ratelimitv1.CheckLimitRequest{ClientKey: client.FitKey(key), Resource: client.FitField(cfg.resource(r))}
			if cfg.attributes != nil {
				req.Attributes = client.FitAttributes(cfg.attributes(r))
			}
			if cfg.cost != nil {
				req.Cost = cfg.cost(r)
			}
			ctx, cancel := context.WithTimeout(r.Context(), cfg.timeout)
			resp, err := c.CheckLimit(ctx, req)
			cancel()
			if st, ok := status.FromError(err); ok && st.Code() == codes.InvalidArgument {
				// Refused by the enforcer (a negative cost, one above its
				// --max-cost, too many attributes): the request is refused
				// too, never let through as if the enforcer were down.
				cfg.log.Warn("rate-limit check refused as invalid", "error", st.Message())
				code := http.StatusBadRequest
				if strings.HasPrefix(st.Message(), "cost: ") && strings.Contains(st.Message(), "above") {
					code = http.StatusRequestEntityTooLarge
				}
				http.Error(w, "rate limit: "+st.Message(), code)
				return
			}
			if err != nil {
				cfg.log.Warn("rate-limit check failed", "error", err, "fail_closed", cfg.failClosed)
				if cfg.failClosed {
					http.Error(w, "rate limiter unavailable", http.StatusServiceUnavailable)
					return
				}
				next.ServeHTTP(w, r)
				return
			}
			a := header.FromProto(resp, req.Cost)
			header.Set(w.Header(), a)
			if code, reason := header.Status(a); code != http.StatusOK {
				http.Error(w, reason, code)
				return
			}
			next.ServeHTTP(w, r)
		})
	}, nil
}

// SetHeaders writes the rate-limit headers of a CheckLimit answer to a
// request of cost tokens, as the enforcer's HTTP API does (see
// regional/header.Fields): X-RateLimit-Limit, -Remaining and -Reset,
// RateLimit-Policy, RateLimit and, on a rejection that waiting can help,
// Retry-After. It writes nothing when no enforced rule bound the request.
func SetHeaders(h http.Header, resp *ratelimitv1.CheckLimitResponse, cost int64) {
	header.Set(h, header.FromProto(resp, cost))
}
