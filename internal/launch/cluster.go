package launch

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrNoRedisCLI means redis-cli is not on PATH (it builds the cluster).
var ErrNoRedisCLI = errors.New("launch: redis-cli not found on PATH; install it (Debian/Ubuntu: apt-get install redis-tools, macOS: brew install redis)")

// Cluster is a Redis Cluster of redis-server children on loopback ports:
// Masters[i] serves a third (for three masters) of the 16384 slots and
// Replicas[i] replicates Masters[i]. Nodes keep nothing on disk but their
// nodes.conf, in their own directory.
type Cluster struct {
	Masters  []*Redis
	Replicas []*Redis // Replicas[i] replicates Masters[i]; empty without replicas
	Dir      string
}

// Addrs are the addresses of every node, masters first: the seed list for a
// cluster client.
func (c *Cluster) Addrs() []string {
	var out []string
	for _, r := range c.Nodes() {
		out = append(out, r.Addr)
	}
	return out
}

// Nodes are every node, masters first.
func (c *Cluster) Nodes() []*Redis { return append(append([]*Redis(nil), c.Masters...), c.Replicas...) }

// Stop kills every node. Safe to call twice.
func (c *Cluster) Stop() {
	for _, r := range c.Nodes() {
		r.Stop()
	}
}

// StartCluster starts masters redis-servers with --cluster-enabled yes (and,
// with replicas, one replica per master), joins them with redis-cli
// --cluster create (the slots split evenly among the masters), and waits
// until every node reports cluster_state:ok and every replica is in sync. Each
// node's cluster bus gets its own free port (--cluster-port), so nothing
// depends on port+10000 being free.
func StartCluster(dir string, masters int, replicas bool) (*Cluster, error) {
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		return nil, ErrNoRedisCLI
	}
	if masters < 3 {
		return nil, fmt.Errorf("launch: a Redis Cluster needs at least 3 masters, got %d", masters)
	}
	n := masters
	if replicas {
		n *= 2
	}
	c := &Cluster{Dir: dir}
	var nodes []*Redis
	for i := 0; i < n; i++ {
		r, err := startClusterNode(filepath.Join(dir, fmt.Sprintf("node-%d", i)))
		if err != nil {
			for _, r := range nodes {
				r.Stop()
			}
			return nil, err
		}
		nodes = append(nodes, r)
	}
	c.Masters = nodes[:masters]
	c.Replicas = nodes[masters:]
	args := []string{"--cluster", "create"}
	for _, r := range nodes {
		args = append(args, r.Addr)
	}
	if replicas {
		args = append(args, "--cluster-replicas", "1")
	}
	args = append(args, "--cluster-yes")
	out, err := exec.Command(cli, args...).CombinedOutput()
	if err != nil {
		c.Stop()
		return nil, fmt.Errorf("launch: redis-cli --cluster create: %v: %s", err, out)
	}
	if err := c.WaitOK(20 * time.Second); err != nil {
		c.Stop()
		return nil, err
	}
	if replicas {
		// redis-cli pairs replicas with masters itself: read who follows whom.
		if err := c.pairReplicas(); err != nil {
			c.Stop()
			return nil, err
		}
	}
	return c, nil
}

func startClusterNode(dir string) (*Redis, error) {
	return startRedisIn(dir, func() ([]string, error) {
		bus, err := FreePort()
		if err != nil {
			return nil, err
		}
		return []string{"--cluster-enabled", "yes", "--cluster-port", strconv.Itoa(bus),
			"--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
			"--cluster-replica-validity-factor", "0"}, nil
	})
}

// NodeCommand runs one command on the node at addr and returns its reply.
func NodeCommand(ctx context.Context, addr string, args ...any) (any, error) {
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: time.Second, ReadTimeout: 5 * time.Second,
		MaxRetries: -1, PoolSize: 1, DisableIdentity: true})
	defer c.Close()
	return c.Do(ctx, args...).Result()
}

func clusterInfo(addr string) string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	s, _ := NodeCommand(ctx, addr, "CLUSTER", "INFO")
	str, _ := s.(string)
	return str
}

