package agent

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/sync/ledger"
)

// SharesPath is the path of the live-shares endpoint on the agent's HTTP
// server (RunCommand --http-addr).
const SharesPath = "/v1/shares"

// Limits of the limit query parameter of SharesPath.
const (
	DefaultSharesLimit = 100
	MaxSharesLimit     = 10_000
)

// Errors of ShareView.
var (
	// ErrUnknownRule: the rule is not coordinated by this region's agent
	// (unknown, not a global token bucket, or not listing the region).
	ErrUnknownRule = errors.New("agent: rule not coordinated here")
	// ErrNotRunning: the agent is not started, or closed.
	ErrNotRunning = errors.New("agent: not running")
)

// shareViewTimeout bounds how long a request waits for the loop goroutine,
// which may be in the middle of a tick's store writes.
const shareViewTimeout = 5 * time.Second

// RuleShares is one region's live shares of one rule: the body of GET
// SharesPath?rule=ID[&limit=N].
type RuleShares struct {
	Region string `json:"region"`
	Rule   string `json:"rule"`
	// Incarnation is the incarnation the rule's ledger runs as here; 0 when
	// Fenced.
	Incarnation uint64 `json:"incarnation"`
	// Fenced is true while no ledger runs for the rule here: it fenced itself
	// (or a peer froze it) and waits for a new incarnation, or its first
	// incarnation has not started yet. Meanwhile the region's store enforces
	// the floor for every key of the rule, and Keys is empty.
	Fenced bool `json:"fenced"`
	// Units is the integer size U of the global limit; a key's Units are
	// its part of it.
	Units int64 `json:"units"`
	// Floor is this region's floor in units: the share it keeps for every
	// key whatever happens.
	Floor int64 `json:"floor"`
	// TotalKeys is the number of keys the ledger holds state for; Keys holds
	// at most limit of them.
	TotalKeys int `json:"total_keys"`
	// Keys are the coordinated keys, by Units descending (then by key).
	Keys []RuleShareKey `json:"keys"`
}

// RuleShareKey is one key's live share in RuleShares.
type RuleShareKey struct {
	Key string `json:"key"`
	// Units this region may enforce of the rule's Units.
	Units int64 `json:"units"`
	// Rate (tokens per second) and Burst (tokens) are what the region's
	// store enforces for Units: floor(R x u / U) and floor(C x u / U),
	// computed like the store does, in thousandths of a token (R is the
	// rule's refill_per_second, C its capacity).
	Rate  float64 `json:"rate"`
	Burst float64 `json:"burst"`
}

// ruleParams is what the loop goroutine knows of one coordinated rule.
type ruleParams struct {
	rate     float64 // refill_per_second
	capacity int64   // tokens
	units    int64   // U of the spec in force
	floor    int64
}

// paramsOf is st's parameters (on the loop goroutine).
func (a *Agent) paramsOf(st *ruleState) ruleParams {
	p := ruleParams{rate: usageRate(st.rule), capacity: wholeLimit(st.rule), units: st.spec.Units, floor: st.floor}
	if p.units == 0 { // no incarnation yet: the spec this agent would propose
		spec := a.specOf(st.rule)
		p.units = spec.Units
		floors, _ := ledger.Split(spec.ledgerConfig(a.lcfg), spec.Regions)
		for i, r := range spec.Regions {
			if r.Name == a.cfg.Region {
				p.floor = floors[i]
			}
		}
	}
	return p
}

