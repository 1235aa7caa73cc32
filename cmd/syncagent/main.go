// Command syncagent is a region's sync agent: it moves shares of global
// limits between regions (see package sync/agent and docs/design.md section 7).
//
//	syncagent --region NAME --redis-addr HOST:PORT --nats-url URL --etcd-endpoints URLS \
//	    --report-seed-file FILE --report-peer-keys REGION=PUBKEY,...
//	syncagent keygen FILE | pubkey FILE | keys DIR REGION...
//	syncagent --version
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
	"github.com/apportion/apportion/sync/agentd"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "syncagent:", err)
		os.Exit(1)
	}
}

// run answers --version and -h itself (exit 0) and otherwise runs the agent
// until ctx is done.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if version.Requested(args) {
		return version.Print(stdout, "syncagent")
	}
	err := agentd.RunCommand(ctx, args, stdout, stderr)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stderr, version.FlagHelp)
		return nil
	}
	return err
}
