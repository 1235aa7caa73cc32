package tlsconfig

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func writeCert(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	return certFile, keyFile
}

func TestClient(t *testing.T) {
	dir := t.TempDir()
	cert, key := writeCert(t, dir)
	bad := filepath.Join(dir, "bad.pem")
	os.WriteFile(bad, []byte("not pem"), 0o600)
	tests := []struct {
		name            string
		ca, cert, key   string
		wantErr         string
		wantRoots, mTLS bool
	}{
		{name: "system roots"},
		{name: "custom CA", ca: cert, wantRoots: true},
		{name: "mutual TLS", ca: cert, cert: cert, key: key, wantRoots: true, mTLS: true},
		{name: "CA file missing", ca: filepath.Join(dir, "nope.pem"), wantErr: "CA file"},
		{name: "CA file not PEM", ca: bad, wantErr: "no PEM certificate"},
		{name: "cert without key", cert: cert, wantErr: "both"},
		{name: "bad key pair", cert: cert, key: bad, wantErr: "client certificate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := Client(tt.ca, tt.cert, tt.key)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if (cfg.RootCAs != nil) != tt.wantRoots || (len(cfg.Certificates) > 0) != tt.mTLS {
				t.Fatalf("roots=%v certs=%d", cfg.RootCAs != nil, len(cfg.Certificates))
			}
		})
	}
}