// ShareView returns this region's live shares of rule, read from its
// ledger on the loop goroutine: at most limit keys (limit <= 0:
// DefaultSharesLimit), by units descending. It fails with ErrUnknownRule
// when the rule is not coordinated here and with ErrNotRunning when the
// agent does not run (or its loop did not answer before ctx was done).
func (a *Agent) ShareView(ctx context.Context, rule string, limit int) (RuleShares, error) {
	if limit <= 0 {
		limit = DefaultSharesLimit
	}
	if !strings.Contains(rule, "#") {
		rule = a.cfg.Shard.Group(rule) // a shard answers for its own keys (see "Shards")
	}
	var (
		p     ruleParams
		known bool
		inc   uint64
		total int
		top   []KeyShare
	)
	err := a.onLoop(ctx, func() {
		st := a.rules[rule]
		if st == nil {
			return
		}
		p, known = a.paramsOf(st), true
		if st.Led == nil {
			return
		}
		inc = st.Led.Incarnation().Inc
		t := topN{n: limit, cmp: func(x, y KeyShare) int {
			return cmp.Or(cmp.Compare(y.Units, x.Units), cmp.Compare(x.Key, y.Key))
		}}
		st.Led.Each(func(k string, s ledger.Share) {
			total++
			t.add(KeyShare{Rule: rule, Key: k, Units: s.Units})
		})
		top = t.result()
	})
	if err != nil {
		return RuleShares{}, err
	}
	if !known {
		return RuleShares{}, fmt.Errorf("%w: %q is not a coordinated global rule of region %s", ErrUnknownRule, rule, a.cfg.Region)
	}
	out := RuleShares{Region: a.cfg.Region, Rule: rule, Incarnation: inc, Fenced: inc == 0, Units: p.units, Floor: p.floor,
		TotalKeys: total, Keys: []RuleShareKey{}}
	// The store's arithmetic (see applyWrites and redisstore): rate and
	// capacity in thousandths, share floor(x*u/U).
	rateM := allocation.Thousandths(p.rate)
	capM := p.capacity * 1000
	for _, k := range top {
		out.Keys = append(out.Keys, RuleShareKey{Key: k.Key, Units: k.Units,
			Rate: float64(shareOf(rateM, k.Units, p.units)) / 1000, Burst: float64(shareOf(capM, k.Units, p.units)) / 1000})
	}
	return out, nil
}

// shareOf returns floor(x*u/total) without overflow for 0 <= u <= total
// (u is clamped to that range).
func shareOf(x, u, total int64) int64 {
	if total <= 0 || x <= 0 {
		return 0
	}
	u = min(max(u, 0), total)
	q, r := x/total, x%total
	// r*u < total^2: exact for total <= redisstore.MaxUnits.
	return q*u + r*u/total
}

// SharesHandler serves GET SharesPath?rule=ID[&limit=N] for the agent that
// current returns (nil: none runs in this process, e.g. a standby):
//
//   - 200 with RuleShares as JSON;
//   - 400 for a missing rule or a limit that is not an integer in
//     1..MaxSharesLimit (default DefaultSharesLimit);
//   - 404 for a rule not coordinated here;
//   - 503 when no agent runs (standby, or stopping);
//   - 405 for a method other than GET or HEAD.
//
// Errors are JSON too: {"error": "...", "region": "..."} (region when an
// agent runs).
func SharesHandler(current func() *Agent) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			writeJSONError(w, http.StatusMethodNotAllowed, "", "method "+r.Method+" not allowed")
			return
		}
		q := r.URL.Query()
		rule := q.Get("rule")
		if rule == "" {
			writeJSONError(w, http.StatusBadRequest, "", "query parameter rule is required")
			return
		}
		limit := DefaultSharesLimit
		if s := q.Get("limit"); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 1 || n > MaxSharesLimit {
				writeJSONError(w, http.StatusBadRequest, "", fmt.Sprintf("limit must be an integer from 1 to %d, got %q", MaxSharesLimit, s))
				return
			}
			limit = n
		}
		a := current()
		if a == nil {
			writeJSONError(w, http.StatusServiceUnavailable, "", "no agent runs in this process (standby, or stopping)")
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), shareViewTimeout)
		defer cancel()
		v, err := a.ShareView(ctx, rule, limit)
		switch {
		case errors.Is(err, ErrUnknownRule):
			writeJSONError(w, http.StatusNotFound, a.cfg.Region, err.Error())
			return
		case err != nil:
			writeJSONError(w, http.StatusServiceUnavailable, a.cfg.Region, err.Error())
			return
		}
		writeJSON(w, http.StatusOK, v)
	})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

// sharesError is the JSON body of an error answer of SharesHandler.
type sharesError struct {
	Error  string `json:"error"`
	Region string `json:"region,omitempty"`
}

func writeJSONError(w http.ResponseWriter, code int, region, msg string) {
	writeJSON(w, code, sharesError{Error: msg, Region: region})
}
