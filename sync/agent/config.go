package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
	"github.com/prometheus/client_golang/prometheus"
)

// ErrConfig is wrapped by Config.Validate errors.
var ErrConfig = errors.New("agent: invalid config")

// Store is the region's Redis as the agent uses it (*redisstore.Store).
type Store interface {
	// WriteMarker applies m to rule's marker and returns the version the
	// store holds afterwards.
	WriteMarker(ctx context.Context, rule string, m redisstore.Marker) (redisstore.Version, error)
	// WriteShares applies the records and returns, per record, the version
	// the store holds for its key afterwards.
	WriteShares(ctx context.Context, rule string, recs []redisstore.ShareRecord) ([]redisstore.Version, error)
	// RunID identifies the store's current contents; it changes when Redis
	// restarts (empty).
	RunID(ctx context.Context) (string, error)
}

// Config configures an Agent.
type Config struct {
	// Region is this agent's region: one NATS subject token (required).
	Region string
	// Interval is the sync interval (default 100ms).
	Interval time.Duration
	// Lease is the ledger lease L (default 3s): a region no peer has
	// acknowledged within it falls back to its floor; survivors reclaim it
	// after L(1+Rho)/(1-Rho) + Margin.
	Lease time.Duration
	// Rho bounds every clock's rate error (default 0.01).
	Rho float64
	// Margin is added to the reclaim wait (default 500ms).
	Margin time.Duration
	// StoreTimeout bounds one Redis write call (default 100ms); it is the
	// ledger's StoreTimeout. See the package doc.
	StoreTimeout time.Duration
	// RecordHold is the TTL of a share record that is not a Release
	// record (default DefaultRecordHold, 1h, which 0 means too; never
	// below 4(Lease + Interval + StoreTimeout)):
	// the agent writes each such record again every half of it, so that
	// the record of an agent gone for good, or of a region taken out,
	// expires (see refresh.go).
	RecordHold time.Duration
	// Units is the integer size of every global limit (default 1,000,000).
	Units int64
	// Strategy names the allocation strategy (allocation.ByName; default max_min_fair).
	Strategy string
	// RegistryPoll is how often the reclaim registry is read (default 500ms).
	RegistryPoll time.Duration
	// EtcdTimeout bounds one registry operation (default 5s).
	EtcdTimeout time.Duration
	// MaxUsageKeys bounds the usage deltas buffered between two ticks
	// (default usage.DefaultMaxKeys); further keys are dropped.
	MaxUsageKeys int
	// HotKeys bounds the keys apportion_sync_share_units exports (default 20).
	HotKeys int
	// UsageGrace is how long the demand estimates wait for an enforcer's
	// late usage (default 2s; 0: they never wait). An enforcer heard at
	// every flush that misses one makes the estimates wait, at most this
	// long, instead of reading the interval as traffic that stopped; one
	// not heard for this long counts as gone (lateusage.go).
	UsageGrace time.Duration
	// HalfLife is the half-life of the demand estimate (an EWMA, default
	// 250ms, the same per second at any Interval): shorter follows demand
	// shifts faster, longer is steadier under noisy traffic (see
	// simulations/README.md, the half-life sweep).
	HalfLife time.Duration
	// Heartbeat is how often a report goes out when nothing worth
	// reporting changed (default 1s, capped by the lease: 685 ms at 3 s;
	// 0: a report every Interval), and DemandBand how far a key's demand
	// must move from the value last reported to count as changed (default
	// 0.25; 0: every move). ledger.Config's HeartbeatEvery and DemandBand:
	// together they cut the sync bytes several times over at about the
	// same utilization (simulations/README.md).
	Heartbeat  time.Duration
	DemandBand float64
	// GiftBand and GiftWait: an excess over a key's target of at most
	// GiftBand of the limit is given only once it has lasted GiftWait
	// (defaults 0.02 and 1s; GiftWait 0: at once), so that units do not
	// travel back and forth on the noise of many regions' demand
	// (ledger.Config's GiftBand and GiftWait).
	GiftBand float64
	GiftWait time.Duration
	// WitnessLease is the witness's lease between two regions (default
	// driver.DefaultWitnessLease, 1m; 0: no witness; at least Lease): the
	// agent renews a key of its region's in etcd every quarter of it, a
	// region that hears neither its peer nor etcd keeps its position of a
	// two-region rule this long after its last renewal and then falls to
	// its floor, and the peer of a region silent that long (times
	// (1+Rho)/(1-Rho), plus Margin) takes its key and reclaims its share
	// (the sync/ledger package doc, Two regions and the witness).
	WitnessLease time.Duration
	// Signer signs every report this agent publishes (wire.NewSigner from
	// the region's NKey seed). Required unless InsecureUnsigned; its region
	// must be Region.
	Signer *wire.Signer
	// PeerKeys holds the regions' public keys: a report is accepted only if
	// it verifies with the key of the region whose subject it arrived on.
	// A region without a key here is refused (unless InsecureUnsigned). It
	// may list this region too (one list for every region), with Signer's key.
	PeerKeys wire.Keys
	// InsecureUnsigned lets Signer be nil (reports go out unsigned) and
	// accepts unsigned reports from regions without a key in PeerKeys.
	// Anyone able to publish on NATS can then move shares and fence
	// regions: for tests and for migrating a deployment to signed reports.
	InsecureUnsigned bool
	// WireVersion is the format of the reports this agent publishes: 3
	// (the default; 0 means 3) or 2. An agent reads both, but an agent
	// before version 3 reads only 2: upgrade a deployment with
	// WireVersion 2 on every region, then set 3 once every agent reads it
	// (sync/wire package doc).
	WireVersion int
	// Shard is this agent's part of the region's keys and its layout's
	// epoch (default: the unsharded agent, every key). Every region must
	// run the same layout, the one in etcd at LayoutKey (see the package
	// doc, "Shards"); with more than one shard the store must be a Redis
	// Cluster whose marker writes cover the shard's slots
	// (redisstore.WithMarkerSlots of redisstore.ShardSlots).
	Shard Shard
	// RulePrefix is where the rule source reads the rules (agentd: the
	// etcd prefix, --etcd-prefix), for the log only: an agent that finds
	// no rule to coordinate says where it looked.
	RulePrefix string
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Metrics, if set, gets the agent's metrics, labelled with Region.
	Metrics prometheus.Registerer
	// OnOtherAgent, if set, is called (on the agent's loop: it must not
	// block) each time a report of this region from a newer incarnation
	// than this agent's is heard: another agent serves the region
	// (apportion_sync_other_agent_reports_total). agentd's standby
	// election steps down on it while it cannot reach etcd.
	OnOtherAgent func()
}

