package main

import (
	"context"
	"fmt"
	"io"
	"net"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/enforcerd"
	"google.golang.org/grpc"
)

// noopServer allows every check and does nothing else: the ceiling of a
// ratelimit.v1 server on this machine, for comparison.
type noopServer struct {
	ratelimitv1.UnimplementedRateLimiterServer
}

func (noopServer) CheckLimit(context.Context, *ratelimitv1.CheckLimitRequest) (*ratelimitv1.CheckLimitResponse, error) {
	return &ratelimitv1.CheckLimitResponse{Allowed: true}, nil
}

func (noopServer) CheckLimits(_ context.Context, in *ratelimitv1.CheckLimitsRequest) (*ratelimitv1.CheckLimitsResponse, error) {
	out := &ratelimitv1.CheckLimitsResponse{Responses: make([]*ratelimitv1.CheckLimitResponse, len(in.GetRequests()))}
	for i := range out.Responses {
		out.Responses[i] = &ratelimitv1.CheckLimitResponse{Allowed: true}
	}
	return out, nil
}

// serveNoop serves noopServer on addr until ctx is done. It prints
// "ready grpc=ADDR" once it listens, as ratelimitd does.
func serveNoop(ctx context.Context, addr string, stdout io.Writer) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	// The same gRPC and runtime settings as ratelimitd's defaults: the
	// ceiling is a server tuned alike, doing no work.
	enforcerd.SetGCPercent(enforcerd.DefaultGCPercent)
	s := grpc.NewServer(grpc.NumStreamWorkers(enforcerd.DefaultStreamWorkers))
	ratelimitv1.RegisterRateLimiterServer(s, noopServer{})
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(l) }()
	fmt.Fprintf(stdout, "ready grpc=%s\n", l.Addr())
	select {
	case <-ctx.Done():
		s.GracefulStop()
		return nil
	case err := <-errc:
		return err
	}
}
