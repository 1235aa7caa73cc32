package agent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// testSeed is a fixed NKey user seed of region (tests only).
func testSeed(t testing.TB, region string) []byte {
	t.Helper()
	raw := sha256.Sum256([]byte("agent test key " + region))
	seed, err := nkeys.EncodeSeed(nkeys.PrefixByteUser, raw[:])
	if err != nil {
		t.Fatal(err)
	}
	return seed
}

func testSigner(t testing.TB, region string) *wire.Signer {
	t.Helper()
	s, err := wire.NewSigner(region, testSeed(t, region))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func testPeerKeys(t testing.TB, regions ...string) wire.Keys {
	t.Helper()
	var parts []string
	for _, r := range regions {
		parts = append(parts, r+"="+testSigner(t, r).PublicKey())
	}
	k, err := wire.ParseKeys(strings.Join(parts, ","))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func testVerifier(t testing.TB) *wire.Verifier {
	return wire.NewVerifier(testPeerKeys(t, "a", "b", "c"), false)
}

// listsOf reads every rule's reports with the region list names.
func listsOf(t testing.TB, names ...string) wire.Lists {
	g, err := wire.NewRegions(names)
	if err != nil {
		t.Fatal(err)
	}
	return func(string) *wire.Regions { return g }
}

// testSeal encodes m and signs it with the test key of its region.
func testSeal(t testing.TB, m wire.Message) []byte {
	t.Helper()
	b, err := wire.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	return testSigner(t, m.From).Seal(b)
}

// testSeedFile writes region's test seed to a file and returns its path.
func testSeedFile(t testing.TB, region string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), region+".nk")
	if err := os.WriteFile(p, testSeed(t, region), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestConfigKeys(t *testing.T) {
	base := testConfig("a", t)
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want string // "" valid
	}{
		{"signed", func(c *Config) {}, ""},
		{"no signer", func(c *Config) { c.Signer = nil }, "Signer"},
		{"no signer, insecure", func(c *Config) { c.Signer, c.InsecureUnsigned = nil, true }, ""},
		{"another region's signer", func(c *Config) { c.Signer = testSigner(t, "b") }, "region"},
		{"own key differs from the signer's", func(c *Config) { c.PeerKeys = testPeerKeys(t, "b"); c.PeerKeys["a"] = testPeerKeys(t, "c")["c"] }, "PeerKeys"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base
			tc.mod(&c)
			err := c.Validate()
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("Validate = %v, want %q", err, tc.want)
			}
		})
	}
}