// DefaultRecordHold is the default Config.RecordHold.
const DefaultRecordHold = time.Hour

// DefaultUsageGrace is the default Config.UsageGrace: covers the stalls
// of a NATS server that a region outlives without fencing (the lease, 3 s
// by default, ends those), and makes the estimates follow a region whose
// only enforcer stopped this much later.
const DefaultUsageGrace = 2 * time.Second

// DefaultConfig returns the defaults documented on Config (Region unset).
func DefaultConfig() Config {
	lc := ledger.DefaultConfig()
	return Config{
		Interval:     100 * time.Millisecond,
		RecordHold:   DefaultRecordHold,
		Lease:        lc.Lease,
		Rho:          lc.Rho,
		Margin:       lc.Margin,
		StoreTimeout: lc.StoreTimeout,
		Units:        lc.Units,
		Strategy:     allocation.NameMaxMinFair,
		RegistryPoll: 500 * time.Millisecond,
		EtcdTimeout:  5 * time.Second,
		MaxUsageKeys: usage.DefaultMaxKeys,
		UsageGrace:   DefaultUsageGrace,
		HotKeys:      20,
		HalfLife:     lc.HalfLife,
		Heartbeat:    lc.HeartbeatEvery,
		DemandBand:   lc.DemandBand,
		GiftBand:     lc.GiftBand,
		GiftWait:     lc.GiftWait,
		WitnessLease: driver.DefaultWitnessLease,
	}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	if err := usage.ValidRegion(c.Region); err != nil {
		return fmt.Errorf("%w: Region: %w", ErrConfig, err)
	}
	switch {
	case c.Signer == nil && !c.InsecureUnsigned:
		return fmt.Errorf("%w: Signer: reports must be signed (set a signing key, or InsecureUnsigned to run without authentication)", ErrConfig)
	case c.Signer != nil && c.Signer.Region() != c.Region:
		return fmt.Errorf("%w: Signer is region %q's, not %q's", ErrConfig, c.Signer.Region(), c.Region)
	case c.Signer != nil && c.PeerKeys[c.Region] != nil && !c.PeerKeys[c.Region].Equal(c.Signer.Public()):
		return fmt.Errorf("%w: PeerKeys gives region %q another public key than its Signer's (%s)", ErrConfig, c.Region, c.Signer.PublicKey())
	}
	if c.WireVersion != 0 && c.WireVersion != 2 && c.WireVersion != 3 {
		return fmt.Errorf("%w: WireVersion %d: 2 or 3", ErrConfig, c.WireVersion)
	}
	if err := c.Shard.validate(); err != nil {
		return fmt.Errorf("%w: Shard: %w", ErrConfig, err)
	}
	if _, err := allocation.ByName(c.Strategy); err != nil {
		return fmt.Errorf("%w: Strategy: %w", ErrConfig, err)
	}
	switch {
	case c.Units > redisstore.MaxUnits:
		return fmt.Errorf("%w: Units above %d", ErrConfig, redisstore.MaxUnits)
	case c.RegistryPoll <= 0 || c.EtcdTimeout <= 0:
		return fmt.Errorf("%w: RegistryPoll and EtcdTimeout must be positive", ErrConfig)
	case c.RecordHold < 0 || c.RecordHold > 365*24*time.Hour:
		return fmt.Errorf("%w: RecordHold must be in [0, 365d]", ErrConfig)
	case c.MaxUsageKeys <= 0 || c.HotKeys < 0:
		return fmt.Errorf("%w: MaxUsageKeys must be positive, HotKeys not negative", ErrConfig)
	case c.UsageGrace < 0 || c.UsageGrace > time.Minute:
		return fmt.Errorf("%w: UsageGrace must be in [0, 1m]", ErrConfig)
	}
	if err := c.LedgerConfig().Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return nil
}

// LedgerConfig returns the ledger settings; Units and MinShare are set per
// rule from its Spec.
func (c Config) LedgerConfig() ledger.Config {
	lc := ledger.DefaultConfig()
	lc.Units, lc.Interval, lc.Lease, lc.Rho, lc.Margin, lc.StoreTimeout = c.Units, c.Interval, c.Lease, c.Rho, c.Margin, c.StoreTimeout
	lc.Hysteresis = max(1, c.Units/10000)
	lc.HalfLife, lc.HeartbeatEvery, lc.DemandBand = c.HalfLife, c.Heartbeat, c.DemandBand
	lc.GiftBand, lc.GiftWait = c.GiftBand, c.GiftWait
	lc.WitnessLease = c.WitnessLease
	f, _ := allocation.ByName(c.Strategy)
	lc.Allocate = ledger.AllocatorOf(f)
	return lc
}
