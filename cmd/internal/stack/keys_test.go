package stack

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/sync/wire"
	"github.com/nats-io/nats.go"
)

// The stack's agents sign their reports with keys it generated, and every
// report on NATS verifies strictly (no unsigned report is accepted).
func TestStackSignsReports(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	s, err := Start(context.Background(), Config{Regions: 2, EmbeddedRedis: true, EnforcerTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if fi, err := os.Stat(s.seedFile(s.Regions[0].Name)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("seed file: %v %v", fi, err)
	}
	list, err := os.ReadFile(s.peersFile())
	if err != nil {
		t.Fatal(err)
	}
	keys, err := wire.ParseKeys(string(list))
	if err != nil || len(keys) != 2 {
		t.Fatalf("peers file %q: %v", list, err)
	}
	v := wire.NewVerifier(keys, false)
	nc, err := nats.Connect(s.Regions[0].NATSURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var mu sync.Mutex
	verified := map[string]int{}
	var bad []string
	sub, err := nc.Subscribe("ratelimit.report.*", func(m *nats.Msg) {
		from := strings.TrimPrefix(m.Subject, "ratelimit.report.")
		_, err := v.Open(from, m.Data, nil) // verified and well formed (no region lists: the rule reports are not read)
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			bad = append(bad, err.Error())
			return
		}
		verified[from]++
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	testutil.WaitFor(t, 30*time.Second, "verified reports of both regions", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return verified[s.Regions[0].Name] > 0 && verified[s.Regions[1].Name] > 0
	})
	mu.Lock()
	defer mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("%d reports did not verify, first: %s", len(bad), bad[0])
	}
}
