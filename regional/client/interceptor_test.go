package client_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/regional/client"
	"github.com/apportion/apportion/rules"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// echoDesc is a user's gRPC service: demo.Echo with a unary Echo and a
// server-streaming Repeat, written by hand so the test needs no generated code.
var echoDesc = grpc.ServiceDesc{
	ServiceName: "demo.Echo",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{MethodName: "Echo", Handler: func(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
		in := &wrapperspb.StringValue{}
		if err := dec(in); err != nil {
			return nil, err
		}
		h := func(ctx context.Context, req any) (any, error) { return req, nil }
		if ic == nil {
			return h(ctx, in)
		}
		return ic(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: "/demo.Echo/Echo"}, h)
	}}},
	Streams: []grpc.StreamDesc{{StreamName: "Repeat", ServerStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
		in := &wrapperspb.StringValue{}
		if err := ss.RecvMsg(in); err != nil {
			return err
		}
		return ss.SendMsg(in)
	}}},
}

// startEcho serves demo.Echo (and the health service) behind the
// interceptors of c.
func startEcho(t *testing.T, c *client.Client, opts ...client.InterceptorOption) *grpc.ClientConn {
	t.Helper()
	gs := grpc.NewServer(grpc.UnaryInterceptor(c.UnaryServerInterceptor(opts...)),
		grpc.StreamInterceptor(c.StreamServerInterceptor(opts...)))
	gs.RegisterService(&echoDesc, struct{}{})
	healthpb.RegisterHealthServer(gs, health.NewServer())
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(l)
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func echo(conn *grpc.ClientConn, apiKey string) (metadata.MD, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if apiKey != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "x-api-key", apiKey)
	}
	var hdr metadata.MD
	out := &wrapperspb.StringValue{}
	err := conn.Invoke(ctx, "/demo.Echo/Echo", wrapperspb.String("hi"), out, grpc.Header(&hdr))
	if err == nil && out.GetValue() != "hi" {
		err = errors.New("echo answered " + out.GetValue())
	}
	return hdr, err
}

func TestUnaryInterceptor(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("echo", "/demo.Echo/Echo", 2)})
	c := newClient(t, client.WithAddress(e.addr))
	conn := startEcho(t, c, client.WithKey(client.KeyFromMetadata("x-api-key")))
	for i := range 2 {
		hdr, err := echo(conn, "key-a")
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if got := hdr.Get("x-ratelimit-remaining"); len(got) != 1 || got[0] != []string{"1", "0"}[i] {
			t.Errorf("call %d: x-ratelimit-remaining %v", i, got)
		}
	}
	hdr, err := echo(conn, "key-a")
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted {
		t.Fatalf("3rd call: %v, want ResourceExhausted", err)
	}
	var retry *errdetails.RetryInfo
	var quota *errdetails.QuotaFailure
	for _, d := range st.Details() {
		switch v := d.(type) {
		case *errdetails.RetryInfo:
			retry = v
		case *errdetails.QuotaFailure:
			quota = v
		}
	}
	if retry == nil || retry.GetRetryDelay().AsDuration() < 90*time.Second {
		t.Errorf("RetryInfo %v, want a delay of about 100s", retry)
	}
	if quota == nil || quota.GetViolations()[0].GetSubject() != "rule:echo" {
		t.Errorf("QuotaFailure %v, want rule:echo", quota)
	}
	if got := hdr.Get("retry-after"); len(got) != 1 || got[0] != "100" {
		t.Errorf("retry-after header %v, want 100", got)
	}
	// Another key, and the health service (exempt by default), still pass.
	if _, err := echo(conn, "key-b"); err != nil {
		t.Errorf("key-b: %v", err)
	}
	for range 3 {
		if _, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatalf("health: %v", err)
		}
	}
	// A streaming call is checked once when it opens: key-a is out of tokens.
	stream, err := conn.NewStream(context.Background(), &echoDesc.Streams[0], "/demo.Echo/Repeat")
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.SendMsg(wrapperspb.String("x")); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	stream.CloseSend()
	// The stream's resource is /demo.Echo/Repeat, which no rule matches.
	if err := stream.RecvMsg(&wrapperspb.StringValue{}); err != nil {
		t.Errorf("Repeat: %v", err)
	}
}

func TestStreamInterceptorRejects(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("repeat", "/demo.Echo/Repeat", 1)})
	c := newClient(t, client.WithAddress(e.addr))
	conn := startEcho(t, c)
	for i, want := range []codes.Code{codes.OK, codes.ResourceExhausted} {
		stream, err := conn.NewStream(context.Background(), &echoDesc.Streams[0], "/demo.Echo/Repeat")
		if err != nil {
			t.Fatal(err)
		}
		stream.SendMsg(wrapperspb.String("x"))
		stream.CloseSend()
		err = stream.RecvMsg(&wrapperspb.StringValue{})
		if status.Code(err) != want {
			t.Errorf("stream %d: %v, want %v", i, err, want)
		}
	}
}

