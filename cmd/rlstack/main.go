// Command rlstack runs a complete local multi-region apportion stack in one
// process tree and prints its addresses; Ctrl-C stops everything and leaves
// nothing behind. See cmd/internal/stack.
//
//	rlstack [--regions N] [--load] [--faults=false] [--view=false] [--verbose] [--embedded-redis]
//	rlstack --version
//
// On a terminal it draws one screen and redraws it every second: the
// addresses (the sync agents' included) and ready commands pinned at the
// top, the live per-region figures below. When its output is not a terminal
// (a file, a pipe, CI), or with --verbose (the logs would tear the screen),
// it prints the addresses once and the figures as plain lines.
//
// With --faults (the default) it serves a fault control on a free loopback
// port and prints it: POST /faults/cut?region=R cuts region R's NATS
// gateways off from every other region (heal undoes it), restart-redis
// restarts its redis-server empty, stop-agent and start-agent stop its
// sync agent and start it again with no state; GET /faults shows what is
// cut or stopped. With --load running, the live figures show what each
// fault does to the global rule's shares.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/apportion/apportion/cmd/internal/stack"
	"github.com/apportion/apportion/internal/command"
	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/internal/tty"
	"github.com/apportion/apportion/internal/version"
)

func main() { command.Main("rlstack", run, nil) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if version.Requested(args) {
		return version.Print(stdout, "rlstack")
	}
	fs := flag.NewFlagSet("rlstack", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage of rlstack:")
		fs.PrintDefaults()
		fmt.Fprint(stderr, version.FlagHelp)
	}
	regions := fs.Int("regions", 3, fmt.Sprintf("number of regions, 1 to %d", len(stack.DefaultRegions)))
	verbose := fs.Bool("verbose", false, "show the components' logs (on stderr; the view prints plain lines then)")
	load := fs.Bool("load", false, "drive demo traffic on the global rule that moves between regions every 20s")
	view := fs.Bool("view", true, "show live per-region figures every second (redrawn in place on a terminal)")
	embedded := fs.Bool("embedded-redis", false, "use an in-process miniredis per region even when redis-server is on PATH")
	faults := fs.Bool("faults", true, "serve a fault control on a free loopback port (cut a region's gateways, restart its Redis, stop and start its sync agent) and print it")
	if err := flagenv.Parse(fs, args, nil); errors.Is(err, flag.ErrHelp) {
		return nil
	} else if err != nil {
		return err
	}
	cfg := stack.Config{Regions: *regions, EmbeddedRedis: *embedded}
	if *faults {
		cfg.Partitionable, cfg.FaultsAddr = true, "127.0.0.1:0"
	}
	if *verbose {
		cfg.LogWriter = stderr
	}
	fmt.Fprintln(stdout, "starting the local stack ...")
	s, err := stack.Start(ctx, cfg)
	if err != nil {
		return err
	}
	screen := *view && !*verbose && tty.Is(stdout)
	if !screen {
		fmt.Fprint(stdout, s.Summary())
		fmt.Fprintln(stdout, "\n"+stack.StopHint)
	}
	done := make(chan struct{}, 2)
	if *load {
		go func() { s.Load(ctx); done <- struct{}{} }()
	} else {
		done <- struct{}{}
	}
	switch {
	case screen:
		go func() { s.Screen(ctx, stdout, time.Second); done <- struct{}{} }()
	case *view:
		go func() { s.View(ctx, stdout, time.Second); done <- struct{}{} }()
	default:
		done <- struct{}{}
	}
	<-ctx.Done()
	<-done
	<-done
	fmt.Fprintln(stdout, "stopping ...")
	return s.Close()
}
