// Package backend holds what ratelimitd and syncagent share about reaching
// their backends: the command-line flags for Redis, etcd and NATS and for
// logging (each flag also read from APPORTION_* by internal/flagenv), and
// the clients built from them, so both daemons name, secure and time out
// their connections the same way.
package backend

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/apportion/apportion/internal/tlsconfig"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
)

// Redis is how to reach the region's Redis.
type Redis struct {
	Addr, Password string
	TLS            bool
	CA, Cert, Key  string
	// SentinelAddrs (comma-separated) and MasterName select a primary
	// found through Redis Sentinel instead of Addr.
	SentinelAddrs, MasterName string
}

// Register defines --redis-addr, --redis-password, --redis-tls, --redis-ca,
// --redis-cert, --redis-key, --redis-sentinel-addrs and --redis-master-name
// on fs.
func (r *Redis) Register(fs *flag.FlagSet) {
	fs.StringVar(&r.Addr, "redis-addr", "127.0.0.1:6379", "the region's Redis: HOST:PORT, or unix:///PATH for its Unix socket; several comma-separated HOST:PORT mean Redis Cluster")
	fs.StringVar(&r.SentinelAddrs, "redis-sentinel-addrs", "", "comma-separated HOST:PORT of Redis Sentinels to ask for the primary of --redis-master-name (replaces --redis-addr)")
	fs.StringVar(&r.MasterName, "redis-master-name", "", "the name Sentinel monitors the region's primary under (with --redis-sentinel-addrs)")
	fs.StringVar(&r.Password, "redis-password", "", "Redis password (prefer APPORTION_REDIS_PASSWORD)")
	fs.BoolVar(&r.TLS, "redis-tls", false, "connect to Redis over TLS (implied by --redis-ca / --redis-cert)")
	fs.StringVar(&r.CA, "redis-ca", "", "PEM file of the CA that signed Redis's certificate (default: the system roots)")
	fs.StringVar(&r.Cert, "redis-cert", "", "client certificate for Redis (mutual TLS, with --redis-key)")
	fs.StringVar(&r.Key, "redis-key", "", "client key for Redis")
}

// Validate checks the Redis flags: Sentinel needs both its addresses and
// the master name; every address is HOST:PORT with a port from 1 to 65535
// (no blank entry in a comma-separated list), or --redis-addr is one
// unix:///PATH. An address go-redis cannot dial would otherwise be found
// only when each check is answered by the failure policy.
func (r *Redis) Validate() error {
	switch {
	case r.MasterName != "" && strings.TrimSpace(r.SentinelAddrs) == "":
		return errors.New("--redis-master-name needs --redis-sentinel-addrs")
	case strings.TrimSpace(r.SentinelAddrs) != "" && r.MasterName == "":
		return errors.New("--redis-sentinel-addrs needs --redis-master-name")
	}
	if r.MasterName != "" {
		// The Sentinels replace --redis-addr.
		return checkAddrs("--redis-sentinel-addrs", "HOST:PORT", r.SentinelAddrs)
	}
	path, unix := r.socket()
	if !unix {
		return checkAddrs("--redis-addr", "HOST:PORT or unix:///PATH", r.Addr)
	}
	switch {
	case path == "":
		return errors.New("--redis-addr: unix:// needs the socket's path, as in unix:///run/redis/redis.sock")
	case strings.Contains(r.Addr, ","):
		return fmt.Errorf("--redis-addr: a Unix socket is one standalone Redis, not a Cluster: %q", r.Addr)
	case r.TLS || r.CA != "" || r.Cert != "":
		return errors.New("--redis-addr: TLS is for TCP, not a Unix socket (drop --redis-tls, --redis-ca and --redis-cert)")
	}
	return nil
}

