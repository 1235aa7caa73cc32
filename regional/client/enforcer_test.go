package client_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
)

// enforcer is a real enforcer (package regional over a redis-server started
// by testutil) served over gRPC on a loopback port. calls counts the
// RateLimiter calls it received by method name (CheckLimit, CheckLimits).
type enforcer struct {
	addr  string
	enf   *regional.Enforcer
	mu    sync.Mutex
	calls map[string]int
}

func (e *enforcer) count(method string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.calls[method]
}

func startEnforcer(t *testing.T, rs []rules.Rule, opts ...grpc.ServerOption) *enforcer {
	t.Helper()
	e, _ := startEnforcerRedis(t, rs, opts...)
	return e
}

// startEnforcerRedis is startEnforcer that also returns the enforcer's
// redis-server, to stop it.
func startEnforcerRedis(t *testing.T, rs []rules.Rule, opts ...grpc.ServerOption) (*enforcer, *testutil.Redis) {
	t.Helper()
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	r := testutil.StartRedis(t)
	rc := redis.NewClient(&redis.Options{Addr: r.Addr})
	t.Cleanup(func() { rc.Close() })
	e, stop, err := serveEnforcer(rc, rs, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return e, r
}

// serveEnforcer serves an enforcer on rc at a free loopback port; stop
// stops it.
func serveEnforcer(rc redis.UniversalClient, rs []rules.Rule, opts ...grpc.ServerOption) (*enforcer, func(), error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	return serveEnforcerOn(l, rc, rs, opts...)
}

// serveEnforcerOn is serveEnforcer on l, which it closes on failure.
func serveEnforcerOn(l net.Listener, rc redis.UniversalClient, rs []rules.Rule, opts ...grpc.ServerOption) (*enforcer, func(), error) {
	st, err := redisstore.New(rc)
	if err != nil {
		l.Close()
		return nil, nil, err
	}
	cfg := regional.DefaultConfig()
	cfg.Region = "us-east"
	cfg.Timeout = time.Second // generous: the CI machine is small and shared
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	enf, err := regional.New(cfg, st)
	if err != nil {
		l.Close()
		st.Close()
		return nil, nil, err
	}
	for i := range rs {
		rs[i].Normalize()
		if err := rs[i].Validate(); err != nil {
			l.Close()
			st.Close()
			return nil, nil, err
		}
	}
	if err := enf.SetRules(rs); err != nil {
		l.Close()
		st.Close()
		return nil, nil, err
	}
	e := &enforcer{enf: enf, calls: map[string]int{}}
	count := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		e.mu.Lock()
		e.calls[info.FullMethod[strings.LastIndex(info.FullMethod, "/")+1:]]++
		e.mu.Unlock()
		return h(ctx, req)
	}
	gs, svc := regional.NewGRPCServer(enf, append([]grpc.ServerOption{grpc.ChainUnaryInterceptor(count)}, opts...)...)
	svc.SetServing(true)
	e.addr = l.Addr().String()
	done := make(chan struct{})
	go func() { defer close(done); gs.Serve(l) }()
	return e, func() { gs.Stop(); <-done; st.Close() }, nil
}

func tokenBucket(id, resource string, capacity int64) rules.Rule {
	// A refill so slow that no token comes back during a test.
	return rules.Rule{ID: id, Match: map[string]string{"resource": resource}, Algorithm: rules.TokenBucket,
		Capacity: capacity, RefillPerSecond: 0.01}
}

// enforcerAddr is the gRPC address of the enforcer the examples ask: one on
// an in-process miniredis, started by TestMain (examples cannot start a
// redis-server through testutil, which needs a testing.TB).
var enforcerAddr string

func TestMain(m *testing.M) {
	mr := miniredis.NewMiniRedis()
	mr.ClockTTL(true)
	if err := mr.StartAddr("127.0.0.1:0"); err != nil {
		panic(err)
	}
	rc := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	e, stop, err := serveEnforcer(rc, []rules.Rule{
		tokenBucket("orders", "POST /orders", 3),
		tokenBucket("echo", "/demo.Echo/Echo", 1),
	})
	if err != nil {
		panic(err)
	}
	enforcerAddr = e.addr
	code := m.Run()
	stop()
	rc.Close()
	mr.Close()
	os.Exit(code)
}
