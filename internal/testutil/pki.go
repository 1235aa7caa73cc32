package testutil

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// CA is a test certificate authority that writes PEM files into a test's
// temporary directory.
type CA struct {
	// File is the PEM file of the CA's certificate.
	File string
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// KeyPair is a certificate and its key as PEM files.
type KeyPair struct {
	Cert, Key string
	// Serial is the certificate's serial number.
	Serial *big.Int
}

var serials atomic.Int64

// NewCA creates a CA named name.
func NewCA(tb testing.TB, name string) *CA {
	tb.Helper()
	key := newKey(tb)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serials.Add(1)), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		tb.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		tb.Fatal(err)
	}
	ca := &CA{dir: tb.TempDir(), cert: cert, key: key}
	ca.File = filepath.Join(ca.dir, "ca.pem")
	writePEM(tb, ca.File, "CERTIFICATE", der)
	return ca
}

// Server issues a server certificate for 127.0.0.1, ::1 and localhost,
// written to files named after name (an existing pair of that name is
// replaced in place, as a rotation would).
func (ca *CA) Server(tb testing.TB, name string) KeyPair {
	tb.Helper()
	return ca.issue(tb, name, x509.ExtKeyUsageServerAuth)
}

// Client issues a client certificate with common name name.
func (ca *CA) Client(tb testing.TB, name string) KeyPair {
	tb.Helper()
	return ca.issue(tb, name, x509.ExtKeyUsageClientAuth)
}

// ClientTLS returns a client TLS configuration that trusts ca and presents
// kp (none when kp is the zero KeyPair).
func (ca *CA) ClientTLS(tb testing.TB, kp KeyPair) *tls.Config {
	tb.Helper()
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	cfg := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if kp.Cert != "" {
		pair, err := tls.LoadX509KeyPair(kp.Cert, kp.Key)
		if err != nil {
			tb.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg
}

func (ca *CA) issue(tb testing.TB, name string, usage x509.ExtKeyUsage) KeyPair {
	key := newKey(tb)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serials.Add(1)), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
	if usage == x509.ExtKeyUsageServerAuth {
		tmpl.DNSNames = []string{"localhost"}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		tb.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		tb.Fatal(err)
	}
	kp := KeyPair{Cert: filepath.Join(ca.dir, name+".pem"), Key: filepath.Join(ca.dir, name+"-key.pem"), Serial: tmpl.SerialNumber}
	// Key first, then certificate, each by rename: a reader sees the old
	// pair, a mismatched pair for a moment, or the new pair.
	writePEM(tb, kp.Key, "EC PRIVATE KEY", kb)
	writePEM(tb, kp.Cert, "CERTIFICATE", der)
	return kp
}

func newKey(tb testing.TB) *ecdsa.PrivateKey {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	return key
}

func writePEM(tb testing.TB, path, typ string, der []byte) {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		tb.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		tb.Fatal(err)
	}
}
