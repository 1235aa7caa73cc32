package enforcerd

import (
	"context"
	"regexp"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// running is a Run started by startRun: its ports once it is ready, its
// output, and stop.
type running struct {
	grpc, http     string
	stdout, stderr *testutil.SyncBuffer
	cancel         context.CancelFunc
	done           chan error
	err            error
	stopped        bool
}

var readyLine = regexp.MustCompile(`ready grpc=(\S+) http=(\S+)`)

// startRun runs ratelimitd's Run with args until the test ends (or stop),
// and returns once it printed its ready line.
func startRun(t *testing.T, args ...string) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{stdout: &testutil.SyncBuffer{}, stderr: &testutil.SyncBuffer{}, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- Run(ctx, args, r.stdout, r.stderr) }()
	t.Cleanup(func() { r.stop() })
	var m []string
	testutil.WaitFor(t, 10*time.Second, "the ready line", func() bool {
		m = readyLine.FindStringSubmatch(r.stdout.String())
		return m != nil
	})
	r.grpc, r.http = m[1], m[2]
	return r
}

// stop ends Run and returns its error (the same on every call).
func (r *running) stop() error {
	if !r.stopped {
		r.stopped = true
		r.cancel()
		r.err = <-r.done
	}
	return r.err
}

// client is a CheckLimit client of r's gRPC port, closed when the test ends.
func (r *running) client(t *testing.T) ratelimitv1.RateLimiterClient {
	t.Helper()
	conn, err := grpc.NewClient(r.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return ratelimitv1.NewRateLimiterClient(conn)
}