// TestForgedReportsChangeNothing runs two agents on a NATS super-cluster.
// While demand in a holds the shares at a = everything but b's floor, a
// third connection injects forged, unsigned, truncated, bit-flipped and
// replayed copies of real reports: every one is refused and counted by
// reason, no share moves and nobody fences. a's agent restarts and its
// first incarnation's reports are replayed: refused, nothing moves. Then
// demand moves to b and the shares follow it (the agents still converge).
func TestForgedReportsChangeNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	s := memStack(t, []string{"a", "b"}, func(c *Config) {
		// A lease long enough that a loaded test machine does not fence
		// anyone: the test asserts that nobody fences.
		c.Lease, c.Margin = 5*time.Second, time.Second
	})
	rule := globalRule()
	rule.Regions = map[string]float64{"a": 1, "b": 1}
	s.probe = memProbe{s: s, floors: floorsOf(s.regions["a"].agent.specOf(rule))}
	s.putRule(t, rule)
	spec := s.regions["a"].agent.specOf(rule)
	lc := spec.ledgerConfig(ledger.DefaultConfig())
	floors, _ := ledger.Split(lc, spec.Regions)
	U := lc.Units
	sm := startSampler(t, s, U)

	// Capture a's real signed reports.
	spy := s.cluster["b"].Connect(t)
	var mu sync.Mutex
	var captured [][]byte
	sub, err := spy.Subscribe(ReportSubject("a"), func(m *nats.Msg) {
		mu.Lock()
		defer mu.Unlock()
		if len(captured) < 50 {
			captured = append(captured, bytes.Clone(m.Data))
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	load := startLoad(t, s)
	load.region.Store("a")
	testutil.WaitFor(t, 30*time.Second, "a to hold all but b's floor", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return s.enforced("a", testKey) >= U-floors[1]-lc.Hysteresis && s.enforced("b", testKey) == floors[1] && len(captured) >= 10
	})
	sub.Unsubscribe()
	b := s.regions["b"].agent
	incA, incB := s.regions["a"].agent.Incarnation(testRule), b.Incarnation(testRule)

	// The forgeries. The longest captured report (one carrying the key) is
	// the base of the bit flips and truncations.
	mu.Lock()
	real := captured[0]
	for _, c := range captured {
		if len(c) > len(real) {
			real = c
		}
	}
	replays := slices.Clone(captured[:10])
	mu.Unlock()
	msg, err := testVerifier(t).Open("a", real, listsOf(t, "a", "b"))
	if err != nil {
		t.Fatal(err)
	}
	gift := wire.Message{From: "a"}
	for _, rr := range msg.Rules {
		rr.Report.Seq += 1_000_000
		for i, k := range rr.Report.Keys {
			k.Gave = []ledger.Counter{{Region: "b", Inc: incB, Units: U}}
			rr.Report.Keys[i] = k
		}
		gift.Rules = append(gift.Rules, rr)
	}
	plain, _ := wire.Encode(gift)
	mallory, err := wire.NewSigner("a", testSeed(t, "mallory"))
	if err != nil {
		t.Fatal(err)
	}
	var inject [][]byte
	inject = append(inject, plain, mallory.Seal(plain))
	for n := 0; n < len(real); n += 7 {
		inject = append(inject, real[:n])
	}
	for bit := 0; bit < 8*len(real); bit++ {
		c := bytes.Clone(real)
		c[bit/8] ^= 1 << (bit % 8)
		inject = append(inject, c)
	}
	inject = append(inject, replays...)

	reasonsBefore := map[string]float64{}
	total := func() float64 {
		var sum float64
		for _, r := range reasons {
			sum += metricValue(b.m.rejected.WithLabelValues(r))
		}
		return sum
	}
	for _, r := range reasons {
		reasonsBefore[r] = metricValue(b.m.rejected.WithLabelValues(r))
	}
	t0 := total()
	mallet := s.cluster["a"].Connect(t) // the third connection
	for _, m := range inject {
		if err := mallet.Publish(ReportSubject("a"), m); err != nil {
			t.Fatal(err)
		}
	}
	mallet.Flush()
	testutil.WaitFor(t, 20*time.Second, "every injected message counted", func() bool { return total() >= t0+float64(len(inject)) })
	got := map[string]float64{}
	for _, r := range reasons {
		if d := metricValue(b.m.rejected.WithLabelValues(r)) - reasonsBefore[r]; d > 0 {
			got[r] = d
		}
	}
	t.Logf("%d messages injected (%d bit flips of a %d-byte report), refused by reason: %v", len(inject), 8*len(real), len(real), got)
	// Every injected message is refused; a's own reports keep flowing
	// meanwhile, and one of them may be refused too (a report overtaken by
	// a newer one is dropped as a repeat), so count by reason, at least.
	if got[ReasonReplayed] < float64(len(replays)) {
		t.Errorf("%v rejections as %s for %d replays", got[ReasonReplayed], ReasonReplayed, len(replays))
	}
	if forged := got[ReasonUnsigned] + got[ReasonBadSignature] + got[ReasonMalformed]; forged != float64(len(inject)-len(replays)) {
		t.Errorf("%v forged, truncated or altered messages refused, want all %d", forged, len(inject)-len(replays))
	}
	for _, r := range []string{ReasonUnsigned, ReasonBadSignature, ReasonReplayed} {
		if got[r] == 0 {
			t.Errorf("no rejection counted as %s", r)
		}
	}
	if e := s.enforced("b", testKey); e != floors[1] {
		t.Errorf("b enforces %d after the forgeries, want its floor %d", e, floors[1])
	}
	if s.regions["a"].agent.Incarnation(testRule) != incA || b.Incarnation(testRule) != incB {
		t.Errorf("an agent fenced: incarnations a %d->%d, b %d->%d", incA, s.regions["a"].agent.Incarnation(testRule), incB, b.Incarnation(testRule))
	}

	// Replays from an older incarnation: a's agent restarts (a new
	// incarnation, from its floor); once the shares have settled again, a's
	// first incarnation's reports are replayed to b.
	ra := s.regions["a"]
	cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	if err := ra.agent.Close(cctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	ra.start(t, s.etcd, func(c *Config) { c.Lease, c.Margin = 5*time.Second, time.Second })
	testutil.WaitFor(t, 30*time.Second, "a's new incarnation to hold all but b's floor again", func() bool {
		return ra.agent.Incarnation(testRule) > incA && s.enforced("a", testKey) >= U-floors[1]-lc.Hysteresis && s.enforced("b", testKey) == floors[1]
	})
	incA2, incB2 := ra.agent.Incarnation(testRule), b.Incarnation(testRule)
	r0 := metricValue(b.m.rejected.WithLabelValues(ReasonReplayed))
	for _, m := range replays {
		mallet.Publish(ReportSubject("a"), m)
	}
	mallet.Flush()
	testutil.WaitFor(t, 20*time.Second, "old-incarnation replays counted", func() bool {
		return metricValue(b.m.rejected.WithLabelValues(ReasonReplayed)) >= r0+float64(len(replays))
	})
	if e := s.enforced("b", testKey); e != floors[1] {
		t.Errorf("b enforces %d after old-incarnation replays, want its floor %d", e, floors[1])
	}
	if ra.agent.Incarnation(testRule) != incA2 || b.Incarnation(testRule) != incB2 {
		t.Errorf("an agent fenced after old-incarnation replays")
	}

	// Liveness: demand moves to b and the shares follow.
	load.region.Store("b")
	testutil.WaitFor(t, 30*time.Second, "b to hold all but a's floor", func() bool {
		return s.enforced("b", testKey) >= U-floors[0]-lc.Hysteresis && s.enforced("a", testKey) == floors[0]
	})
	sm.finish()
	if v := sm.violations.Load(); v > 0 {
		t.Fatalf("sum of enforced units exceeded %d in %d of %d samples (worst %d)", U, v, sm.samples.Load(), sm.worst.Load())
	}
}

// TestClosureRoomFollowsMaxPayload: the room a report gives its closures
// (ledger.Config.MaxClosureBytes, which every part of a split report
// repeats) is at most a quarter of the NATS server's max_payload, so a
// server configured below NATS's default 1 MiB still leaves a part room
// for keys.
func TestClosureRoomFollowsMaxPayload(t *testing.T) {
	for _, tc := range []struct{ payload, want int }{
		{64 << 10, 16 << 10},
		{8 << 20, ledger.DefaultConfig().MaxClosureBytes},
	} {
		ns := testutil.StartNATS(t, func(o *server.Options) { o.MaxPayload = int32(tc.payload) })
		nc := ns.Connect(t)
		a, err := New(testConfig("a", t), newMemStore(&world{}, "a"), nc, NewEtcdRegistry(nil, "", DefaultConfig().LedgerConfig()), idleSource{})
		if err != nil {
			t.Fatal(err)
		}
		if a.lcfg.MaxClosureBytes != tc.want {
			t.Errorf("max_payload %d: MaxClosureBytes %d, want %d", tc.payload, a.lcfg.MaxClosureBytes, tc.want)
		}
	}
}

// idleSource is a rule source with no rules (an agent that is built and
// never started needs one).
type idleSource struct{}

func (idleSource) Run(ctx context.Context, _ func([]rules.Rule)) error { <-ctx.Done(); return nil }
