package client

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// MaxBatch is the most requests the enforcer takes in one CheckLimits call;
// CheckBatch splits longer batches.
const MaxBatch = 1000

// Never is Decision.RetryAfter (and RuleStatus.RetryAfter) when waiting
// cannot help: the cost is above what the rule can ever admit, or the
// region's share of the rule's rate is zero. Retrying the same request never
// passes.
const Never time.Duration = -1

// Defaults.
const (
	DefaultAddress = "127.0.0.1:8081"
	DefaultTimeout = 25 * time.Millisecond
)

// The reconnect schedule of DialOptions.
const (
	reconnectBase   = 100 * time.Millisecond
	reconnectMax    = time.Second
	reconnectJitter = 0.2
	minConnect      = time.Second
)

// DialOptions returns the options a Client dials the enforcer with, besides
// its transport credentials: after a failed connection attempt the next
// comes 100ms later, then 1.6 times later each time, at most 1s later (each
// ±20% jitter), and an attempt may take 1s before it is given up. Use them
// for a connection of your own to the enforcer (the regional/middleware
// client, WithConn), as in
//
//	conn, err := grpc.NewClient(addr, append(client.DialOptions(),
//		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
//
// Without them gRPC's default applies (1s growing to 120s), and calls fail
// at once while it waits: after an outage the connection was remade up to
// two minutes after the enforcer was back, and every check in between was
// answered by the failure policy (with FailOpen: not limited at all). With
// them a connection is remade within about a second of the enforcer
// serving, however long it was down.
func DialOptions() []grpc.DialOption {
	return dialOptions(minConnect)
}

func dialOptions(connectTimeout time.Duration) []grpc.DialOption {
	return []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
		Backoff: backoff.Config{BaseDelay: reconnectBase, Multiplier: backoff.DefaultConfig.Multiplier,
			Jitter: reconnectJitter, MaxDelay: reconnectMax},
		MinConnectTimeout: connectTimeout,
	})}
}

// Errors.
var (
	// ErrInvalidRequest is wrapped by a *RequestError: the enforcer refused
	// the request itself (an empty client key, a negative cost, ...).
	ErrInvalidRequest = errors.New("client: invalid request")
	// ErrUnreachable is wrapped by Decision.Unreachable: the enforcer could
	// not be asked or did not answer within the deadline.
	ErrUnreachable = errors.New("client: enforcer unreachable")
	// ErrClosed is returned by calls on a closed Client.
	ErrClosed = errors.New("client: closed")
)

// RequestError is a request the enforcer refused. Field names the offending
// field as the wire API spells it (client_key, cost, attributes, ...);
// Index is the request's position in a batch (0 for a single Check).
type RequestError struct {
	Index int
	Field string
	Msg   string
}

func (e *RequestError) Error() string {
	return fmt.Sprintf("client: invalid request %d: %s: %s", e.Index, e.Field, e.Msg)
}

// Unwrap makes errors.Is(err, ErrInvalidRequest) true.
func (e *RequestError) Unwrap() error { return ErrInvalidRequest }

// FailurePolicy is what a Client answers when the enforcer cannot be asked.
type FailurePolicy int

const (
	// FailOpen allows the request (the default): a limiter outage never
	// becomes an outage of the service that asks it.
	FailOpen FailurePolicy = iota
	// FailClosed rejects the request: for endpoints where letting abuse
	// through is worse than refusing service (login, signup).
	FailClosed
)

func (p FailurePolicy) String() string {
	switch p {
	case FailOpen:
		return "open"
	case FailClosed:
		return "closed"
	}
	return "FailurePolicy(" + strconv.Itoa(int(p)) + ")"
}

// Request is one check: who (ClientKey), what (Resource), how much (Cost, 0
// means 1) and the attributes rules match on (tier, api_key, ...).
type Request struct {
	ClientKey  string
	Resource   string
	Cost       int64
	Attributes map[string]string
}