// WaitOK waits until every running node reports cluster_state:ok with all
// slots assigned, and every running replica has its link to its master up
// (its first sync done).
func (c *Cluster) WaitOK(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var running []*Redis
		for _, r := range c.Nodes() {
			if r.PID() != 0 {
				running = append(running, r)
			}
		}
		bad := ""
		for _, r := range running {
			info := clusterInfo(r.Addr)
			if !strings.Contains(info, "cluster_state:ok") || !strings.Contains(info, "cluster_slots_assigned:16384") {
				bad = r.Addr + ": " + strings.ReplaceAll(info, "\r\n", " ")
				break
			}
		}
		for _, r := range c.Replicas {
			if bad != "" || r.PID() == 0 {
				break
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			v, _ := NodeCommand(ctx, r.Addr, "INFO", "replication")
			cancel()
			if info := fmt.Sprint(v); strings.Contains(info, "role:slave") && !strings.Contains(info, "master_link_status:up") {
				bad = r.Addr + ": replica not in sync"
			}
		}
		if bad == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("launch: cluster not ok within %v: %s", timeout, bad)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pairReplicas orders Replicas so that Replicas[i] follows Masters[i].
func (c *Cluster) pairReplicas() error {
	byID := map[string]int{}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i, m := range c.Masters {
		id, err := NodeCommand(ctx, m.Addr, "CLUSTER", "MYID")
		if err != nil {
			return fmt.Errorf("launch: cluster myid: %w", err)
		}
		byID[fmt.Sprint(id)] = i
	}
	paired := make([]*Redis, len(c.Masters))
	for _, r := range c.Replicas {
		info, err := NodeCommand(ctx, r.Addr, "CLUSTER", "NODES")
		if err != nil {
			return fmt.Errorf("launch: cluster nodes: %w", err)
		}
		for _, line := range strings.Split(fmt.Sprint(info), "\n") {
			f := strings.Fields(line)
			if len(f) > 3 && strings.Contains(f[2], "myself") && strings.Contains(f[2], "slave") {
				i, ok := byID[f[3]]
				if !ok || paired[i] != nil {
					return fmt.Errorf("launch: replica %s follows %s, not one master each", r.Addr, f[3])
				}
				paired[i] = r
			}
		}
	}
	for i, r := range paired {
		if r == nil {
			return fmt.Errorf("launch: master %s has no replica", c.Masters[i].Addr)
		}
	}
	c.Replicas = paired
	return nil
}

// MigrateSlot moves slot from the master at src to the master at dst the way
// redis-cli --cluster reshard does: IMPORTING on dst, MIGRATING on src, the
// keys moved in batches with MIGRATE, then SETSLOT NODE on both and on every
// other master. Clients meanwhile get ASK (or TRYAGAIN for a multi-key call
// whose keys are split) and, once it is done, MOVED.
func (c *Cluster) MigrateSlot(ctx context.Context, slot int, src, dst *Redis) error {
	id := func(r *Redis) (string, error) {
		v, err := NodeCommand(ctx, r.Addr, "CLUSTER", "MYID")
		return fmt.Sprint(v), err
	}
	srcID, err := id(src)
	if err != nil {
		return err
	}
	dstID, err := id(dst)
	if err != nil {
		return err
	}
	if _, err := NodeCommand(ctx, dst.Addr, "CLUSTER", "SETSLOT", slot, "IMPORTING", srcID); err != nil {
		return fmt.Errorf("launch: setslot importing: %w", err)
	}
	if _, err := NodeCommand(ctx, src.Addr, "CLUSTER", "SETSLOT", slot, "MIGRATING", dstID); err != nil {
		return fmt.Errorf("launch: setslot migrating: %w", err)
	}
	for {
		v, err := NodeCommand(ctx, src.Addr, "CLUSTER", "GETKEYSINSLOT", slot, 10)
		if err != nil {
			return fmt.Errorf("launch: getkeysinslot: %w", err)
		}
		keys, _ := v.([]any)
		if len(keys) == 0 {
			break
		}
		args := []any{"MIGRATE", "127.0.0.1", dst.Port, "", 0, 5000, "KEYS"}
		args = append(args, keys...)
		if _, err := NodeCommand(ctx, src.Addr, args...); err != nil {
			return fmt.Errorf("launch: migrate: %w", err)
		}
	}
	for _, r := range append([]*Redis{dst, src}, c.Masters...) {
		if r.PID() == 0 {
			continue
		}
		if _, err := NodeCommand(ctx, r.Addr, "CLUSTER", "SETSLOT", slot, "NODE", dstID); err != nil && r != src && r != dst {
			continue // a replica-turned-master or a master that learns it by gossip
		} else if err != nil {
			return fmt.Errorf("launch: setslot node on %s: %w", r.Addr, err)
		}
	}
	return nil
}
