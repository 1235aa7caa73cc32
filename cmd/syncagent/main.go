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
	"io"

	"github.com/apportion/apportion/internal/command"
	"github.com/apportion/apportion/sync/agentd"
)

func main() { command.Main("syncagent", run, nil) }

// run answers --version and -h itself (exit 0) and otherwise runs the agent
// until ctx is done.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return command.Daemon("syncagent", agentd.RunCommand)(ctx, args, stdout, stderr)
}