// RuleStatus is the outcome of one rule that matched the request. Window
// is the rule's policy window: a window algorithm's window, or for a bucket
// its time to refill from empty.
type RuleStatus struct {
	RuleID     string
	Allowed    bool
	Limit      int64
	Remaining  int64
	RetryAfter time.Duration
	ResetAfter time.Duration
	Shadow     bool
	Window     time.Duration
}

// Decision is the answer to a Request. Limit, Remaining, RetryAfter,
// ResetAfter and Window are those of the binding rule (RuleID, empty when no
// rule matched). RetryAfter is Never when a rejection cannot be cured by
// waiting.
type Decision struct {
	Allowed    bool
	Limit      int64
	Remaining  int64
	RetryAfter time.Duration
	ResetAfter time.Duration
	Window     time.Duration
	RuleID     string
	Statuses   []RuleStatus
	// FailOpen is true when the enforcer answered from its own failure
	// policy because its store was unreachable.
	FailOpen bool
	// Unreachable is non-nil (and wraps ErrUnreachable) when the enforcer
	// could not be asked: Allowed is then this Client's FailurePolicy, and
	// the other fields are zero.
	Unreachable error
}

// Option configures a Client.
type Option func(*config) error

type config struct {
	address  string
	tls      *tls.Config
	timeout  time.Duration
	policy   FailurePolicy
	conn     grpc.ClientConnInterface
	dialOpts []grpc.DialOption
	batchMax int
	batchWin time.Duration
}

// WithAddress sets the enforcer's gRPC address, host:port or any target
// grpc.NewClient accepts ("dns:///ratelimitd.internal:8081"). Default
// "127.0.0.1:8081".
func WithAddress(addr string) Option {
	return func(c *config) error {
		if addr == "" {
			return errors.New("client: empty address")
		}
		c.address = addr
		return nil
	}
}

// WithTLS makes the Client speak TLS with cfg (set RootCAs for a private
// CA, Certificates for mutual TLS). Default: plaintext.
func WithTLS(cfg *tls.Config) Option {
	return func(c *config) error {
		if cfg == nil {
			return errors.New("client: nil TLS config")
		}
		c.tls = cfg
		return nil
	}
}

// WithTimeout bounds every call to the enforcer (a batch is one call);
// past it the failure policy answers. A caller's earlier deadline still
// wins. Default 25ms.
func WithTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("client: timeout must be positive, got %v", d)
		}
		c.timeout = d
		return nil
	}
}

// WithFailurePolicy sets what the Client answers when the enforcer cannot be
// asked (unreachable, too slow, not ready). Default FailOpen.
func WithFailurePolicy(p FailurePolicy) Option {
	return func(c *config) error {
		if p != FailOpen && p != FailClosed {
			return fmt.Errorf("client: unknown failure policy %d", int(p))
		}
		c.policy = p
		return nil
	}
}

// WithBatching coalesces concurrent Check calls into CheckLimits batches: a
// batch leaves when it holds maxSize requests (2 to MaxBatch) or maxWait
// after its first request. It trades up to maxWait of latency for fewer
// calls under load. Default: off (every Check is one CheckLimit call).
func WithBatching(maxSize int, maxWait time.Duration) Option {
	return func(c *config) error {
		if maxSize < 2 || maxSize > MaxBatch {
			return fmt.Errorf("client: batch size must be in [2,%d], got %d", MaxBatch, maxSize)
		}
		if maxWait <= 0 {
			return fmt.Errorf("client: batch wait must be positive, got %v", maxWait)
		}
		c.batchMax, c.batchWin = maxSize, maxWait
		return nil
	}
}

// WithConn uses an existing connection (shared with other clients, or an
// in-memory one in tests) instead of dialing; WithAddress, WithTLS and
// WithDialOptions are then ignored and Close leaves conn open. Default: the
// Client dials its own.
func WithConn(conn grpc.ClientConnInterface) Option {
	return func(c *config) error {
		if conn == nil {
			return errors.New("client: nil connection")
		}
		c.conn = conn
		return nil
	}
}