// TestInterceptorEnforcerDown: the client's failure policy decides.
func TestInterceptorEnforcerDown(t *testing.T) {
	for _, tc := range []struct {
		policy client.FailurePolicy
		want   codes.Code
	}{{client.FailOpen, codes.OK}, {client.FailClosed, codes.Unavailable}} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			c := newClient(t, client.WithAddress(deadAddr(t)), client.WithFailurePolicy(tc.policy), client.WithTimeout(time.Second))
			conn := startEcho(t, c)
			if _, err := echo(conn, ""); status.Code(err) != tc.want {
				t.Fatalf("echo: %v, want %v", err, tc.want)
			}
		})
	}
}

// TestInterceptorWaitingCannotHelp: a call whose cost the rule can never
// admit is refused without RetryInfo or retry-after, so clients do not retry.
func TestInterceptorWaitingCannotHelp(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("echo", "/demo.Echo/Echo", 2)})
	c := newClient(t, client.WithAddress(e.addr))
	conn := startEcho(t, c, client.WithCost(func(context.Context, string) int64 { return 3 }))
	hdr, err := echo(conn, "")
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), "waiting cannot help") {
		t.Fatalf("cost 3 of capacity 2: %v, want ResourceExhausted saying waiting cannot help", err)
	}
	for _, d := range st.Details() {
		if _, ok := d.(*errdetails.RetryInfo); ok {
			t.Errorf("RetryInfo %v on a rejection waiting cannot cure", d)
		}
	}
	if got := hdr.Get("retry-after"); len(got) != 0 {
		t.Errorf("retry-after %v on a rejection waiting cannot cure", got)
	}
}

// TestInterceptorHeaders: the interceptor's rate-limit metadata is what the
// HTTP API and the HTTP middleware write (regional/header), in lower case.
// Before, a call that only a shadow rule matched carried x-ratelimit-limit,
// -remaining and -reset although every call is allowed, and an answer of
// the enforcer's failure policy (its Redis down) a remaining of 0 and a
// reset of 0 that a client pacing itself on them takes for the bucket's.
func TestInterceptorHeaders(t *testing.T) {
	rateHeaders := []string{"x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset", "ratelimit-policy", "ratelimit", "retry-after"}
	check := func(t *testing.T, hdr metadata.MD, want map[string]string) {
		t.Helper()
		for _, k := range rateHeaders {
			got := hdr.Get(k)
			if w, ok := want[k]; ok && (len(got) != 1 || got[0] != w) {
				t.Errorf("%s = %q, want %q", k, got, w)
			} else if !ok && len(got) != 0 {
				t.Errorf("%s = %q, want none", k, got)
			}
		}
	}
	t.Run("enforced", func(t *testing.T) {
		e := startEnforcer(t, []rules.Rule{tokenBucket("echo", "/demo.Echo/Echo", 2)})
		c := newClient(t, client.WithAddress(e.addr))
		hdr, err := echo(startEcho(t, c), "")
		if err != nil {
			t.Fatal(err)
		}
		// A bucket of 2 refilling 0.01 tokens a second: 100s to refill a
		// token, 200s from empty.
		check(t, hdr, map[string]string{"x-ratelimit-limit": "2", "x-ratelimit-remaining": "1", "x-ratelimit-reset": "100",
			"ratelimit-policy": `"echo";q=2;w=200`, "ratelimit": `"echo";r=1;t=100`})
	})
	t.Run("shadow only", func(t *testing.T) {
		shadow := tokenBucket("echo", "/demo.Echo/Echo", 1)
		shadow.Shadow = true
		e := startEnforcer(t, []rules.Rule{shadow})
		c := newClient(t, client.WithAddress(e.addr))
		conn := startEcho(t, c)
		for i := range 2 { // the second is over the shadow rule's capacity, and allowed
			hdr, err := echo(conn, "")
			if err != nil {
				t.Fatalf("call %d: %v", i, err)
			}
			check(t, hdr, nil)
		}
	})
	t.Run("failure policy", func(t *testing.T) {
		e, r := startEnforcerRedis(t, []rules.Rule{tokenBucket("echo", "/demo.Echo/Echo", 2)})
		c := newClient(t, client.WithAddress(e.addr))
		conn := startEcho(t, c)
		if _, err := echo(conn, ""); err != nil {
			t.Fatal(err)
		}
		r.Stop() // the rule fails open: allowed, fail_open
		hdr, err := echo(conn, "")
		if err != nil {
			t.Fatal(err)
		}
		check(t, hdr, map[string]string{"x-ratelimit-limit": "2", "ratelimit-policy": `"echo";q=2;w=200`})
	})
}
