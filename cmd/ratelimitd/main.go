// Command ratelimitd is the regional enforcer: it answers CheckLimit over
// gRPC and HTTP from token buckets in Redis.
//
//	ratelimitd --region NAME --redis-addr HOST:PORT --grpc-addr ADDR --http-addr ADDR
//	           [--rules FILE | --etcd-endpoints URLS] [--nats-url URL]
//	ratelimitd --version
//
// Every flag also reads APPORTION_<FLAG> (upper snake case). It prints one
// line "ready grpc=ADDR http=ADDR" once it serves a rule set (its ports
// answer /healthz, and /readyz 503, before). See regional/enforcerd.
package main

import (
	"context"
	"io"

	"github.com/apportion/apportion/internal/command"
	"github.com/apportion/apportion/regional/enforcerd"
)

func main() { command.Main("ratelimitd", run, nil) }

// run answers --version and -h itself (exit 0) and otherwise runs the
// enforcer until ctx is done.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return command.Daemon("ratelimitd", enforcerd.Run)(ctx, args, stdout, stderr)
}
