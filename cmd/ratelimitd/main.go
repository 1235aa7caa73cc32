// Command ratelimitd is the regional enforcer: it answers CheckLimit over
// gRPC and HTTP from token buckets in Redis.
//
//	ratelimitd --region NAME --redis-addr HOST:PORT --grpc-addr ADDR --http-addr ADDR
//	           [--rules FILE | --etcd-endpoints URLS] [--nats-url URL]
//	ratelimitd --version
//
// Every flag also reads APPORTION_<FLAG> (upper snake case). It prints one
// line "ready grpc=ADDR http=ADDR" once it serves. See regional/enforcerd.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/apportion/apportion/internal/version"
	"github.com/apportion/apportion/regional/enforcerd"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "ratelimitd:", err)
		os.Exit(1)
	}
}

// run answers --version and -h itself (exit 0) and otherwise runs the
// enforcer until ctx is done.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if version.Requested(args) {
		return version.Print(stdout, "ratelimitd")
	}
	err := enforcerd.Run(ctx, args, stdout, stderr)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stderr, version.FlagHelp)
		return nil
	}
	return err
}