// WithDialOptions adds options to the Client's own grpc.NewClient call
// (keepalive, interceptors, a stats handler for tracing). They come after
// the Client's own (DialOptions), so a grpc.WithConnectParams here replaces
// its reconnect schedule. Default: none.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(c *config) error {
		c.dialOpts = append(c.dialOpts, opts...)
		return nil
	}
}

// Client asks the enforcer. It is safe for concurrent use.
type Client struct {
	cfg    config
	rl     ratelimitv1.RateLimiterClient
	own    *grpc.ClientConn // the connection the Client dialed (nil with WithConn)
	closed atomic.Bool
	batch  *batcher // nil without WithBatching

	closeOnce sync.Once
	closeErr  error
}

// New returns a Client. It does not connect yet: the connection is made on
// first use and remade after failures, so New succeeds while the enforcer
// is down. The connection it dials uses DialOptions (with a connection
// attempt allowed at least the Client's timeout), so after an outage the
// Client answers from the enforcer again within about a second of it
// serving.
func New(opts ...Option) (*Client, error) {
	cfg := config{address: DefaultAddress, timeout: DefaultTimeout, policy: FailOpen}
	for _, o := range opts {
		if err := o(&cfg); err != nil {
			return nil, err
		}
	}
	c := &Client{cfg: cfg}
	conn := cfg.conn
	if conn == nil {
		creds := insecure.NewCredentials()
		if cfg.tls != nil {
			creds = credentials.NewTLS(cfg.tls)
		}
		dopts := append(dialOptions(max(minConnect, cfg.timeout)), grpc.WithTransportCredentials(creds))
		cc, err := grpc.NewClient(cfg.address, append(dopts, cfg.dialOpts...)...)
		if err != nil {
			return nil, fmt.Errorf("client: %w", err)
		}
		c.own, conn = cc, cc
	}
	c.rl = ratelimitv1.NewRateLimiterClient(conn)
	if cfg.batchMax > 0 {
		c.batch = startBatcher(c)
	}
	return c, nil
}

// Close stops the batcher (waiting checks get ErrClosed) and closes the
// connection the Client dialed. It is safe to call twice.
func (c *Client) Close() error {
	c.closeOnce.Do(func() {
		c.closed.Store(true)
		if c.batch != nil {
			c.batch.close()
		}
		if c.own != nil {
			c.closeErr = c.own.Close()
		}
	})
	return c.closeErr
}

// Check asks the enforcer about one request. The error is non-nil only for a
// request the enforcer refused (a *RequestError), the caller's ctx ending,
// or a closed Client; an enforcer that cannot be asked is answered by the
// failure policy (Decision.Unreachable says so).
func (c *Client) Check(ctx context.Context, req Request) (Decision, error) {
	if c.closed.Load() {
		return Decision{}, ErrClosed
	}
	if c.batch != nil {
		return c.batch.check(ctx, req)
	}
	cctx, cancel := context.WithTimeout(ctx, c.cfg.timeout)
	defer cancel()
	resp, err := c.rl.CheckLimit(cctx, toProto(req))
	if err != nil {
		return c.failed(ctx, err, -1)
	}
	return fromProto(resp), nil
}

// CheckBatch asks about many requests at once (CheckLimits calls of at most
// MaxBatch requests each, sent one after the other, one timeout per call)
// and answers in order.
//
// Every request is checked against the wire API's limits (client key,
// sizes, a negative cost, ...) before any call is made: an invalid one fails
// CheckBatch with a *RequestError whose Index is its position in reqs, and
// nothing is counted. A call the enforcer cannot answer (down, too slow,
// the network) is answered by the failure policy for its requests alone:
// the other calls' answers are the enforcer's, and no error is returned.
// A call that fails otherwise ends CheckBatch with an error: a request only
// the enforcer can refuse (a cost above its --max-cost; it then counts
// nothing of that call) as a *RequestError naming its index in reqs, or
// ctx ending. The decisions of the calls answered before it are returned
// with that error (nil when there are none): those len(decisions) requests,
// reqs[:len(decisions)], were counted; the rest were not asked.
func (c *Client) CheckBatch(ctx context.Context, reqs []Request) ([]Decision, error) {
	if c.closed.Load() {
		return nil, ErrClosed
	}
	for i, r := range reqs {
		if err := validate(r); err != nil {
			err.Index = i
			return nil, err
		}
	}
	var out []Decision
	for start := 0; start < len(reqs); start += MaxBatch {
		chunk := reqs[start:min(start+MaxBatch, len(reqs))]
		ds, err := c.checkLimits(ctx, chunk)
		if err != nil {
			var re *RequestError
			if errors.As(err, &re) {
				re.Index += start
			}
			return out, err
		}
		if out == nil {
			out = make([]Decision, 0, len(reqs))
		}
		out = append(out, ds...)
	}
	if out == nil {
		out = []Decision{}
	}
	return out, nil
}

