package sim

// Result is the outcome of one run. Every rate is in tokens per second,
// every time in seconds; series have one entry per sample period.
type Result struct {
	Scenario  string   `json:"scenario"`
	Seed      uint64   `json:"seed"`
	DurationS float64  `json:"duration_s"`
	Regions   []string `json:"regions"`
	Rate      float64  `json:"rate"`
	Burst     float64  `json:"burst"`
	// RuleWindowS > 0: the rule is a fixed window of Burst requests per
	// RuleWindowS seconds (a quota); StrategyResult.WindowMax applies.
	RuleWindowS float64   `json:"rule_window_s,omitempty"`
	Keys        int       `json:"keys"`
	TrackedKey  string    `json:"tracked_key"` // the key of the series and shares
	WindowsS    []float64 `json:"windows_s"`
	SampleS     float64   `json:"sample_s"`
	Events      int       `json:"events"` // events the simulator processed
	// OutsideClockGuarantee lists the clocks set outside the clock guarantee
	// (Scenario.OutsideClockGuarantee); the ledger's bounds do not apply then.
	OutsideClockGuarantee []string `json:"outside_clock_guarantee,omitempty"`
	// Targets: demand shifts of the tracked key and the allocation's targets.
	Targets    []Shift          `json:"shifts"`
	Demand     []float64        `json:"demand"` // offered rate of the tracked key
	Strategies []StrategyResult `json:"strategies"`
}

// StrategyResult holds one strategy's metrics (see simulations/README.md).
type StrategyResult struct {
	Name     string `json:"name"`
	Requests int64  `json:"requests"`
	Offered  int64  `json:"offered"`
	Admitted int64  `json:"admitted"`
	Rejected int64  `json:"rejected"`
	// Overshoot per window: max over t of admitted[t,t+W] / (burst + rate*W) - 1,
	// maximised over keys too.
	Overshoot []float64 `json:"overshoot"`
	// WindowMax (a fixed-window rule): the most one key admitted in one
	// rule window, over all regions; the quota holds if it is at most Burst.
	WindowMax int64 `json:"window_max,omitempty"`
	// Utilization is Admitted / the ideal's Admitted.
	Utilization        float64 `json:"utilization"`
	WronglyRejected    int64   `json:"wrongly_rejected"`
	WronglyRejectedPct float64 `json:"wrongly_rejected_pct"`
	// Convergence after each shift in seconds (-1: never): Reach is the first
	// sample within tolerance, Convergence the first from which the shares
	// stay within it until the next shift.
	HasShares   bool      `json:"has_shares"`
	Reach       []float64 `json:"reach_s,omitempty"`
	Convergence []float64 `json:"convergence_s,omitempty"`
	// SyncBytes sent between regions; per active key per second.
	SyncBytes         int64   `json:"sync_bytes"`
	ActiveKeysMean    float64 `json:"active_keys_mean"`
	ActiveKeysMax     int     `json:"active_keys_max"`
	BytesPerKeySecond float64 `json:"bytes_per_key_second"`
	// AdmittedRate of the tracked key over time.
	AdmittedRate []float64 `json:"admitted_rate"`
	// Shares of the tracked key per sample and region (fraction of the limit).
	Shares [][]float64 `json:"shares,omitempty"`
}
