// Package serve holds what the daemons share about the ports they serve:
// the command-line flags for server TLS (certificate, key, client CA for
// mutual TLS; ratelimitd's ports) and for HTTP timeouts (every HTTP server
// of ratelimitd and syncagent), and the HTTP server built from them, so
// every port is secured and timed out the same way.
//
// Invariant: every HTTP server built here has read-header, read, write and
// idle timeouts, so a client that sends its request slowly, never reads its
// answer, or idles on a keep-alive connection is cut off and holds no
// goroutine for longer than those bounds.
package serve

import (
	"crypto/tls"
	"errors"
	"flag"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/apportion/apportion/internal/tlsconfig"
)

// Defaults of the HTTP timeouts.
const (
	DefaultReadHeaderTimeout = 5 * time.Second
	DefaultReadTimeout       = 10 * time.Second
	DefaultWriteTimeout      = 30 * time.Second
	DefaultIdleTimeout       = 2 * time.Minute
)

// TLS is the server TLS configuration of a daemon's ports.
type TLS struct {
	Cert, Key, ClientCA string
}

// Register defines --tls-cert, --tls-key and --tls-client-ca on fs; ports
// names what they secure, e.g. "gRPC, HTTP and the admin API".
func (t *TLS) Register(fs *flag.FlagSet, ports string) {
	fs.StringVar(&t.Cert, "tls-cert", "", "TLS certificate file (PEM) for "+ports+", with --tls-key; reloaded when the file changes")
	fs.StringVar(&t.Key, "tls-key", "", "TLS key file (PEM) for "+ports)
	fs.StringVar(&t.ClientCA, "tls-client-ca", "", "PEM file of the CA that signs client certificates: with it, "+ports+" serve only clients with such a certificate (mutual TLS); reloaded when the file changes")
}

// Validate checks that the flags go together.
func (t *TLS) Validate() error {
	switch {
	case (t.Cert == "") != (t.Key == ""):
		return errors.New("--tls-cert and --tls-key go together")
	case t.ClientCA != "" && t.Cert == "":
		return errors.New("--tls-client-ca needs --tls-cert and --tls-key: client certificates are checked in a TLS handshake")
	}
	return nil
}

// Server returns the reloading TLS server, or nil when TLS is off.
func (t *TLS) Server(log *slog.Logger) (*tlsconfig.Server, error) {
	if err := t.Validate(); err != nil {
		return nil, err
	}
	if t.Cert == "" {
		return nil, nil
	}
	opts := []tlsconfig.ServerOption{tlsconfig.WithLogger(log)}
	if t.ClientCA != "" {
		opts = append(opts, tlsconfig.WithClientCA(t.ClientCA))
	}
	return tlsconfig.NewServer(t.Cert, t.Key, opts...)
}

// Timeouts are the HTTP servers' timeouts.
type Timeouts struct {
	ReadHeader, Read, Write, Idle time.Duration
}

// DefaultTimeouts returns the defaults.
func DefaultTimeouts() Timeouts {
	return Timeouts{ReadHeader: DefaultReadHeaderTimeout, Read: DefaultReadTimeout, Write: DefaultWriteTimeout, Idle: DefaultIdleTimeout}
}

// Register defines --http-read-header-timeout, --http-read-timeout,
// --http-write-timeout and --http-idle-timeout on fs, with the defaults.
func (t *Timeouts) Register(fs *flag.FlagSet) {
	d := DefaultTimeouts()
	fs.DurationVar(&t.ReadHeader, "http-read-header-timeout", d.ReadHeader, "every HTTP server: time to read a request's headers (and to finish the TLS handshake; also bounds the gRPC server's connection handshake)")
	fs.DurationVar(&t.Read, "http-read-timeout", d.Read, "every HTTP server: time to read a whole request, body included (a slower client is cut off)")
	fs.DurationVar(&t.Write, "http-write-timeout", d.Write, "every HTTP server: time from the end of the request's headers to the end of the answer")
	fs.DurationVar(&t.Idle, "http-idle-timeout", d.Idle, "every HTTP server: how long a keep-alive connection may idle between requests")
}

// Validate checks that every timeout is positive: a zero would mean none.
func (t Timeouts) Validate() error {
	if t.ReadHeader <= 0 || t.Read <= 0 || t.Write <= 0 || t.Idle <= 0 {
		return errors.New("--http-read-header-timeout, --http-read-timeout, --http-write-timeout and --http-idle-timeout must be positive")
	}
	return nil
}

// NewHTTP returns an HTTP server for h with the timeouts t (zero fields take
// the defaults) and, when tc is not nil, TLS.
func NewHTTP(h http.Handler, t Timeouts, tc *tls.Config, log *slog.Logger) *http.Server {
	d := DefaultTimeouts()
	pick := func(v, def time.Duration) time.Duration {
		if v <= 0 {
			return def
		}
		return v
	}
	s := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: pick(t.ReadHeader, d.ReadHeader),
		ReadTimeout:       pick(t.Read, d.Read),
		WriteTimeout:      pick(t.Write, d.Write),
		IdleTimeout:       pick(t.Idle, d.Idle),
	}
	if tc != nil {
		// Serving configures HTTP/2 on the server's TLS configuration: one
		// copy per server, so servers may share tc.
		s.TLSConfig = tc.Clone()
	}
	if log != nil {
		// Handshake failures and cut-off clients are the client's fault:
		// logged at debug level, not on stderr unformatted.
		s.ErrorLog = slog.NewLogLogger(log.Handler(), slog.LevelDebug)
	}
	return s
}

// HTTP serves s on l, over TLS when s.TLSConfig is set, until s is shut
// down; a shutdown returns nil.
func HTTP(s *http.Server, l net.Listener) error {
	var err error
	if s.TLSConfig != nil {
		err = s.ServeTLS(l, "", "")
	} else {
		err = s.Serve(l)
	}
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}
