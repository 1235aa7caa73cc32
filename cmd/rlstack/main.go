// Command rlstack runs a complete local multi-region apportion stack in one
// process tree and prints its addresses; Ctrl-C stops everything and leaves
// nothing behind. See internal/stack.
//
//	rlstack [--regions N] [--load] [--view=false]
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/internal/stack"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "rlstack:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("rlstack", flag.ContinueOnError)
	fs.SetOutput(stderr)
	regions := fs.Int("regions", 3, "number of regions")
	verbose := fs.Bool("verbose", false, "show the components' logs")
	load := fs.Bool("load", false, "drive demo traffic on the global rule that moves between regions every 20s")
	view := fs.Bool("view", true, "print a live per-region view every second")
	embedded := fs.Bool("embedded-redis", false, "use an in-process miniredis per region even when redis-server is on PATH")
	if err := flagenv.Parse(fs, args, nil); err != nil {
		return err
	}
	cfg := stack.Config{Regions: *regions, EmbeddedRedis: *embedded}
	if *verbose {
		cfg.LogWriter = stderr
	}
	fmt.Fprintln(stdout, "starting the local stack ...")
	s, err := stack.Start(ctx, cfg)
	if err != nil {
		return err
	}
	fmt.Fprint(stdout, s.Summary())
	fmt.Fprintln(stdout, "\nCtrl-C stops everything.")
	done := make(chan struct{}, 2)
	if *load {
		go func() { s.Load(ctx); done <- struct{}{} }()
	} else {
		done <- struct{}{}
	}
	if *view {
		go func() { s.View(ctx, stdout, time.Second); done <- struct{}{} }()
	} else {
		done <- struct{}{}
	}
	<-ctx.Done()
	<-done
	<-done
	fmt.Fprintln(stdout, "stopping ...")
	return s.Close()
}
