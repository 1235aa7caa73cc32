// Package tlsconfig builds TLS configurations from PEM files: client ones for
// the connections the daemons make to Redis, etcd and NATS, and server ones
// (Server) for the ports they serve, with optional client certificates
// (mutual TLS) and certificate reload without a restart.
//
// Invariant: every configuration requires TLS 1.2 or later; a server with a
// client CA serves no client that lacks a certificate chaining to it.
package tlsconfig

import (
	"crypto/tls"
	"errors"
	"fmt"
)

// Client returns a TLS client configuration (TLS 1.2 or later). caFile, when
// set, replaces the system roots; certFile and keyFile, when set (both),
// give a client certificate for mutual TLS.
func Client(caFile, certFile, keyFile string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pool, err := loadPool(caFile)
		if err != nil {
			return nil, fmt.Errorf("tlsconfig: CA file: %w", err)
		}
		cfg.RootCAs = pool
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("tlsconfig: a client certificate needs both the certificate and the key file")
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("tlsconfig: client certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}
