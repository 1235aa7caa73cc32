package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

var metricsRE = regexp.MustCompile(`metrics=(\S+)`)

func grpcCheck(addr string, creds grpc.DialOption) error {
	conn, err := grpc.NewClient(addr, creds)
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = ratelimitv1.NewRateLimiterClient(conn).CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "user:1", Resource: "GET /"})
	return err
}

func httpsGet(url string, cfg *tls.Config, token string) (int, string, error) {
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg, DisableKeepAlives: true}}
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		return 0, "", err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

// servedSerial returns the serial of the certificate served at addr.
func servedSerial(addr string, cfg *tls.Config) (string, error) {
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return "", err
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.String(), nil
}

// Mutual TLS on every port: gRPC, HTTP and the admin API serve only clients
// with a certificate from the client CA; /metrics and health are on their
// own plain port; a rotated server certificate is served without a
// restart; a slow body is cut off on every HTTP port.
func TestMutualTLSOnEveryPort(t *testing.T) {
	integration(t)
	et := testutil.StartEtcd(t)
	r := testutil.StartRedis(t)
	serverCA, clientCA, otherCA := testutil.NewCA(t, "server CA"), testutil.NewCA(t, "client CA"), testutil.NewCA(t, "other CA")
	srvCert := serverCA.Server(t, "ratelimitd")
	s := startInProcess(t, "--region", "us-east", "--redis-addr", r.Addr, "--etcd-endpoints", et.Endpoint,
		"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0",
		"--admin-token", "s3cret", "--tls-cert", srvCert.Cert, "--tls-key", srvCert.Key, "--tls-client-ca", clientCA.File,
		"--http-read-timeout", "1s", "--http-read-header-timeout", "1s")
	adminAddr, metricsAddr := adminRE.FindStringSubmatch(s.readyLine)[1], metricsRE.FindStringSubmatch(s.readyLine)[1]

	good := serverCA.ClientTLS(t, clientCA.Client(t, "gateway"))
	clients := []struct {
		name   string
		cfg    *tls.Config
		served bool
	}{
		{"client with a certificate from the client CA", good, true},
		{"client without a certificate", serverCA.ClientTLS(t, testutil.KeyPair{}), false},
		{"client with a certificate from another CA", serverCA.ClientTLS(t, otherCA.Client(t, "intruder")), false},
	}
	for _, c := range clients {
		t.Run(c.name, func(t *testing.T) {
			calls := map[string]func() error{
				"gRPC": func() error { return grpcCheck(s.grpc, grpc.WithTransportCredentials(credentials.NewTLS(c.cfg))) },
				"HTTP": func() error {
					code, body, err := httpsGet("https://"+s.http+"/healthz", c.cfg, "")
					if err == nil && code != 200 {
						t.Errorf("HTTP /healthz: %d %s", code, body)
					}
					return err
				},
				"admin": func() error {
					code, body, err := httpsGet("https://"+adminAddr+"/rules", c.cfg, "s3cret")
					if err == nil && code != 200 {
						t.Errorf("admin GET /rules: %d %s", code, body)
					}
					return err
				},
			}
			for port, call := range calls {
				err := call()
				if c.served && err != nil {
					t.Errorf("%s refused a client it should serve: %v", port, err)
				}
				if !c.served && err == nil {
					t.Errorf("%s served a client it should refuse", port)
				}
				if err != nil {
					t.Logf("%s: %v", port, err)
				}
			}
		})
	}
	t.Run("plain-text clients are refused", func(t *testing.T) {
		if err := grpcCheck(s.grpc, grpc.WithTransportCredentials(insecure.NewCredentials())); err == nil {
			t.Error("gRPC served a plain-text client")
		}
		for _, addr := range []string{s.http, adminAddr} {
			if resp, err := http.Get("http://" + addr + "/healthz"); err == nil {
				resp.Body.Close()
				if resp.StatusCode == 200 {
					t.Errorf("%s served a plain-text client", addr)
				}
			}
		}
	})
	t.Run("metrics and health on their own port", func(t *testing.T) {
		for path, want := range map[string]string{"/metrics": "apportion_breaker_state", "/healthz": "ok", "/readyz": "ready"} {
			resp, err := http.Get("http://" + metricsAddr + path)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || !strings.Contains(string(b), want) {
				t.Errorf("metrics port %s: %d %.100s", path, resp.StatusCode, b)
			}
		}
		if code, _, err := httpsGet("https://"+s.http+"/metrics", good, ""); err != nil || code != http.StatusNotFound {
			t.Errorf("check port /metrics with --metrics-addr: %d %v, want 404", code, err)
		}
		if resp, err := http.Get("http://" + metricsAddr + "/v1/check"); err == nil {
			resp.Body.Close()
			if resp.StatusCode != http.StatusNotFound {
				t.Errorf("metrics port /v1/check: %d, want 404 (checks only on the check port)", resp.StatusCode)
			}
		}
	})
	t.Run("a rotated certificate is served without a restart", func(t *testing.T) {
		rotated := serverCA.Server(t, "ratelimitd") // same files
		for port, addr := range map[string]string{"gRPC": s.grpc, "HTTP": s.http, "admin": adminAddr} {
			testutil.WaitFor(t, 10*time.Second, "the rotated certificate on "+port, func() bool {
				serial, err := servedSerial(addr, good)
				return err == nil && serial == rotated.Serial.String()
			})
		}
		if err := grpcCheck(s.grpc, grpc.WithTransportCredentials(credentials.NewTLS(good))); err != nil {
			t.Fatalf("gRPC after the rotation: %v", err)
		}
		if !strings.Contains(s.stderr.String(), "certificate reloaded") {
			t.Error("no log line for the reload")
		}
	})
	// Each port is probed by its own goroutine: the ports run their timeouts
	// at the same time.
	eachPort := func(t *testing.T, ports map[string]func() (net.Conn, error), probe func(c net.Conn)) map[string]time.Duration {
		t.Helper()
		type result struct {
			port string
			d    time.Duration
			err  error
		}
		res := make(chan result, len(ports))
		for port, dial := range ports {
			go func() {
				c, err := dial()
				if err != nil {
					res <- result{port: port, err: err}
					return
				}
				defer c.Close()
				start := time.Now()
				c.SetDeadline(time.Now().Add(15 * time.Second))
				closed := make(chan struct{})
				go func() { io.Copy(io.Discard, c); close(closed) }() // until the server closes
				probe(c)
				<-closed
				res <- result{port: port, d: time.Since(start)}
			}()
		}
		out := map[string]time.Duration{}
		for range ports {
			r := <-res
			if r.err != nil {
				t.Fatalf("%s: %v", r.port, r.err)
			}
			out[r.port] = r.d
		}
		return out
	}
	plain := func(addr string) func() (net.Conn, error) {
		return func() (net.Conn, error) { return net.Dial("tcp", addr) }
	}
	mtls := func(addr string) func() (net.Conn, error) {
		return func() (net.Conn, error) { return tls.Dial("tcp", addr, good) }
	}
	t.Run("a silent connection is dropped on every port", func(t *testing.T) {
		ports := map[string]func() (net.Conn, error){"gRPC": plain(s.grpc), "HTTP": plain(s.http), "admin": plain(adminAddr), "metrics": plain(metricsAddr)}
		for port, d := range eachPort(t, ports, func(net.Conn) {}) {
			t.Logf("%s: a connection that sent nothing was dropped after %v (--http-read-header-timeout 1s)", port, d)
			if d > 5*time.Second {
				t.Errorf("%s held a silent connection for %v, want about 1s", port, d)
			}
		}
	})
	t.Run("a slow body is cut off on every HTTP port", func(t *testing.T) {
		ports := map[string]func() (net.Conn, error){"HTTP": mtls(s.http), "admin": mtls(adminAddr), "metrics": plain(metricsAddr)}
		head := "POST /v1/check HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
		trickle := func(c net.Conn) {
			io.WriteString(c, head)
			for i := 0; i < 150; i++ { // 15 s at 10 bytes/s: far past the read timeout
				time.Sleep(100 * time.Millisecond) // the pace of a slow client is the subject of the test
				if _, err := c.Write([]byte(" ")); err != nil {
					return // closed by the server
				}
			}
		}
		for port, d := range eachPort(t, ports, trickle) {
			t.Logf("%s: a body sent at 10 bytes/s was cut off after %v (--http-read-timeout 1s)", port, d)
			if d > 5*time.Second {
				t.Errorf("%s cut the slow body off after %v, want about 1s", port, d)
			}
		}
	})
	if err := s.stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
}

