package client_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/client"
	"github.com/apportion/apportion/rules"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

func newClient(t *testing.T, opts ...client.Option) *client.Client {
	t.Helper()
	c, err := client.New(append([]client.Option{client.WithTimeout(5 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestCheck(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("orders", "POST /orders", 3)})
	c := newClient(t, client.WithAddress(e.addr))
	ctx := context.Background()
	req := client.Request{ClientKey: "user:1", Resource: "POST /orders"}
	for i := range 3 {
		d, err := c.Check(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if !d.Allowed || d.RuleID != "orders" || d.Limit != 3 || d.Remaining != int64(2-i) || d.Unreachable != nil || d.FailOpen {
			t.Fatalf("check %d: %+v, want allowed by orders with %d remaining", i, d, 2-i)
		}
		if len(d.Statuses) != 1 || d.Statuses[0].RuleID != "orders" || !d.Statuses[0].Allowed {
			t.Fatalf("check %d: statuses %+v", i, d.Statuses)
		}
	}
	d, err := c.Check(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	// One token comes back after 100 s at 0.01 tokens/s.
	if d.Allowed || d.RetryAfter < 90*time.Second || d.RetryAfter > 100*time.Second || d.Remaining != 0 {
		t.Fatalf("4th check: %+v, want rejected with retry after about 100s", d)
	}
	// A cost above the capacity can never pass: RetryAfter is Never.
	if d, err := c.Check(ctx, client.Request{ClientKey: "user:3", Resource: "POST /orders", Cost: 5}); err != nil || d.Allowed || d.RetryAfter != client.Never {
		t.Fatalf("cost 5 of capacity 3: %+v, %v; want rejected with RetryAfter Never", d, err)
	}
	// Another client and a resource no rule matches are not affected.
	if d, err := c.Check(ctx, client.Request{ClientKey: "user:2", Resource: "POST /orders", Cost: 3}); err != nil || !d.Allowed {
		t.Fatalf("user:2: %+v, %v", d, err)
	}
	if d, err := c.Check(ctx, client.Request{ClientKey: "user:1", Resource: "GET /orders"}); err != nil || !d.Allowed || d.RuleID != "" {
		t.Fatalf("unmatched resource: %+v, %v", d, err)
	}
	if n := e.count("CheckLimit"); n != 7 {
		t.Errorf("enforcer saw %d CheckLimit calls, want 7", n)
	}
}

func TestInvalidRequest(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("orders", "POST /orders", 3)})
	c := newClient(t, client.WithAddress(e.addr))
	for _, tc := range []struct {
		name  string
		req   client.Request
		field string
	}{
		{"empty key", client.Request{Resource: "POST /orders"}, "client_key"},
		{"negative cost", client.Request{ClientKey: "u", Cost: -1}, "cost"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Check(context.Background(), tc.req)
			var re *client.RequestError
			if !errors.Is(err, client.ErrInvalidRequest) || !errors.As(err, &re) || re.Field != tc.field {
				t.Fatalf("err = %v, want a RequestError naming %s", err, tc.field)
			}
		})
	}
}

func TestCheckBatch(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("orders", "POST /orders", 2)})
	c := newClient(t, client.WithAddress(e.addr))
	ctx := context.Background()
	// 1,500 requests: two CheckLimits calls (the enforcer takes at most
	// 1,000), answered in order; user:0 is rejected from its third request.
	reqs := make([]client.Request, 1500)
	for i := range reqs {
		reqs[i] = client.Request{ClientKey: fmt.Sprintf("user:%d", i%500), Resource: "POST /orders"}
	}
	ds, err := c.CheckBatch(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if len(ds) != len(reqs) {
		t.Fatalf("%d decisions for %d requests", len(ds), len(reqs))
	}
	for i, d := range ds {
		if want := i < 1000; d.Allowed != want || d.RuleID != "orders" {
			t.Fatalf("decision %d (%s): %+v, want allowed=%v", i, reqs[i].ClientKey, d, want)
		}
	}
	if n := e.count("CheckLimits"); n != 2 {
		t.Errorf("enforcer saw %d CheckLimits calls, want 2", n)
	}
	// A bad request is named by its index in the caller's slice.
	reqs[1200].ClientKey = ""
	_, err = c.CheckBatch(ctx, reqs)
	var re *client.RequestError
	if !errors.As(err, &re) || re.Index != 1200 || re.Field != "client_key" {
		t.Fatalf("err = %v, want a RequestError for request 1200's client_key", err)
	}
}

// TestBatching: concurrent Checks leave as CheckLimits batches, every
// caller gets its own answer, and a bad request fails only itself.
func TestBatching(t *testing.T) {
	testutil.CheckGoroutines(t)
	e := startEnforcer(t, []rules.Rule{tokenBucket("orders", "POST /orders", 30)})
	c := newClient(t, client.WithAddress(e.addr), client.WithBatching(100, 20*time.Millisecond))
	const n = 50
	var wg sync.WaitGroup
	ds := make([]client.Decision, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := client.Request{ClientKey: "user:1", Resource: "POST /orders"}
			if i == 7 {
				req.ClientKey = "" // invalid
			}
			ds[i], errs[i] = c.Check(context.Background(), req)
		}()
	}
	wg.Wait()
	allowed := 0
	for i := range n {
		if i == 7 {
			var re *client.RequestError
			if !errors.As(errs[i], &re) || re.Field != "client_key" {
				t.Errorf("request 7: %v, want a RequestError naming client_key", errs[i])
			}
			continue
		}
		if errs[i] != nil {
			t.Fatalf("request %d: %v", i, errs[i])
		}
		if ds[i].RuleID != "orders" || ds[i].Unreachable != nil {
			t.Fatalf("request %d: %+v", i, ds[i])
		}
		if ds[i].Allowed {
			allowed++
		}
	}
	if allowed != 30 {
		t.Errorf("%d of %d allowed, want exactly the capacity 30", allowed, n-1)
	}
	single, batches := e.count("CheckLimit"), e.count("CheckLimits")
	if single != 0 || batches == 0 || batches > n/2 {
		t.Errorf("enforcer saw %d CheckLimit and %d CheckLimits calls for %d concurrent checks, want only a few batches", single, batches, n)
	}
	t.Logf("%d concurrent checks went as %d CheckLimits calls", n, batches)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Check(context.Background(), client.Request{ClientKey: "u"}); !errors.Is(err, client.ErrClosed) {
		t.Errorf("Check after Close: %v, want ErrClosed", err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// deadAddr is a loopback address where nothing listens.
func deadAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// stuck is a RateLimiter that never answers before the caller gives up.
type stuck struct {
	ratelimitv1.UnimplementedRateLimiterServer
}

func (stuck) CheckLimit(ctx context.Context, _ *ratelimitv1.CheckLimitRequest) (*ratelimitv1.CheckLimitResponse, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func (stuck) CheckLimits(ctx context.Context, _ *ratelimitv1.CheckLimitsRequest) (*ratelimitv1.CheckLimitsResponse, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func stuckAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	ratelimitv1.RegisterRateLimiterServer(gs, stuck{})
	go gs.Serve(l)
	t.Cleanup(gs.Stop)
	return l.Addr().String()
}

// TestFailurePolicy: an enforcer that is down or too slow is answered by the
// policy, within the deadline, and never as an error.
func TestFailurePolicy(t *testing.T) {
	for _, tc := range []struct {
		name   string
		addr   func(*testing.T) string
		policy client.FailurePolicy
		batch  bool
	}{
		{"down open", deadAddr, client.FailOpen, false},
		{"down closed", deadAddr, client.FailClosed, false},
		{"slow open", stuckAddr, client.FailOpen, false},
		{"slow closed", stuckAddr, client.FailClosed, false},
		{"slow closed batching", stuckAddr, client.FailClosed, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := []client.Option{client.WithAddress(tc.addr(t)), client.WithFailurePolicy(tc.policy)}
			if tc.batch {
				opts = append(opts, client.WithBatching(10, time.Millisecond))
			}
			c, err := client.New(opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			want := tc.policy == client.FailOpen
			start := time.Now()
			d, err := c.Check(context.Background(), client.Request{ClientKey: "user:1"})
			took := time.Since(start)
			if err != nil {
				t.Fatal(err)
			}
			if d.Allowed != want || !errors.Is(d.Unreachable, client.ErrUnreachable) {
				t.Fatalf("decision %+v, want allowed=%v and Unreachable set", d, want)
			}
			// The default deadline is 25ms; slack for a loaded machine.
			if took > 2*time.Second {
				t.Errorf("answered after %v", took)
			}
			ds, err := c.CheckBatch(context.Background(), []client.Request{{ClientKey: "a"}, {ClientKey: "b"}})
			if err != nil || len(ds) != 2 || ds[0].Allowed != want || ds[1].Unreachable == nil {
				t.Fatalf("batch: %+v, %v", ds, err)
			}
		})
	}
}

func TestCallerContext(t *testing.T) {
	c := newClient(t, client.WithAddress(stuckAddr(t)))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.Check(ctx, client.Request{ClientKey: "u"}); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want the caller's context.Canceled", err)
	}
}

func TestOptions(t *testing.T) {
	for name, o := range map[string]client.Option{
		"empty address":  client.WithAddress(""),
		"nil tls":        client.WithTLS(nil),
		"zero timeout":   client.WithTimeout(0),
		"policy":         client.WithFailurePolicy(7),
		"batch of one":   client.WithBatching(1, time.Millisecond),
		"batch too big":  client.WithBatching(client.MaxBatch+1, time.Millisecond),
		"no batch wait":  client.WithBatching(10, 0),
		"nil connection": client.WithConn(nil),
	} {
		if _, err := client.New(o); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
}

// TestTLS: a client with WithTLS talks to an enforcer serving TLS, and a
// plaintext client cannot (so it is answered by the failure policy).
func TestTLS(t *testing.T) {
	cert, pool := selfSigned(t)
	e := startEnforcer(t, []rules.Rule{tokenBucket("orders", "POST /orders", 3)},
		grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})))
	c := newClient(t, client.WithAddress(e.addr), client.WithTLS(&tls.Config{RootCAs: pool, ServerName: "localhost"}))
	d, err := c.Check(context.Background(), client.Request{ClientKey: "user:1", Resource: "POST /orders"})
	if err != nil || !d.Allowed || d.RuleID != "orders" || d.Unreachable != nil {
		t.Fatalf("over TLS: %+v, %v", d, err)
	}
	plain := newClient(t, client.WithAddress(e.addr), client.WithTimeout(time.Second))
	if d, err := plain.Check(context.Background(), client.Request{ClientKey: "user:1", Resource: "POST /orders"}); err != nil || d.Unreachable == nil {
		t.Fatalf("plaintext to a TLS server: %+v, %v; want unreachable", d, err)
	}
}

func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "localhost"},
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, IsCA: true, BasicConstraintsValid: true,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}

