package launch

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"
)

func TestRedisRestartSamePortNewProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("starts redis-server")
	}
	r, err := StartRedis(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Stop()
	pid, err := RedisPID(r.Addr)
	if err != nil || pid != r.PID() {
		t.Fatalf("RedisPID = %d, %v; want the started process %d", pid, err, r.PID())
	}
	if err := r.Restart(); err != nil {
		t.Fatal(err)
	}
	pid2, err := RedisPID(r.Addr)
	if err != nil || pid2 == pid || pid2 != r.PID() {
		t.Fatalf("after Restart: RedisPID = %d, %v; want a new process %d on the same port", pid2, err, r.PID())
	}
	r.Stop()
	r.Stop() // safe twice
	if _, err := RedisPID(r.Addr); err == nil {
		t.Fatal("Redis still answers after Stop")
	}
}

func TestEtcdRestartKeepsData(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd")
	}
	e, err := StartEtcd(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer e.Stop()
	c, err := e.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	e.Stop()
	if err := e.Restart(); err != nil {
		t.Fatal(err)
	}
	got, err := c.Get(ctx, "k")
	if err != nil || len(got.Kvs) != 1 || string(got.Kvs[0].Value) != "v" {
		t.Fatalf("after Restart: %v, %v; want k=v", got, err)
	}
}

func TestSuperClusterDialsThroughDialer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts NATS")
	}
	var dialled [][2]string
	cluster, err := StartSuperCluster([]string{"a", "b"}, SuperClusterOptions{Dial: func(from, to, addr string) (string, error) {
		dialled = append(dialled, [2]string{from, to})
		return addr, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, s := range cluster {
			s.Shutdown()
		}
	}()
	if len(dialled) != 2 {
		t.Fatalf("Dial called for %v; want a->b and b->a", dialled)
	}
	sub, err := nats.Connect(cluster["b"].ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ch := make(chan *nats.Msg, 1)
	if _, err := sub.ChanSubscribe("x", ch); err != nil {
		t.Fatal(err)
	}
	sub.Flush()
	for !cluster["a"].HasGatewayInterest("b", "x") {
		time.Sleep(5 * time.Millisecond)
	}
	pub, err := nats.Connect(cluster["a"].ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	pub.Publish("x", []byte("hi"))
	select {
	case m := <-ch:
		if string(m.Data) != "hi" {
			t.Fatalf("got %q", m.Data)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("message did not cross the gateway")
	}
}

func TestSuperClusterRefusesDuplicateRegion(t *testing.T) {
	if _, err := StartSuperCluster([]string{"a", "a"}, SuperClusterOptions{}); err == nil {
		t.Fatal("duplicate region accepted")
	}
}

func TestClusterStarts(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a redis cluster")
	}
	c, err := StartCluster(t.TempDir(), 3, true)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i, r := range c.Replicas {
		info, err := NodeCommand(ctx, r.Addr, "INFO", "replication")
		if err != nil || !strings.Contains(info.(string), "master_port:"+strconv.Itoa(c.Masters[i].Port)) {
			t.Fatalf("replica %d (%s) does not follow master %s: %v %v", i, r.Addr, c.Masters[i].Addr, info, err)
		}
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer cc.Close()
	for i := 0; i < 50; i++ {
		if err := cc.Set(ctx, "k"+strconv.Itoa(i), i, 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	n := 0
	for _, m := range c.Masters {
		v, err := NodeCommand(ctx, m.Addr, "DBSIZE")
		if err != nil {
			t.Fatal(err)
		}
		if v.(int64) == 0 {
			t.Errorf("master %s holds none of 50 keys", m.Addr)
		}
		n += int(v.(int64))
	}
	if n != 50 {
		t.Fatalf("masters hold %d keys, want 50", n)
	}
	c.Stop()
	c.Stop()
}
