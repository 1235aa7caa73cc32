package regional

import (
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sony/gobreaker/v2"
)

// Metrics are the enforcer's Prometheus metrics. Create them with
// NewMetrics on a registry that main owns.
type Metrics struct {
	checks        *prometheus.CounterVec
	latency       *prometheus.HistogramVec
	storeErrors   *prometheus.CounterVec
	breaker       *prometheus.GaugeVec
	breakersOpen  prometheus.Gauge
	rulesLoaded   prometheus.Gauge
	rulesUnlisted prometheus.Gauge
	ruleUpdates   prometheus.Counter
	requests      *prometheus.CounterVec
	inFlight      prometheus.Gauge
	shed          *prometheus.CounterVec
	leaseAnswers  prometheus.Counter

	mu    sync.Mutex
	rules map[string]bool // the rules whose checks series exist

	// The series of known label values, resolved once: a check looks
	// them up in a map instead of hashing its labels into the vector
	// (WithLabelValues, the fallback for any other value).
	latencyOf  map[string]prometheus.Observer
	requestsOf map[[2]string]prometheus.Counter                 // protocol, result
	checksOf   atomic.Pointer[map[[2]string]prometheus.Counter] // rule, decision: the rule set's

	// summary is the enforcer's breakerSummary, read at every scrape: a
	// Cluster master's breaker stops counting once no check has reached it
	// for a while, with no state change to say so.
	summary atomic.Pointer[breakerSummaryFunc]
}

// breakerSummaryFunc is an Enforcer's breakerSummary.
type breakerSummaryFunc struct {
	f func() (gobreaker.State, int)
}

// Metric names, shared with deploy/ dashboards and alerts.
const (
	MetricChecks        = "apportion_checks_total"
	MetricLatency       = "apportion_check_duration_seconds"
	MetricStoreErrors   = "apportion_store_errors_total"
	MetricBreakerState  = "apportion_breaker_state"
	MetricBreakersOpen  = "apportion_breakers_open"
	MetricRulesLoaded   = "apportion_rules_loaded"
	MetricRulesUnlisted = "apportion_rules_unlisted"
	MetricRuleUpdates   = "apportion_rule_updates_total"
	MetricRequests      = "apportion_requests_total"
	MetricScriptLoads   = "apportion_script_loads_total"
	MetricInFlight      = "apportion_checks_in_flight"
	MetricShed          = "apportion_shed_total"
	MetricLocalBatch    = "apportion_local_batch_answers_total"
)

// NewMetrics creates and registers the enforcer's metrics. region is a
// constant label on every metric.
func NewMetrics(reg prometheus.Registerer, region string) *Metrics {
	cl := prometheus.Labels{"region": region}
	m := &Metrics{
		checks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricChecks, ConstLabels: cl,
			Help: "Rule evaluations by rule and decision (allowed, rejected, shadow_rejected, not_consumed; fail_ prefix when answered by the failure policy; shed when answered without the store under overload)."},
			[]string{"rule", "decision"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: MetricLatency, ConstLabels: cl,
			Help:    "CheckLimit latency inside the enforcer by outcome (allowed, rejected, fail_allowed, fail_rejected, shed, none).",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25}},
			[]string{"outcome"}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricStoreErrors, ConstLabels: cl,
			Help: "Store calls answered by the failure policy, by kind: timeout, error (connection refused or reset, Redis loading/busy/down, or out of memory under maxmemory-policy noeviction: OOM) and breaker_open count as store failures; invalid (a bucket the store refuses, answered alone) does not."}, []string{"kind"}),
		breaker: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: MetricBreakerState, ConstLabels: cl,
			Help: "Store circuit breaker: 1 for the current state, 0 for the others. On a Redis Cluster, with a breaker per primary, the worst of them (open if any is open)."}, []string{"state"}),
		breakersOpen: prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricBreakersOpen, ConstLabels: cl,
			Help: "Store circuit breakers open now: a standalone Redis has one, a Redis Cluster one per primary; the failure policy answers only the checks of an open breaker's keys."}),
		rulesLoaded: prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricRulesLoaded, ConstLabels: cl,
			Help: "Rules enforced in this region in the active rule set."}),
		rulesUnlisted: prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricRulesUnlisted, ConstLabels: cl,
			Help: "Global rules in the active rule set whose regions do not include this one: their checks are rejected here (a wrong --region, or a region not yet in the rule's split)."}),
		ruleUpdates: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricRuleUpdates, ConstLabels: cl,
			Help: "Rule sets applied."}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricRequests, ConstLabels: cl,
			Help: "CheckLimit calls by protocol (grpc, http, envoy: one per descriptor checked) and result (allowed, rejected, invalid, error); a call refused before any check (a request that does not decode or is too large, a bad HTTP method or body, no or too many Envoy descriptors, a batch over its maximum) counts once as invalid."},
			[]string{"protocol", "result"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricInFlight, ConstLabels: cl,
			Help: "Checks being answered right now (a sign of saturation when it stays high)."}),
		shed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricShed, ConstLabels: cl,
			Help: "Checks answered without the store because the enforcer was overloaded, by reason (queue_depth, latency: low-priority rules only; queue_timeout: any rule)."},
			[]string{"reason"}),
		leaseAnswers: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricLocalBatch, ConstLabels: cl,
			Help: "Checks of local_batch rules answered from tokens this enforcer took from Redis in advance."}),
	}
	reg.MustRegister(m.checks, m.latency, m.storeErrors, breakerCollector{m}, m.rulesLoaded, m.rulesUnlisted, m.ruleUpdates, m.requests, m.inFlight, m.shed, m.leaseAnswers)
	// Every series with a known label value exists from the start (at 0), so
	// dashboards and rate() see "0", not "No data", before the first event.
	m.latencyOf = make(map[string]prometheus.Observer, len(outcomes))
	for _, o := range outcomes {
		m.latencyOf[o] = m.latency.WithLabelValues(o)
	}
	for _, k := range storeErrorKinds {
		m.storeErrors.WithLabelValues(k)
	}
	m.requestsOf = make(map[[2]string]prometheus.Counter, len(protocols)*len(requestResults))
	for _, p := range protocols {
		for _, r := range requestResults {
			m.requestsOf[[2]string{p, r}] = m.requests.WithLabelValues(p, r)
		}
	}
	for _, r := range shedReasons {
		m.shed.WithLabelValues(r)
	}
	m.setBreakers(gobreaker.StateClosed, 0)
	return m
}