// checkLimits is one CheckLimits call of at most MaxBatch requests.
func (c *Client) checkLimits(ctx context.Context, reqs []Request) ([]Decision, error) {
	in := &ratelimitv1.CheckLimitsRequest{Requests: make([]*ratelimitv1.CheckLimitRequest, len(reqs))}
	for i, r := range reqs {
		in.Requests[i] = toProto(r)
	}
	cctx, cancel := context.WithTimeout(ctx, c.cfg.timeout)
	defer cancel()
	resp, err := c.rl.CheckLimits(cctx, in)
	if err == nil && len(resp.GetResponses()) != len(reqs) {
		err = status.Errorf(codes.Internal, "CheckLimits answered %d responses for %d requests", len(resp.GetResponses()), len(reqs))
	}
	out := make([]Decision, len(reqs))
	if err != nil {
		d, err := c.failed(ctx, err, 0)
		if err != nil {
			return nil, err
		}
		for i := range out {
			out[i] = d
		}
		return out, nil
	}
	for i, r := range resp.GetResponses() {
		out[i] = fromProto(r)
	}
	return out, nil
}

// failed turns a failed call into the failure policy's Decision, or into
// the error the caller must see: a refused request, or the caller's own
// context ending. index is -1 for a single CheckLimit.
func (c *Client) failed(ctx context.Context, err error, index int) (Decision, error) {
	if ctx.Err() != nil {
		return Decision{}, ctx.Err()
	}
	if st, ok := status.FromError(err); ok && st.Code() == codes.InvalidArgument {
		return Decision{}, invalid(st.Message(), index)
	}
	return c.policy(fmt.Errorf("%w: %v", ErrUnreachable, err)), nil
}

func (c *Client) policy(cause error) Decision {
	return Decision{Allowed: c.cfg.policy == FailOpen, Unreachable: cause}
}

// The enforcer's InvalidArgument messages: "field: message", and in a batch
// "requests[i].field: message".
var batchField = regexp.MustCompile(`^requests\[(\d+)\]\.([^:]+): (.*)$`)

func invalid(msg string, index int) *RequestError {
	if m := batchField.FindStringSubmatch(msg); m != nil {
		i, _ := strconv.Atoi(m[1])
		return &RequestError{Index: i, Field: m[2], Msg: m[3]}
	}
	field, text, ok := strings.Cut(msg, ": ")
	if !ok {
		field, text = "", msg
	}
	return &RequestError{Index: max(index, 0), Field: field, Msg: text}
}

// The wire API's fixed limits on a request (the enforcer's --max-cost is
// its own, and only the enforcer checks it).
const (
	maxClientKeyBytes = 256
	maxFieldBytes     = 1024
	maxAttributes     = 64
)