// The admin API answers within its store timeout while etcd is down (503
// with a JSON body), and the first request after etcd returns is served at
// once: no reconnect backoff grown during the outage delays it.
func TestAdminAPIWhileEtcdIsDown(t *testing.T) {
	integration(t)
	et := testutil.StartEtcd(t)
	r := testutil.StartRedis(t)
	s := startInProcess(t, "--region", "us-east", "--redis-addr", r.Addr, "--etcd-endpoints", et.Endpoint,
		"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--admin-token", "s3cret")
	url := "http://" + adminRE.FindStringSubmatch(s.readyLine)[1] + "/rules"
	get := func() (int, string, time.Duration) {
		t.Helper()
		start := time.Now()
		code, body, err := httpsGet(url, nil, "s3cret")
		if err != nil {
			t.Fatal(err)
		}
		return code, body, time.Since(start)
	}
	if code, body, _ := get(); code != 200 {
		t.Fatalf("before the outage: %d %s", code, body)
	}
	et.Stop()
	// Long enough for gRPC's default reconnect backoff (1 s growing by
	// 1.6x) to reach waits of several seconds.
	outage := time.Now()
	var worst time.Duration
	for n := 0; time.Since(outage) < 8*time.Second; n++ {
		code, body, d := get()
		worst = max(worst, d)
		var e struct{ Error string }
		if code != http.StatusServiceUnavailable || json.Unmarshal([]byte(body), &e) != nil || !strings.Contains(e.Error, "etcd did not answer within 2s") {
			t.Fatalf("call %d with etcd down: %d %s, want 503 with a JSON error naming etcd", n, code, body)
		}
		if d > 4*time.Second { // the default store timeout is 2 s
			t.Fatalf("call %d with etcd down took %v", n, d)
		}
	}
	et.Restart(t)
	code, body, d := get()
	t.Logf("with etcd down: worst answer %v; the first call after etcd returned: %d in %v", worst, code, d)
	if code != 200 {
		t.Fatalf("first call after etcd returned: %d %s, want 200", code, body)
	}
	if d > 1500*time.Millisecond {
		t.Fatalf("first call after etcd returned took %v", d)
	}
}
