package agentd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/internal/backend"
	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/sync/agent"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// shardOf checks --shard against the layout in etcd and returns it with the
// layout's epoch: every region runs the layout etcd holds (agent.LayoutKey).
func shardOf(ctx context.Context, ec *clientv3.Client, sh agent.Shard) (agent.Shard, error) {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	l, _, err := agent.ReadLayout(cctx, ec)
	if err != nil {
		return agent.Shard{}, fmt.Errorf("etcd (--etcd-endpoints %s): reading the shard layout: %w", strings.Join(ec.Endpoints(), ","), err)
	}
	if n := max(sh.Count, 1); n != l.Shards {
		return agent.Shard{}, fmt.Errorf("%w: --shard %d/%d, but etcd's layout (%s) is %d shards per region in epoch %d: run that many, or change it with syncagent layout N once every agent is stopped (docs/operations.md, Shards)",
			agent.ErrLayout, sh.Index, n, agent.LayoutKey, l.Shards, l.Epoch)
	}
	sh.Count, sh.Epoch = l.Shards, l.Epoch
	return sh, nil
}

// leaderKey is the standby election of region's shard sh: each shard of a
// region has its own leader.
func leaderKey(region string, sh agent.Shard) string {
	k := "/ratelimit/syncagent/" + region + "/leader"
	if sh.Count > 1 || sh.Epoch > 0 {
		k = "/ratelimit/syncagent/" + region + "/shard-" + strconv.Itoa(sh.Index) + "-of-" + strconv.Itoa(sh.Count) + "/leader"
	}
	return k
}

// layoutCommand is "syncagent layout [flags] [N]": it prints the layout in
// etcd and, with N, changes it to N shards per region in the next epoch.
func layoutCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var ec backend.Etcd
	fs := flag.NewFlagSet("syncagent layout", flag.ContinueOnError)
	fs.SetOutput(stderr)
	ec.Register(fs, "comma-separated etcd endpoints (required)")
	if err := flagenv.Parse(fs, args, nil); err != nil {
		return err
	}
	if ec.Endpoints == "" || fs.NArg() > 1 {
		return errors.New("usage: syncagent layout --etcd-endpoints URL [N] (prints the shard layout; with N, changes it to N shards per region: only with every agent of every region stopped, see docs/operations.md)")
	}
	cfg, err := ec.Config(5 * time.Second)
	if err != nil {
		return err
	}
	c, err := clientv3.New(cfg)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer c.Close()
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var l agent.Layout
	if fs.NArg() == 1 {
		n, err := strconv.Atoi(fs.Arg(0))
		if err != nil {
			return fmt.Errorf("layout: %q is not a number of shards", fs.Arg(0))
		}
		l, err = agent.ChangeLayout(cctx, c, n)
		if err != nil {
			return err
		}
	} else if l, _, err = agent.ReadLayout(cctx, c); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "shards=%d epoch=%d\n", l.Shards, l.Epoch)
	return nil
}