// checkAddrs checks that every entry of the comma-separated list, the value
// of flag, is HOST:PORT (want says what the flag takes).
func checkAddrs(flag, want, list string) error {
	for _, a := range splitAddrs(list) {
		if a == "" {
			return fmt.Errorf("%s: want %s, got a blank entry in %q", flag, want, list)
		}
		_, port, err := net.SplitHostPort(a)
		if err != nil {
			var ae *net.AddrError
			if errors.As(err, &ae) {
				err = errors.New(ae.Err)
			}
			return fmt.Errorf("%s: want %s, got %q: %w", flag, want, a, err)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("%s: want %s, got %q: the port must be a number from 1 to 65535", flag, want, a)
		}
	}
	return nil
}

// splitAddrs splits a comma-separated address list, blanks trimmed (a
// blank entry stays, empty, for checkAddrs to refuse).
func splitAddrs(list string) []string {
	out := strings.Split(list, ",")
	for i, a := range out {
		out[i] = strings.TrimSpace(a)
	}
	return out
}

// socket returns the path of a Unix socket address, unix:///PATH.
func (r *Redis) socket() (string, bool) {
	path, ok := strings.CutPrefix(strings.TrimSpace(r.Addr), "unix://")
	return path, ok
}

// Options returns go-redis options: 1 s dial, read and write timeouts (a
// call's context deadline, when sooner, bounds it: ContextTimeoutEnabled)
// and no client retries (a retried script call whose reply was lost would
// run twice). Without retries a command sent into a connection Redis has
// closed (its idle timeout, a restart) fails: go-redis's pool finds such a
// connection before use by peeking at its socket, which it can only do
// when the connection is a syscall.Conn, as the dialers here return it (a
// wrapping Dialer must keep it one: redisstore.Activity's does). One
// address is a standalone server, several a Cluster; with
// --redis-sentinel-addrs the addresses are Sentinels and go-redis's
// NewUniversalClient builds a failover client that follows the primary of
// --redis-master-name (same timeouts, TLS and password, for the Sentinels
// too except the password: Sentinels are asked without one). An address
// unix:///PATH is a standalone Redis on its Unix socket: the options' Dialer
// dials PATH (go-redis's universal options have no network type).
func (r *Redis) Options() (*redis.UniversalOptions, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	addrs := splitAddrs(r.Addr)
	var dialer func(ctx context.Context, network, addr string) (net.Conn, error)
	if path, unix := r.socket(); unix && r.MasterName == "" {
		addrs = []string{path}
		d := net.Dialer{Timeout: time.Second}
		dialer = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", path)
		}
	}
	if r.MasterName != "" {
		addrs = splitAddrs(r.SentinelAddrs)
	}
	o := &redis.UniversalOptions{
		Addrs:        addrs,
		MasterName:   r.MasterName,
		Password:     r.Password,
		DialTimeout:  time.Second,
		ReadTimeout:  time.Second,
		WriteTimeout: time.Second,
		MaxRetries:   -1,
		Dialer:       dialer,
		// A call's context deadline bounds its wait for the reply (go-redis
		// otherwise waits out ReadTimeout whatever the context says): the
		// enforcer's --timeout, the agent's StoreTimeout, which the ledger's
		// lease arithmetic takes as the bound of a store write (a marker
		// write took 2.46 s against a 200 ms StoreTimeout without it).
		ContextTimeoutEnabled: true,
	}
	if r.TLS || r.CA != "" || r.Cert != "" {
		tc, err := tlsconfig.Client(r.CA, r.Cert, r.Key)
		if err != nil {
			return nil, fmt.Errorf("--redis-ca/--redis-cert/--redis-key: %w", err)
		}
		o.TLSConfig = tc
	}
	return o, nil
}

// redisLogs are the loggers InstallRedisLogger installed and that are still
// in use, the newest last: go-redis has one logger per process.
var redisLogs struct {
	once sync.Once
	mu   sync.Mutex
	logs []*slog.Logger
}