// TestBatchingServerRefusal: a request only the enforcer can refuse (a cost
// above its maximum) fails alone; its neighbours in the batch are answered.
func TestBatchingServerRefusal(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("orders", "POST /orders", 100)})
	c := newClient(t, client.WithAddress(e.addr), client.WithBatching(10, 50*time.Millisecond))
	var wg sync.WaitGroup
	errs := make([]error, 10)
	ds := make([]client.Decision, 10)
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := client.Request{ClientKey: fmt.Sprintf("user:%d", i), Resource: "POST /orders"}
			if i == 3 {
				req.Cost = 5000 // the enforcer's default maximum is 1000
			}
			ds[i], errs[i] = c.Check(context.Background(), req)
		}()
	}
	wg.Wait()
	for i := range 10 {
		var re *client.RequestError
		switch {
		case i == 3 && (!errors.As(errs[i], &re) || re.Field != "cost"):
			t.Errorf("request 3: %v, want a RequestError naming cost", errs[i])
		case i != 3 && (errs[i] != nil || !ds[i].Allowed || ds[i].RuleID != "orders"):
			t.Errorf("request %d: %+v, %v", i, ds[i], errs[i])
		}
	}
}

// TestCheckBatchInvalidConsumesNothing: a batch longer than MaxBatch with an
// invalid request in a later chunk is refused before any chunk is sent, so
// no request of it is counted. Before, the first chunk was sent (and its
// tokens taken) before the second was refused.
func TestCheckBatchInvalidConsumesNothing(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("orders", "POST /orders", 5)})
	c := newClient(t, client.WithAddress(e.addr))
	ctx := context.Background()
	reqs := make([]client.Request, client.MaxBatch+1)
	for i := range reqs {
		reqs[i] = client.Request{ClientKey: "user:1", Resource: "POST /orders"}
	}
	reqs[client.MaxBatch].Cost = -1
	ds, err := c.CheckBatch(ctx, reqs)
	var re *client.RequestError
	if !errors.As(err, &re) || re.Index != client.MaxBatch || re.Field != "cost" || ds != nil {
		t.Fatalf("CheckBatch: %d decisions, %v; want none and a RequestError for request %d's cost", len(ds), err, client.MaxBatch)
	}
	if n := e.count("CheckLimits"); n != 0 {
		t.Errorf("enforcer saw %d CheckLimits calls for a batch with an invalid request, want 0", n)
	}
	if d, err := c.Check(ctx, reqs[0]); err != nil || !d.Allowed || d.Remaining != 4 {
		t.Fatalf("after the refused batch: %+v, %v; want allowed with 4 of 5 left (nothing taken)", d, err)
	}
}

