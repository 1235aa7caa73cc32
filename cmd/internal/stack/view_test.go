package stack

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
)

// fakeStack has addresses where nothing listens: the views show n/a.
func fakeStack() *Stack {
	return &Stack{EtcdEndpoint: "http://127.0.0.1:1", AdminToken: "tok", Dir: "/tmp/x", Regions: []Region{
		{Name: "us-east", GRPCAddr: "127.0.0.1:2", HTTPAddr: "127.0.0.1:3", RedisAddr: "127.0.0.1:4", NATSURL: "nats://127.0.0.1:5", AdminAddr: "127.0.0.1:6", AgentHTTPAddr: "127.0.0.1:7"},
		{Name: "eu-west", GRPCAddr: "127.0.0.1:12", HTTPAddr: "127.0.0.1:13", RedisAddr: "127.0.0.1:14", NATSURL: "nats://127.0.0.1:15"},
	}}
}

func TestSummaryNamesAgents(t *testing.T) {
	s := fakeStack()
	sum := s.Summary()
	for _, want := range []string{"sync agent", "127.0.0.1:7\n", "nats://127.0.0.1:15        -\n",
		"go run ./cmd/rlctl --admin-url http://127.0.0.1:6 --token tok limits show user-global --agents us-east=http://127.0.0.1:7\n"} {
		if !strings.Contains(sum, want) {
			t.Errorf("summary lacks %q:\n%s", want, sum)
		}
	}
	s.Regions[0].AgentHTTPAddr = ""
	if strings.Contains(s.Summary(), "limits show") || s.LimitsShowCommand() != "" {
		t.Errorf("limits show line without agents:\n%s", s.Summary())
	}
}

func TestScreenRedrawsViewScrolls(t *testing.T) {
	s := fakeStack()
	run := func(view func(context.Context, *testutil.SyncBuffer)) string {
		var out testutil.SyncBuffer
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { view(ctx, &out); close(done) }()
		testutil.WaitFor(t, 10*time.Second, "three tables", func() bool { return strings.Count(out.String(), "checks/s") >= 3 })
		cancel()
		<-done
		return out.String()
	}
	plain := run(func(ctx context.Context, w *testutil.SyncBuffer) { s.View(ctx, w, 10*time.Millisecond) })
	if strings.Contains(plain, "\x1b") || strings.Contains(plain, "apportion local stack") {
		t.Errorf("View: control sequences or the summary in plain lines:\n%q", plain)
	}
	screen := run(func(ctx context.Context, w *testutil.SyncBuffer) { s.Screen(ctx, w, 10*time.Millisecond) })
	if !strings.HasPrefix(screen, ansiHideCursor+ansiHome+ansiClear) || !strings.HasSuffix(screen, ansiClearBelow+ansiShowCursor) {
		t.Errorf("Screen: not cleared first, or cursor not restored at the end:\n%q", screen)
	}
	frames := strings.Split(screen, ansiHome)[2:] // after the clear: the first draw, then one frame per tick
	for i, f := range frames {
		if !strings.HasPrefix(f, "apportion local stack: 2 regions") || !strings.Contains(f, StopHint+ansiClearLine+"\n"+ansiClearBelow) {
			t.Fatalf("frame %d does not start with the addresses and end with the hint:\n%q", i, f)
		}
		if i > 0 && !strings.Contains(f, "n/a (no traffic coordinated yet)") {
			t.Errorf("frame %d has no figures:\n%q", i, f)
		}
	}
}