// InstallRedisLogger routes go-redis's own messages (its pool's "failed to
// dial" while Redis is down, a Sentinel that does not answer, ...), which
// go-redis otherwise writes as raw "redis: ..." lines to the process's
// stderr, hundreds a second during an outage and past --log-format json,
// to log at Debug: the daemons log and rate-limit their store errors
// themselves. go-redis's logger is the process's: while several daemons
// run in one process (rlstack, tests) the one installed last gets them.
// The returned func uninstalls log (call it when the daemon stops): the
// messages go to the previous one still installed, or nowhere.
func InstallRedisLogger(log *slog.Logger) (uninstall func()) {
	redisLogs.once.Do(func() { redis.SetLogger(installedRedisLog{}) })
	redisLogs.mu.Lock()
	redisLogs.logs = append(redisLogs.logs, log)
	redisLogs.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			redisLogs.mu.Lock()
			defer redisLogs.mu.Unlock()
			for i := len(redisLogs.logs) - 1; i >= 0; i-- {
				if redisLogs.logs[i] == log {
					redisLogs.logs = append(redisLogs.logs[:i], redisLogs.logs[i+1:]...)
					break
				}
			}
		})
	}
}

// installedRedisLog is go-redis's logger once InstallRedisLogger ran.
type installedRedisLog struct{}

func (installedRedisLog) Printf(ctx context.Context, format string, v ...any) {
	redisLogs.mu.Lock()
	var log *slog.Logger
	if n := len(redisLogs.logs); n > 0 {
		log = redisLogs.logs[n-1]
	}
	redisLogs.mu.Unlock()
	if log != nil {
		redisLogger{log}.Printf(ctx, format, v...)
	}
}

// redisLogger is go-redis's Logging interface over a slog.Logger: each
// message one record at Debug.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	if ctx == nil {
		ctx = context.Background()
	}
	if !l.log.Enabled(ctx, slog.LevelDebug) {
		return // no formatting while debug is off
	}
	l.log.DebugContext(ctx, strings.TrimSpace(fmt.Sprintf(format, v...)))
}

// Etcd is how to reach etcd.
type Etcd struct {
	Endpoints, Prefix  string
	Username, Password string
	CA, Cert, Key      string
}

// Register defines --etcd-endpoints, --etcd-prefix, --etcd-username,
// --etcd-password, --etcd-ca, --etcd-cert and --etcd-key on fs.
func (e *Etcd) Register(fs *flag.FlagSet, endpointsHelp string) {
	fs.StringVar(&e.Endpoints, "etcd-endpoints", "", endpointsHelp)
	fs.StringVar(&e.Prefix, "etcd-prefix", "/ratelimit/rules/", "etcd key prefix of the rules")
	fs.StringVar(&e.Username, "etcd-username", "", "etcd user name")
	fs.StringVar(&e.Password, "etcd-password", "", "etcd password (prefer APPORTION_ETCD_PASSWORD)")
	fs.StringVar(&e.CA, "etcd-ca", "", "PEM file of the CA that signed etcd's certificate (TLS to etcd)")
	fs.StringVar(&e.Cert, "etcd-cert", "", "client certificate for etcd (mutual TLS, with --etcd-key)")
	fs.StringVar(&e.Key, "etcd-key", "", "client key for etcd")
}

// EndpointList returns --etcd-endpoints split at commas, blanks trimmed.
func (e *Etcd) EndpointList() []string {
	var out []string
	for _, ep := range strings.Split(e.Endpoints, ",") {
		if ep = strings.TrimSpace(ep); ep != "" {
			out = append(out, ep)
		}
	}
	return out
}

// Validate checks the combinations of the etcd flags: a password needs a
// user name, a client certificate its key, and TLS files https://
// endpoints (etcd's client talks plaintext to an http:// endpoint whatever
// the TLS configuration, so the files would be silently ignored).
func (e *Etcd) Validate() error {
	switch {
	case e.Password != "" && e.Username == "":
		return errors.New("--etcd-password needs --etcd-username")
	case (e.Cert == "") != (e.Key == ""):
		return errors.New("give --etcd-cert and --etcd-key together")
	}
	if e.CA != "" || e.Cert != "" {
		for _, ep := range e.EndpointList() {
			if strings.HasPrefix(ep, "http://") {
				return fmt.Errorf("--etcd-ca, --etcd-cert and --etcd-key need https:// endpoints, got %s", ep)
			}
		}
	}
	return nil
}

