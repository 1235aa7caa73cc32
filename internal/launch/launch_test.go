package launch

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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
