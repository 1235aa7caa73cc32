// Package command holds what every binary's main shares, so that each
// cmd/<binary>/main.go is one line over its run function: the signal
// handling (SIGINT and SIGTERM cancel run's context, a second one kills the
// process as usual), the error line and the exit code, and, for the
// daemons, the answers to --version and -h.
package command

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
)

// Run is a binary's testable body: it runs with args (os.Args[1:]) until
// ctx is done or its work ends.
type Run func(ctx context.Context, args []string, stdout, stderr io.Writer) error

// Main runs run with a context that SIGINT and SIGTERM cancel and exits: 0
// when run returns nil, otherwise it prints "name: error" on stderr and
// exits with code(err) (1 when code is nil).
func Main(name string, run Run, code func(error) int) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err == nil {
		return
	}
	fmt.Fprintln(os.Stderr, name+":", err)
	if code == nil {
		os.Exit(1)
	}
	os.Exit(code(err))
}

// Daemon wraps a daemon's run: --version prints the version and -h the
// flags (both exit 0) instead of running it.
func Daemon(name string, run Run) Run {
	return func(ctx context.Context, args []string, stdout, stderr io.Writer) error {
		if version.Requested(args) {
			return version.Print(stdout, name)
		}
		err := run(ctx, args, stdout, stderr)
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stderr, version.FlagHelp)
			return nil
		}
		return err
	}
}