// EtcdReconnectMaxDelay caps the wait between two attempts to reconnect to
// etcd (gRPC's default grows to 120 s, so the first request after an outage
// could wait many seconds for the next attempt).
const EtcdReconnectMaxDelay = time.Second

// Config returns the etcd client configuration; TLS is on with --etcd-ca,
// --etcd-cert or https:// endpoints. The client retries a lost connection
// at least every EtcdReconnectMaxDelay, each attempt bounded by
// dialTimeout, so it is back within about a second of etcd; while a watch
// is open it pings every 10 s and drops a connection unanswered for 5 s, so
// a peer that vanished without closing (half-open) is noticed too. It
// fails as Validate does.
func (e *Etcd) Config(dialTimeout time.Duration) (clientv3.Config, error) {
	c := clientv3.Config{
		Endpoints:   e.EndpointList(),
		Username:    e.Username,
		Password:    e.Password,
		DialTimeout: dialTimeout,
		// etcd's server accepts pings every 5 s or slower by default.
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 5 * time.Second,
		Logger:               zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: EtcdReconnectMaxDelay},
			MinConnectTimeout: dialTimeout,
		})},
	}
	if err := e.Validate(); err != nil {
		return c, err
	}
	if e.CA != "" || e.Cert != "" || strings.Contains(e.Endpoints, "https://") {
		tc, err := tlsconfig.Client(e.CA, e.Cert, e.Key)
		if err != nil {
			return c, fmt.Errorf("--etcd-ca/--etcd-cert/--etcd-key: %w", err)
		}
		c.TLS = tc
	}
	return c, nil
}

// NATS is how to reach the region's NATS server.
type NATS struct {
	URL, Creds, CA string
	// Nkey is a file holding an NKey user seed to authenticate with.
	Nkey string
}

// Register defines --nats-url (with the given default and help), --nats-creds
// and --nats-ca on fs.
func (n *NATS) Register(fs *flag.FlagSet, defaultURL, urlHelp string) {
	fs.StringVar(&n.URL, "nats-url", defaultURL, urlHelp)
	fs.StringVar(&n.Creds, "nats-creds", "", "NATS credentials file (JWT and NKey seed)")
	fs.StringVar(&n.CA, "nats-ca", "", "PEM file of the CA that signed the NATS server's certificate")
	fs.StringVar(&n.Nkey, "nats-nkey", "", "file holding an NKey user seed (SU...) to authenticate to NATS with (a syncagent can use its --report-seed-file)")
}

// Connect connects as name; it keeps reconnecting forever, also when the
// server is not up yet.
func (n *NATS) Connect(name string) (*nats.Conn, error) {
	opts := []nats.Option{nats.Name(name), nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true), nats.ReconnectWait(250 * time.Millisecond)}
	if n.Creds != "" {
		opts = append(opts, nats.UserCredentials(n.Creds))
	}
	if n.CA != "" {
		opts = append(opts, nats.RootCAs(n.CA))
	}
	if n.Nkey != "" {
		o, err := nats.NkeyOptionFromSeed(n.Nkey)
		if err != nil {
			return nil, fmt.Errorf("--nats-nkey: %w", err)
		}
		opts = append(opts, o)
	}
	nc, err := nats.Connect(n.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("nats: %w", err)
	}
	return nc, nil
}

// Log is the logging configuration.
type Log struct {
	Level, Format string
}

// Register defines --log-level and --log-format on fs.
func (l *Log) Register(fs *flag.FlagSet) {
	fs.StringVar(&l.Level, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&l.Format, "log-format", "text", "text or json")
}

// New returns a structured logger writing to w.
func (l *Log) New(w io.Writer) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(l.Level)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	ho := &slog.HandlerOptions{Level: lv}
	switch l.Format {
	case "text":
		return slog.New(slog.NewTextHandler(w, ho)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, ho)), nil
	}
	return nil, fmt.Errorf("--log-format: want text or json, got %q", l.Format)
}
