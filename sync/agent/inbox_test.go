package agent

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

// TestInboxBudget: past its budget the inbox drops the oldest messages of
// the sender holding the most bytes, never a sender's newest, and the loop
// reads what is left in arrival order.
func TestInboxBudget(t *testing.T) {
	b := newInbox()
	msg := func(from string, n int, tag byte) queuedReport {
		return queuedReport{from: from, data: bytes.Repeat([]byte{tag}, n)}
	}
	const mb = 1 << 20
	// Budget for two senders: 2 x max(4 MiB, 5/4 x 4 MiB) = 10 MiB.
	pub := int64(4 * mb)
	if d := b.push(msg("x", 3*mb, 1), pub); len(d) != 0 {
		t.Fatalf("dropped %d under the budget", len(d))
	}
	if d := b.push(msg("y", 1*mb, 2), pub); len(d) != 0 {
		t.Fatalf("dropped %d under the budget", len(d))
	}
	if d := b.push(msg("x", 3*mb, 3), pub); len(d) != 0 { // 7 MiB
		t.Fatalf("dropped %d under the budget", len(d))
	}
	// x floods: its oldest goes, y's message stays.
	d := b.push(msg("x", 4*mb, 4), pub) // 11 MiB
	if len(d) != 1 || d[0].from != "x" || d[0].data[0] != 1 {
		t.Fatalf("dropped %v, want x's oldest", d)
	}
	// One message larger than the budget alone is kept (a sender's newest).
	d = b.push(msg("y", 20*mb, 5), pub)
	if len(d) != 2 || d[0].data[0] != 2 || d[1].data[0] != 3 {
		t.Fatalf("dropped %d, want y's older one (y holds the most), then x's", len(d))
	}
	var got []byte
	for {
		q, ok := b.pop()
		if !ok {
			break
		}
		got = append(got, q.data[0])
	}
	if !bytes.Equal(got, []byte{4, 5}) || b.queued() != 0 {
		t.Fatalf("popped %v (queued %d), want [4 5]", got, b.queued())
	}
	select {
	case <-b.ready:
	default:
		t.Fatal("no ready signal after pushes")
	}
}

// TestInboxSenders: a sender whose messages are all taken is forgotten,
// and the messages of many senders are bounded in number (maxQueued).
func TestInboxSenders(t *testing.T) {
	b := newInbox()
	for i := 0; i < 2*maxQueued; i++ {
		b.push(queuedReport{from: fmt.Sprint("s", i), data: []byte{1}}, 0)
	}
	if b.n != maxQueued || len(b.senders) != maxQueued {
		t.Fatalf("%d messages of %d senders queued, want %d", b.n, len(b.senders), maxQueued)
	}
	q, _ := b.pop()
	if q.from != fmt.Sprint("s", maxQueued) { // the oldest of those left
		t.Fatalf("popped %q first", q.from)
	}
	for {
		if _, ok := b.pop(); !ok {
			break
		}
	}
	if len(b.senders) != 0 || b.queued() != 0 {
		t.Fatalf("%d senders, %d bytes left", len(b.senders), b.queued())
	}
}

// TestPublishedCountsEveryMessage: the inbox's budget follows the bytes the
// agent published in a tick, every message counted. A report of more than
// driver.SendWindow keys leaves as one Publish per part; when only the
// largest message counted, the budget stayed at its 4 MiB minimum where a
// full report at 1,000,000 keys is about 42 MB, and the peers dropped its
// parts (BenchmarkAgent1MKeys: 1,946 report messages dropped as overflow,
// 84 before reports were sent a part at a time).
func TestPublishedCountsEveryMessage(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts a NATS super-cluster, etcd and the agents")
	}
	s := contractStack(t)
	a := s.regions["a"].agent
	lists, err := wire.NewRegions(s.names)
	if err != nil {
		t.Fatal(err)
	}
	// A rule no peer knows: they drop it (unknown_rule), nothing changes.
	msg := func(keys int) wire.Message {
		rep := ledger.Report{From: "a", Inc: 1, Seq: 1}
		for i := range keys {
			rep.Keys = append(rep.Keys, ledger.KeyReport{Key: fmt.Sprintf("k%03d", i), Demand: 1, Position: 1})
		}
		return wire.Message{From: "a", Rules: []wire.RuleReport{{Rule: "no-such-rule", Regions: lists, Report: rep}}}
	}
	type result struct{ published, sent int64 }
	done := make(chan result, 1)
	// On the agent's loop, as the driver publishes: two messages in a row.
	a.post(context.Background(), func(context.Context) {
		a.published = 0
		before := metricValue(a.m.bytes.WithLabelValues("sent"))
		p := ports{a}
		p.Publish(msg(40))
		p.Publish(msg(3))
		done <- result{a.published, int64(metricValue(a.m.bytes.WithLabelValues("sent")) - before)}
	})
	var r result
	select {
	case r = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the agent's loop did not run the publish")
	}
	if r.sent <= 0 || r.published != r.sent {
		t.Fatalf("counted %d bytes published for the inbox's budget, %d sent in the two messages", r.published, r.sent)
	}
}
