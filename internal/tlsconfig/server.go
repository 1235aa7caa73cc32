package tlsconfig

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// DefaultReloadCheck is how often, at most, a Server looks at its files for
// a change (1 s): a rotated certificate is served from the first handshake
// after that.
const DefaultReloadCheck = time.Second

// Server holds a server's certificate and, for mutual TLS, the CA that signs
// its clients' certificates, and reloads both when their files change, with
// no restart. The check runs during a handshake, at most once per
// reload-check interval; a file set that does not load (a rotation caught
// halfway, a key that does not match) is logged and the previous one stays
// in use, so a bad rotation never takes the server down. Safe for
// concurrent use.
type Server struct {
	certFile, keyFile, caFile string
	check                     time.Duration
	log                       *slog.Logger
	now                       func() time.Time

	mu        sync.Mutex
	checked   time.Time
	stamps    [3]stamp
	cert      *tls.Certificate
	pool      *x509.CertPool // nil: no client certificate asked for
	lastError string
}

// stamp is what tells a changed file: size and modification time.
type stamp struct {
	size int64
	mod  time.Time
}

// ServerOption configures a Server.
type ServerOption func(*Server)

// WithClientCA asks every client for a certificate and accepts only those
// that chain to a CA in the PEM file caFile (mutual TLS). Default: no client
// certificate is asked for.
func WithClientCA(caFile string) ServerOption { return func(s *Server) { s.caFile = caFile } }

// WithReloadCheck sets how often, at most, the files are looked at (stat)
// for a change. Default DefaultReloadCheck; 0 looks at every handshake.
func WithReloadCheck(d time.Duration) ServerOption { return func(s *Server) { s.check = d } }

// WithLogger logs reloads and reloads that failed. Default: discard.
func WithLogger(l *slog.Logger) ServerOption { return func(s *Server) { s.log = l } }

// NewServer loads the certificate in certFile and keyFile (and the client CA
// file, if given) and returns a Server that serves them. An error names the
// file at fault.
func NewServer(certFile, keyFile string, opts ...ServerOption) (*Server, error) {
	if certFile == "" || keyFile == "" {
		return nil, errors.New("tlsconfig: a server needs both a certificate and a key file")
	}
	s := &Server{certFile: certFile, keyFile: keyFile, check: DefaultReloadCheck,
		log: slog.New(slog.DiscardHandler), now: time.Now}
	for _, o := range opts {
		o(s)
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	stamps := s.stat()
	cert, pool, err := s.load()
	if err != nil {
		return nil, err
	}
	s.stamps, s.cert, s.pool, s.checked = stamps, cert, pool, s.now()
	return s, nil
}

// Config returns a TLS 1.2+ server configuration that takes its certificate
// and client CA from s at every handshake. With a client CA, a client with
// no certificate, or one that does not chain to the CA (for client
// authentication), fails the handshake. Callers may clone it and add to
// NextProtos (gRPC and net/http do).
func (s *Server) Config() *tls.Config {
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			cert, _ := s.current()
			return cert, nil
		},
	}
	if s.caFile != "" {
		// The pool is read per handshake (it may have been reloaded), so
		// the chain is verified here rather than through a fixed ClientCAs.
		cfg.ClientAuth = tls.RequireAnyClientCert
		cfg.VerifyConnection = s.verifyClient
	}
	return cfg
}

// MutualTLS reports whether s asks clients for a certificate.
func (s *Server) MutualTLS() bool { return s.caFile != "" }

func (s *Server) verifyClient(cs tls.ConnectionState) error {
	_, pool := s.current()
	if len(cs.PeerCertificates) == 0 {
		return errors.New("tlsconfig: client sent no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	if err != nil {
		return fmt.Errorf("tlsconfig: client certificate %q: %w", cs.PeerCertificates[0].Subject, err)
	}
	return nil
}

// current returns the certificate and pool, reloading them first when the
// check interval has passed and a file changed.
func (s *Server) current() (*tls.Certificate, *x509.CertPool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if now := s.now(); now.Sub(s.checked) >= s.check {
		s.checked = now
		if st := s.stat(); st != s.stamps {
			cert, pool, err := s.load()
			switch {
			case err != nil:
				// Retried at the next check: a rotation may be halfway.
				if msg := err.Error(); msg != s.lastError {
					s.log.Error("tls: reload failed; serving the previous certificate", "error", err)
					s.lastError = msg
				}
			default:
				s.stamps, s.cert, s.pool, s.lastError = st, cert, pool, ""
				s.log.Info("tls: certificate reloaded", "cert", s.certFile, "not_after", cert.Leaf.NotAfter)
			}
		}
	}
	return s.cert, s.pool
}

func (s *Server) stat() [3]stamp {
	var out [3]stamp
	for i, f := range []string{s.certFile, s.keyFile, s.caFile} {
		if f == "" {
			continue
		}
		if fi, err := os.Stat(f); err == nil {
			out[i] = stamp{size: fi.Size(), mod: fi.ModTime()}
		}
	}
	return out
}

func (s *Server) load() (*tls.Certificate, *x509.CertPool, error) {
	cert, err := tls.LoadX509KeyPair(s.certFile, s.keyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsconfig: server certificate %s / key %s: %w", s.certFile, s.keyFile, err)
	}
	if s.caFile == "" {
		return &cert, nil, nil
	}
	pool, err := loadPool(s.caFile)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsconfig: client CA file: %w", err)
	}
	return &cert, pool, nil
}

// loadPool reads a PEM bundle of CA certificates.
func loadPool(file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s holds no PEM certificate", file)
	}
	return pool, nil
}