// validate checks a request against the wire API's fixed limits, with the
// enforcer's field names and messages. The batcher calls it before a
// request joins a batch: the enforcer refuses a whole batch at its first
// invalid request (it validates every request before it checks any, so
// nothing is counted), and a batch coalesces unrelated callers, so a bad
// request is refused here, alone. One the enforcer still refuses (a cost
// above its --max-cost) makes the batcher ask the others again without it.
func validate(r Request) *RequestError {
	switch {
	case r.ClientKey == "":
		return &RequestError{Field: "client_key", Msg: "is required"}
	case len(r.ClientKey) > maxClientKeyBytes:
		return &RequestError{Field: "client_key", Msg: fmt.Sprintf("is %d bytes, the maximum is %d", len(r.ClientKey), maxClientKeyBytes)}
	case !utf8.ValidString(r.ClientKey):
		return &RequestError{Field: "client_key", Msg: "is not valid UTF-8"}
	case len(r.Resource) > maxFieldBytes:
		return &RequestError{Field: "resource", Msg: fmt.Sprintf("is %d bytes, the maximum is %d", len(r.Resource), maxFieldBytes)}
	case !utf8.ValidString(r.Resource):
		return &RequestError{Field: "resource", Msg: "is not valid UTF-8"}
	case r.Cost < 0:
		return &RequestError{Field: "cost", Msg: fmt.Sprintf("must not be negative, got %d", r.Cost)}
	case len(r.Attributes) > maxAttributes:
		return &RequestError{Field: "attributes", Msg: fmt.Sprintf("has %d entries, the maximum is %d", len(r.Attributes), maxAttributes)}
	}
	for k, v := range r.Attributes {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return &RequestError{Field: "attributes", Msg: "contains invalid UTF-8"}
		}
		if len(k) > maxFieldBytes || len(v) > maxFieldBytes {
			return &RequestError{Field: "attributes", Msg: fmt.Sprintf("has an entry longer than %d bytes", maxFieldBytes)}
		}
	}
	return nil
}

func toProto(r Request) *ratelimitv1.CheckLimitRequest {
	return &ratelimitv1.CheckLimitRequest{ClientKey: r.ClientKey, Resource: r.Resource, Cost: r.Cost, Attributes: r.Attributes}
}

func fromProto(r *ratelimitv1.CheckLimitResponse) Decision {
	d := Decision{Allowed: r.GetAllowed(), Limit: r.GetLimit(), Remaining: r.GetRemaining(),
		RetryAfter: ms(r.GetRetryAfterMs()), ResetAfter: ms(r.GetResetAfterMs()), Window: ms(r.GetWindowMs()), RuleID: r.GetRuleId(), FailOpen: r.GetFailOpen()}
	if len(r.GetStatuses()) > 0 {
		d.Statuses = make([]RuleStatus, len(r.GetStatuses()))
		for i, s := range r.GetStatuses() {
			d.Statuses[i] = RuleStatus{RuleID: s.GetRuleId(), Allowed: s.GetAllowed(), Limit: s.GetLimit(), Remaining: s.GetRemaining(),
				RetryAfter: ms(s.GetRetryAfterMs()), ResetAfter: ms(s.GetResetAfterMs()), Shadow: s.GetShadow(), Window: ms(s.GetWindowMs())}
		}
	}
	return d
}

// ms converts a wire duration; a negative one means waiting cannot help.
func ms(v int64) time.Duration {
	if v < 0 {
		return Never
	}
	return time.Duration(v) * time.Millisecond
}

// wireMs is ms backwards: a duration of the wire API, -1 for Never.
func wireMs(d time.Duration) int64 {
	if d < 0 {
		return -1
	}
	return d.Milliseconds()
}

// toWire is d as the enforcer sent it.
func toWire(d Decision) *ratelimitv1.CheckLimitResponse {
	r := &ratelimitv1.CheckLimitResponse{Allowed: d.Allowed, Limit: d.Limit, Remaining: d.Remaining, RetryAfterMs: wireMs(d.RetryAfter),
		ResetAfterMs: wireMs(d.ResetAfter), RuleId: d.RuleID, FailOpen: d.FailOpen, WindowMs: wireMs(d.Window)}
	for _, s := range d.Statuses {
		r.Statuses = append(r.Statuses, &ratelimitv1.RuleStatus{RuleId: s.RuleID, Allowed: s.Allowed, Limit: s.Limit, Remaining: s.Remaining,
			RetryAfterMs: wireMs(s.RetryAfter), ResetAfterMs: wireMs(s.ResetAfter), Shadow: s.Shadow, WindowMs: wireMs(s.Window)})
	}
	return r
}