// TestCheckBatchLaterChunkRefused: a request only the enforcer can refuse (a
// cost above its --max-cost) in a later chunk fails the call after earlier
// chunks were answered, and counted: CheckBatch returns their decisions
// with the error, so the caller knows which requests were counted.
func TestCheckBatchLaterChunkRefused(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("orders", "POST /orders", 2)})
	c := newClient(t, client.WithAddress(e.addr))
	reqs := make([]client.Request, 1500)
	for i := range reqs {
		reqs[i] = client.Request{ClientKey: fmt.Sprintf("user:%d", i), Resource: "POST /orders"}
	}
	reqs[1200].Cost = 5000 // the enforcer's default maximum is 1000
	ds, err := c.CheckBatch(context.Background(), reqs)
	var re *client.RequestError
	if !errors.As(err, &re) || re.Index != 1200 || re.Field != "cost" {
		t.Fatalf("err = %v, want a RequestError for request 1200's cost", err)
	}
	if len(ds) != client.MaxBatch {
		t.Fatalf("%d decisions with the error, want the first chunk's %d", len(ds), client.MaxBatch)
	}
	for i, d := range ds {
		if !d.Allowed || d.RuleID != "orders" || d.Remaining != 1 || d.Unreachable != nil {
			t.Fatalf("decision %d: %+v, want allowed by orders with 1 left", i, d)
		}
	}
	if n := e.count("CheckLimits"); n != 2 {
		t.Errorf("enforcer saw %d CheckLimits calls, want 2", n)
	}
}
