// Command syncagent is a region's sync agent: it moves shares of global
// limits between regions (see package sync/agent and DESIGN.md section 6).
//
//	syncagent --region NAME --redis-addr HOST:PORT --nats-url URL --etcd-endpoints URLS
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/apportion/apportion/sync/agent"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := agent.RunCommand(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
