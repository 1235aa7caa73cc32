package tlsconfig_test

import (
	"crypto/tls"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/internal/tlsconfig"
)

// serve accepts TLS connections with cfg on loopback and completes each
// handshake, until the test ends.
func serve(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	l, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { l.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if c.(*tls.Conn).Handshake() == nil {
					c.Write([]byte("x"))
				}
			}()
		}
	}()
	return l.Addr().String()
}

// handshake dials addr and returns the server certificate's serial, or the
// error of the handshake (read one byte, so a client certificate refused in
// TLS 1.3 shows up here too).
func handshake(addr string, cfg *tls.Config) (string, error) {
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != nil {
		return "", err
	}
	return c.ConnectionState().PeerCertificates[0].SerialNumber.String(), nil
}

func TestServerMutualTLS(t *testing.T) {
	ca, other := testutil.NewCA(t, "apportion test CA"), testutil.NewCA(t, "another CA")
	srv := ca.Server(t, "server")
	s, err := tlsconfig.NewServer(srv.Cert, srv.Key, tlsconfig.WithClientCA(ca.File))
	if err != nil {
		t.Fatal(err)
	}
	if !s.MutualTLS() {
		t.Fatal("MutualTLS() = false with a client CA")
	}
	addr := serve(t, s.Config())
	for _, tc := range []struct {
		name    string
		client  *tls.Config
		wantErr string
	}{
		{"client signed by the CA is served", ca.ClientTLS(t, ca.Client(t, "gateway")), ""},
		{"client without a certificate is refused", ca.ClientTLS(t, testutil.KeyPair{}), "certificate required"},
		{"client signed by another CA is refused", ca.ClientTLS(t, other.Client(t, "intruder")), "bad certificate"},
		{"server certificate is not a client certificate", ca.ClientTLS(t, srv), "bad certificate"},
		{"TLS 1.1 is refused", func() *tls.Config {
			c := ca.ClientTLS(t, ca.Client(t, "old"))
			c.MinVersion, c.MaxVersion = tls.VersionTLS11, tls.VersionTLS11
			return c
		}(), "protocol version"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			serial, err := handshake(addr, tc.client)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.wantErr == "" && serial != srv.Serial.String():
				t.Fatalf("served certificate %s, want %s", serial, srv.Serial)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("got %v, want an error containing %q", err, tc.wantErr)
			}
		})
	}
}

// A rotated certificate (and client CA) is served from the next handshake
// after the reload check, with no restart; a rotation that leaves a bad
// file set keeps the previous certificate.
func TestServerReloadsRotatedFiles(t *testing.T) {
	ca := testutil.NewCA(t, "apportion test CA")
	old := ca.Server(t, "server")
	s, err := tlsconfig.NewServer(old.Cert, old.Key, tlsconfig.WithReloadCheck(0))
	if err != nil {
		t.Fatal(err)
	}
	addr := serve(t, s.Config())
	client := ca.ClientTLS(t, testutil.KeyPair{})
	if got, err := handshake(addr, client); err != nil || got != old.Serial.String() {
		t.Fatalf("before rotation: serial %s err %v, want %s", got, err, old.Serial)
	}

	rotated := ca.Server(t, "server") // same files, new certificate and key
	testutil.WaitFor(t, 5*time.Second, "the rotated certificate", func() bool {
		got, err := handshake(addr, client)
		return err == nil && got == rotated.Serial.String()
	})

	// A broken rotation (certificate replaced by garbage) keeps serving
	// the last good certificate.
	if err := os.WriteFile(rotated.Cert, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if got, err := handshake(addr, client); err != nil || got != rotated.Serial.String() {
			t.Fatalf("after a broken rotation: serial %s err %v, want the last good %s", got, err, rotated.Serial)
		}
	}

	// Rotating the client CA: a server that trusted CA 1 for clients
	// trusts CA 2 instead once the CA file changes.
	ca2 := testutil.NewCA(t, "second CA")
	caFile := t.TempDir() + "/clients.pem"
	copyFile(t, ca.File, caFile)
	srv := ca.Server(t, "server2")
	ms, err := tlsconfig.NewServer(srv.Cert, srv.Key, tlsconfig.WithClientCA(caFile), tlsconfig.WithReloadCheck(0))
	if err != nil {
		t.Fatal(err)
	}
	maddr := serve(t, ms.Config())
	c1, c2 := ca.ClientTLS(t, ca.Client(t, "c1")), ca.ClientTLS(t, ca2.Client(t, "c2"))
	if _, err := handshake(maddr, c1); err != nil {
		t.Fatalf("client of CA 1 before the CA rotation: %v", err)
	}
	copyFile(t, ca2.File, caFile)
	testutil.WaitFor(t, 5*time.Second, "the rotated client CA", func() bool {
		_, err := handshake(maddr, c2)
		return err == nil
	})
	if _, err := handshake(maddr, c1); err == nil {
		t.Fatal("a client of the replaced CA is still served")
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to+".tmp", b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(to+".tmp", to); err != nil {
		t.Fatal(err)
	}
}

func TestNewServerErrors(t *testing.T) {
	ca := testutil.NewCA(t, "ca")
	kp := ca.Server(t, "s")
	bad := t.TempDir() + "/bad.pem"
	os.WriteFile(bad, []byte("junk"), 0o600)
	for _, tc := range []struct {
		name, cert, key, ca, want string
	}{
		{"no key", kp.Cert, "", "", "both"},
		{"key does not match", kp.Cert, bad, "", "server certificate"},
		{"client CA missing", kp.Cert, kp.Key, "/nonexistent/ca.pem", "client CA file"},
		{"client CA not PEM", kp.Cert, kp.Key, bad, "no PEM certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var opts []tlsconfig.ServerOption
			if tc.ca != "" {
				opts = append(opts, tlsconfig.WithClientCA(tc.ca))
			}
			_, err := tlsconfig.NewServer(tc.cert, tc.key, opts...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
