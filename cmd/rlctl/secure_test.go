package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/backend"
	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

func TestEtcdAuth(t *testing.T) {
	e := testutil.StartEtcd(t)
	ec := e.Client(t)
	ctx := context.Background()
	if _, err := ec.UserAdd(ctx, "root", "s3cret"); err != nil {
		t.Fatal(err)
	}
	if _, err := ec.UserGrantRole(ctx, "root", "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := ec.AuthEnable(ctx); err != nil {
		t.Fatal(err)
	}
	rlctl(t, "--etcd-endpoints", e.Endpoint, "rules", "list").must(t, exitFailure)
	rlctl(t, "--etcd-endpoints", e.Endpoint, "--etcd-username", "root", "--etcd-password", "wrong", "rules", "list").must(t, exitFailure, "authentication failed")
	rlctl(t, "--etcd-endpoints", e.Endpoint, "--etcd-username", "root", "--etcd-password", "s3cret", "rules", "list").must(t, exitOK, "ID")
	// From the environment, as deployments pass secrets.
	t.Setenv("APPORTION_ETCD_USERNAME", "root")
	t.Setenv("APPORTION_ETCD_PASSWORD", "s3cret")
	rlctl(t, "--etcd-endpoints", e.Endpoint, "rules", "list").must(t, exitOK, "ID")
}

func TestEtcdTLSFlags(t *testing.T) {
	dir := t.TempDir()
	pki := newTestPKI(t, dir)
	garbage := filepath.Join(dir, "garbage.pem")
	os.WriteFile(garbage, []byte("not a certificate"), 0o600)
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"password without user", []string{"--etcd-endpoints", "https://127.0.0.1:1", "--etcd-password", "x"}, exitUsage, "--etcd-username"},
		{"cert without key", []string{"--etcd-endpoints", "https://127.0.0.1:1", "--etcd-cert", pki.cert}, exitUsage, "--etcd-cert and --etcd-key"},
		{"TLS on http", []string{"--etcd-endpoints", "http://127.0.0.1:1", "--etcd-ca", pki.ca}, exitUsage, "https://"},
		{"bad CA", []string{"--etcd-endpoints", "https://127.0.0.1:1", "--etcd-ca", garbage}, exitFailure, "no PEM certificate"},
		{"missing CA", []string{"--etcd-endpoints", "https://127.0.0.1:1", "--etcd-ca", filepath.Join(dir, "nope")}, exitFailure, "--etcd-ca"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rlctl(t, append(tc.args, "rules", "list")...).must(t, tc.code, tc.want)
		})
	}
	g := globals{etcd: backend.Etcd{Endpoints: "https://a:2379, https://b:2379", CA: pki.ca, Cert: pki.cert, Key: pki.key, Username: "u", Password: "p"}}
	cfg, err := g.etcdConfig()
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Endpoints) != 2 || cfg.Endpoints[1] != "https://b:2379" || cfg.TLS == nil || cfg.TLS.RootCAs == nil ||
		len(cfg.TLS.Certificates) != 1 || cfg.Username != "u" || cfg.Password != "p" {
		t.Fatalf("%+v", cfg)
	}
}

// TestCheckTLS calls an enforcer that serves gRPC over TLS.
func TestCheckTLS(t *testing.T) {
	pki := newTestPKI(t, t.TempDir())
	pair, err := tls.LoadX509KeyPair(pki.cert, pki.key)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12})))
	ratelimitv1.RegisterRateLimiterServer(srv, &fakeLimiter{})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	addr := lis.Addr().String()
	rlctl(t, "check", "--addr", addr, "--client-key", "k", "--tls-ca", pki.ca).must(t, exitOK, "ALLOWED rule=orders-free")
	t.Setenv("APPORTION_TLS_CA", pki.ca)
	rlctl(t, "check", "--addr", addr, "--client-key", "k").must(t, exitOK, "ALLOWED")
	os.Unsetenv("APPORTION_TLS_CA")
	rlctl(t, "--timeout", "2s", "check", "--addr", addr, "--client-key", "k", "--tls").must(t, exitFailure, "certificate")
	rlctl(t, "--timeout", "2s", "check", "--addr", addr, "--client-key", "k").must(t, exitFailure, "CheckLimit")
}

type testPKI struct{ ca, cert, key string }

// newTestPKI writes a CA and a server certificate for 127.0.0.1 and
// localhost it signs, as PEM files in dir.
func newTestPKI(t *testing.T, dir string) testPKI {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "rlctl test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "localhost"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	p := testPKI{ca: filepath.Join(dir, "ca.pem"), cert: filepath.Join(dir, "cert.pem"), key: filepath.Join(dir, "key.pem")}
	for path, block := range map[string]*pem.Block{
		p.ca:   {Type: "CERTIFICATE", Bytes: caDER},
		p.cert: {Type: "CERTIFICATE", Bytes: der},
		p.key:  {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

// TestMutualTLSClient: against servers that require a client certificate,
// rlctl presents --tls-cert/--tls-key on check's gRPC and on the admin API,
// and without one it is refused.
func TestMutualTLSClient(t *testing.T) {
	ca := testutil.NewCA(t, "rlctl mTLS CA")
	srvPair := ca.Server(t, "server")
	cli := ca.Client(t, "operator")
	pair, err := tls.LoadX509KeyPair(srvPair.Cert, srvPair.Key)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	caPEM, err := os.ReadFile(ca.File)
	if err != nil || !pool.AppendCertsFromPEM(caPEM) {
		t.Fatalf("CA file: %v", err)
	}
	serverTLS := &tls.Config{Certificates: []tls.Certificate{pair}, ClientCAs: pool,
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12}

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(serverTLS)))
	ratelimitv1.RegisterRateLimiterServer(srv, &fakeLimiter{})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		<-served
	})
	addr := lis.Addr().String()
	rlctl(t, "check", "--addr", addr, "--client-key", "k", "--tls-ca", ca.File, "--tls-cert", cli.Cert, "--tls-key", cli.Key).must(t, exitOK, "ALLOWED")
	rlctl(t, "--timeout", "2s", "check", "--addr", addr, "--client-key", "k", "--tls-ca", ca.File).must(t, exitFailure, "CheckLimit")
	rlctl(t, "check", "--addr", addr, "--client-key", "k", "--tls-ca", ca.File, "--tls-cert", cli.Cert).must(t, exitUsage, "both the certificate and the key")

	hs := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/rules" || len(r.TLS.PeerCertificates) == 0 {
			http.Error(w, "unexpected", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte("[]"))
	}))
	hs.TLS = serverTLS
	hs.StartTLS()
	t.Cleanup(hs.Close)
	rlctl(t, "--admin-url", hs.URL, "--token", "t", "--tls-ca", ca.File, "--tls-cert", cli.Cert, "--tls-key", cli.Key, "rules", "list", "-o", "json").must(t, exitOK, "[]")
	rlctl(t, "--timeout", "2s", "--admin-url", hs.URL, "--token", "t", "--tls-ca", ca.File, "rules", "list").must(t, exitFailure)
}