// breakerCollector exports the breaker metrics, brought up to date at
// every scrape.
type breakerCollector struct{ m *Metrics }

func (c breakerCollector) Describe(ch chan<- *prometheus.Desc) {
	c.m.breaker.Describe(ch)
	c.m.breakersOpen.Describe(ch)
}

func (c breakerCollector) Collect(ch chan<- prometheus.Metric) {
	if f := c.m.summary.Load(); f != nil {
		c.m.setBreakers(f.f())
	}
	c.m.breaker.Collect(ch)
	c.m.breakersOpen.Collect(ch)
}

// The label values of the enforcer's metrics.
var (
	outcomes        = []string{"allowed", "rejected", "fail_allowed", "fail_rejected", "shed", "none"}
	storeErrorKinds = []string{"timeout", "breaker_open", "error", "invalid"}
	shedReasons     = []string{"queue_depth", "latency", "queue_timeout"}
	protocols       = []string{"grpc", "http", "envoy"}
	requestResults  = []string{"allowed", "rejected", "invalid", "error"}
	ruleDecisions   = []string{"allowed", "rejected", "shadow_rejected", "not_consumed",
		"fail_allowed", "fail_rejected", "fail_shadow_rejected", "fail_not_consumed", "shed"}
)

// ruleSet creates the checks series of every decision for the rules of a new
// rule set (ids) and deletes those of rules no longer in it.
func (m *Metrics) ruleSet(ids []string) {
	keep := make(map[string]bool, len(ids))
	of := make(map[[2]string]prometheus.Counter, len(ids)*len(ruleDecisions))
	for _, id := range ids {
		keep[id] = true
		for _, d := range ruleDecisions {
			of[[2]string{id, d}] = m.checks.WithLabelValues(id, d)
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.checksOf.Store(&of)
	// One deletion per series, by its label values: DeletePartialMatch
	// scans every series of the vector for each rule, and a rule set that
	// lost 20,000 rules at once took minutes to apply (9 series a rule).
	for id := range m.rules {
		if !keep[id] {
			for _, d := range ruleDecisions {
				m.checks.DeleteLabelValues(id, d)
			}
		}
	}
	m.rules = keep
}

// setBreakers sets the breaker state s (the worst of them) and the number
// open.
func (m *Metrics) setBreakers(s gobreaker.State, open int) {
	for _, st := range []gobreaker.State{gobreaker.StateClosed, gobreaker.StateHalfOpen, gobreaker.StateOpen} {
		v := 0.0
		if st == s {
			v = 1
		}
		m.breaker.WithLabelValues(st.String()).Set(v)
	}
	m.breakersOpen.Set(float64(open))
}

func (m *Metrics) request(protocol string, resp Response, err error) {
	if m == nil {
		return
	}
	r := "allowed"
	switch {
	case err != nil && isInvalid(err):
		r = "invalid"
	case err != nil:
		r = "error"
	case !resp.Allowed:
		r = "rejected"
	}
	if c, ok := m.requestsOf[[2]string{protocol, r}]; ok {
		c.Inc()
		return
	}
	m.requests.WithLabelValues(protocol, r).Inc()
}

// observe records a check's latency by outcome.
func (m *Metrics) observe(outcome string, seconds float64) {
	if o, ok := m.latencyOf[outcome]; ok {
		o.Observe(seconds)
		return
	}
	m.latency.WithLabelValues(outcome).Observe(seconds)
}

// checked counts one rule evaluation by decision.
func (m *Metrics) checked(rule, decision string) {
	if of := m.checksOf.Load(); of != nil {
		if c, ok := (*of)[[2]string{rule, decision}]; ok {
			c.Inc()
			return
		}
	}
	m.checks.WithLabelValues(rule, decision).Inc()
}

// ScriptLoadsCollector exports a monotonically increasing count (the
// store's script reloads after NOSCRIPT) as a counter read at scrape time.
func ScriptLoadsCollector(region string, loads func() uint64) prometheus.Collector {
	return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: MetricScriptLoads, ConstLabels: prometheus.Labels{"region": region},
		Help: "Lua scripts (re)loaded into Redis after NOSCRIPT."}, func() float64 { return float64(loads()) })
}
