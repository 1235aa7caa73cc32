package main

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/spf13/cobra"
)

// limitsCmd is the limits group: show and set a rule's global limit.
func (c *cli) limitsCmd() *cobra.Command {
	cmd := c.group(&cobra.Command{
		Use:     "limits",
		Aliases: []string{"limit"},
		Short:   "Show and set global limits and each region's share",
	})
	cmd.AddCommand(c.limitsShowCmd(), c.limitsSetCmd())
	return cmd
}

func (c *cli) limitsShowCmd() *cobra.Command {
	var (
		agents string
		top    int
	)
	cmd := &cobra.Command{
		Use:   "show ID",
		Short: "Show a rule's global limit, each region's static share and, with --agents, its live share",
		Long: `Show the rule's limit and, for a global rule, each region's static share
and floor: a token or leaky bucket's in rate and burst, a window rule's in
requests per window (STATIC /WINDOW, FLOOR /WINDOW: what the store enforces
for the region's units of a coordinated window; a sliding_log enforces its
static share and has no floor). With --agents, also each region's live share
from its sync agent: one agent per region, [REGION=]URL (http://host:9091 or
host:9091); the region named is checked against the agent's answer.

Exits 0 when at least one agent answers (the others are shown as
unreachable, unavailable or not-coordinated), 1 when none does.`,
		Example: `  rlctl limits show user-global
  rlctl limits show user-global --agents us-east=http://10.0.0.5:9091,eu-west=10.1.0.5:9091 --top 5`,
		Args:              exactArgs(1, "ID"),
		ValidArgsFunction: c.completeRuleIDs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.limitsShow(cmd.Context(), args[0], agents, top)
		},
	}
	cmd.Flags().StringVar(&agents, "agents", "", "comma-separated sync agent HTTP addresses, one per region: [REGION=]URL")
	cmd.Flags().IntVar(&top, "top", 0, "also list each region's N keys with the largest live share (with --agents)")
	return cmd
}

func (c *cli) limitsShow(ctx context.Context, id, agents string, top int) error {
	var refs []agentRef
	if agents != "" {
		var err error
		if refs, err = parseAgents(agents); err != nil {
			return err
		}
	}
	if top < 0 || top > maxLiveKeys {
		return usagef("--top must be from 0 to %d", maxLiveKeys)
	}
	if top > 0 && refs == nil {
		return usagef("--top needs --agents")
	}
	if err := checkRuleID(id); err != nil {
		return err
	}
	st, closeStore, err := c.store()
	if err != nil {
		return err
	}
	defer closeStore()
	r, rev, err := st.Get(ctx, id)
	if err != nil {
		return err
	}
	return c.showLimits(ctx, r, rev, &liveQuery{agents: refs, top: top})
}

func (c *cli) limitsSetCmd() *cobra.Command {
	var (
		rate    float64
		burst   int64
		ifMatch int64
	)
	cmd := &cobra.Command{
		Use:   "set ID [--rate N] [--burst N]",
		Short: "Set a token-bucket rule's global rate (refill_per_second) and burst (capacity)",
		Long: `Set the rule's refill_per_second (--rate) and/or capacity (--burst). The
rule is read and written back at its revision (or at --if-match REV): a
concurrent change makes this fail with exit code 4, nothing overwritten.`,
		Example:           "  rlctl limits set user-global --rate 200 --burst 400",
		Args:              exactArgs(1, "ID"),
		ValidArgsFunction: c.completeRuleIDs,
		RunE: func(cmd *cobra.Command, args []string) error {
			fs := cmd.Flags()
			switch {
			case !fs.Changed("rate") && !fs.Changed("burst"):
				return usagef("give --rate N and/or --burst N")
			case fs.Changed("rate") && !(rate > 0):
				return usagef("%s %v: the rate (refill_per_second) must be above 0", c.flagSource("rate"), rate)
			case fs.Changed("burst") && burst < 1:
				return usagef("%s %d: the burst (capacity) must be at least 1", c.flagSource("burst"), burst)
			}
			if err := c.ifMatchFlag(cmd, ifMatch, "update the revision just read"); err != nil {
				return err
			}
			if err := checkRuleID(args[0]); err != nil {
				return err
			}
			return c.limitsSet(cmd.Context(), args[0], rate, burst, ifMatch)
		},
	}
	cmd.Flags().Float64Var(&rate, "rate", 0, "global rate: refill_per_second (tokens per second)")
	cmd.Flags().Int64Var(&burst, "burst", 0, "global burst: capacity (tokens)")
	cmd.Flags().Int64Var(&ifMatch, "if-match", 0, "update only if the rule is still at this revision, above 0 (default: the revision just read)")
	return cmd
}

// limitsSet sets rate and/or burst (0: unchanged) at ifMatch (0: the
// revision read).
func (c *cli) limitsSet(ctx context.Context, id string, rate float64, burst int64, ifMatch int64) error {
	st, closeStore, err := c.store()
	if err != nil {
		return err
	}
	defer closeStore()
	r, rev, err := st.Get(ctx, id)
	if err != nil {
		return err
	}
	if r.Algorithm != rules.TokenBucket {
		return fmt.Errorf("rule %q uses %s; limits set works on token_bucket rules (edit the rule with rules put)", r.ID, r.Algorithm)
	}
	if ifMatch == 0 {
		ifMatch = rev
	}
	if rate != 0 {
		r.RefillPerSecond = rate
	}
	if burst != 0 {
		r.Capacity = burst
	}
	newRev, err := st.Put(ctx, r, ifMatch)
	if err != nil {
		return err
	}
	return c.showLimits(ctx, r, newRev, nil)
}

// liveQuery asks showLimits for live shares.
type liveQuery struct {
	agents []agentRef
	top    int
}

// regionLimit is one region's part of a rule's limit: a token or leaky
// bucket's in rate and burst (static_rate, static_burst, floor_rate), a
// window rule's in requests per window (static_per_window,
// floor_per_window); the other fields are left out.
type regionLimit struct {
	Region      string   `json:"region"`
	Weight      float64  `json:"weight,omitempty"`
	StaticRate  *float64 `json:"static_rate,omitempty"`
	StaticBurst *float64 `json:"static_burst,omitempty"`
	FloorRate   *float64 `json:"floor_rate,omitempty"`
	// StaticPerWindow is the requests per window the region's static share
	// admits; FloorPerWindow those its floor admits (the least it keeps, and
	// what it enforces while its sync agent's share is not in force): a
	// coordinated window's, as the store computes them from the region's
	// units (allocation.Floors); absent for a window rule that is not
	// coordinated (sliding_log), which enforces its static share.
	StaticPerWindow *int64     `json:"static_per_window,omitempty"`
	FloorPerWindow  *int64     `json:"floor_per_window,omitempty"`
	Live            *liveShare `json:"live,omitempty"`
}

type limitsView struct {
	ID       string      `json:"id"`
	Revision int64       `json:"revision"`
	Scope    rules.Scope `json:"scope"`
	// Rate and Burst are a token or leaky bucket's; Limit and Window a
	// window rule's.
	Rate     float64        `json:"rate,omitempty"`
	Burst    int64          `json:"burst,omitempty"`
	Limit    int64          `json:"limit,omitempty"`
	Window   rules.Duration `json:"window,omitempty"`
	MinShare float64        `json:"min_share"`
	Regions  []regionLimit  `json:"regions"`
	// OtherAgents are the answers of agents that match none of the rule's
	// regions (or a region another agent already answered for).
	OtherAgents []liveShare `json:"other_agents,omitempty"`
}

// isBucket reports whether r's limit is a rate and a burst (token_bucket,
// leaky_bucket) rather than requests per window.
func isBucket(r rules.Rule) bool {
	return r.Algorithm == rules.TokenBucket || r.Algorithm == rules.LeakyBucket
}

// windowShares returns each region's static share and floor of a global
// window rule, in requests per window, by region name. For a coordinated
// rule they are what the store enforces for the region's units
// (allocation.Floors, as the enforcer and the sync agent split the limit
// into allocation.DefaultUnits): the floor units alone, and the floor and
// initial units together. A window rule that is not coordinated
// (sliding_log) enforces its static share, the limit times the region's
// weight share, and has no floor (nil).
func windowShares(r rules.Rule) (static map[string]int64, floor map[string]*int64) {
	static, floor = map[string]int64{}, map[string]*int64{}
	if !r.Coordinated() {
		for name := range r.Regions {
			frac, _ := r.StaticShare(name)
			static[name] = int64(float64(r.Limit) * frac) // as the enforcer's regional params
		}
		return static, floor
	}
	names, floorUnits, initial := allocation.Floors(allocation.DefaultUnits, r.MinShare, r.Regions)
	for i, name := range names {
		f := redisstore.ShareOf(r.Limit, floorUnits[i], allocation.DefaultUnits)
		static[name], floor[name] = redisstore.ShareOf(r.Limit, floorUnits[i]+initial[i], allocation.DefaultUnits), &f
	}
	return static, floor
}

// showLimits prints r's limits; with lq and a global token-bucket rule, also
// each region's live share from its sync agent. It fails (after printing)
// when every agent failed.
func (c *cli) showLimits(ctx context.Context, r rules.Rule, rev int64, lq *liveQuery) error {
	bucket := isBucket(r)
	v := limitsView{ID: r.ID, Revision: rev, Scope: r.Scope, MinShare: r.MinShare, Regions: []regionLimit{}}
	if bucket {
		v.Rate, v.Burst = r.RefillPerSecond, r.Capacity
	} else {
		v.Limit, v.Window = r.Limit, r.Window
	}
	regions := slices.Sorted(maps.Keys(r.Regions))
	coordinated := r.Coordinated()
	queried := lq != nil && len(lq.agents) > 0 && coordinated
	var live map[string]*liveShare
	var answers []liveShare
	if queried {
		answers = queryAgents(ctx, &http.Client{}, lq.agents, r.ID, max(liveKeys, lq.top), lq.top)
		live, v.OtherAgents = assignLive(regions, answers)
	}
	var static map[string]int64
	var floor map[string]*int64
	if !bucket {
		static, floor = windowShares(r)
	}
	for _, name := range regions {
		rl := regionLimit{Region: name, Weight: r.Regions[name], Live: live[name]}
		if bucket {
			frac, _ := r.StaticShare(name)
			rate, burst, floorRate := r.RefillPerSecond*frac, float64(r.Capacity)*frac, r.RefillPerSecond*frac*r.MinShare
			rl.StaticRate, rl.StaticBurst, rl.FloorRate = &rate, &burst, &floorRate
		} else {
			n := static[name]
			rl.StaticPerWindow, rl.FloorPerWindow = &n, floor[name]
		}
		v.Regions = append(v.Regions, rl)
	}
	var liveErr error
	if queried {
		failed := 0
		for _, a := range answers {
			if !a.ok() {
				failed++
				region := a.Region
				if region == "" {
					region = "region unknown"
				}
				fmt.Fprintf(c.stderr, "rlctl: sync agent %s (%s): %s: %s\n", a.Agent, region, a.Status, a.Error)
			}
		}
		if failed == len(answers) {
			liveErr = fmt.Errorf("no sync agent answered with live shares (%d queried)", len(answers))
		}
	}
	if c.structured() {
		if err := c.emit(v); err != nil {
			return err
		}
		return liveErr
	}
	fmt.Fprintf(c.stdout, "rule %s (revision %d): %s, scope %s\n", r.ID, rev, limitText(r), r.Scope)
	if r.Scope != rules.Global {
		_, err := fmt.Fprintln(c.stdout, "regional rule: every region enforces the whole limit")
		return err
	}
	tw := c.table()
	if bucket {
		fmt.Fprintf(c.stdout, "global limit: rate %s/s, burst %d, min_share %s\n", num(r.RefillPerSecond), r.Capacity, num(r.MinShare))
		fmt.Fprintln(tw, "REGION\tWEIGHT\tSTATIC RATE/S\tSTATIC BURST\tFLOOR RATE/S")
		for _, rl := range v.Regions {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", rl.Region, num(rl.Weight), num(*rl.StaticRate), num(*rl.StaticBurst), num(*rl.FloorRate))
		}
	} else {
		fmt.Fprintf(c.stdout, "global limit: %d per window of %s, min_share %s (STATIC and FLOOR in requests per window)\n", r.Limit, r.Window, num(r.MinShare))
		fmt.Fprintln(tw, "REGION\tWEIGHT\tSTATIC /WINDOW\tFLOOR /WINDOW")
		for _, rl := range v.Regions {
			floorText := "- (not coordinated: enforces its static share)"
			if rl.FloorPerWindow != nil {
				floorText = strconv.FormatInt(*rl.FloorPerWindow, 10)
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", rl.Region, num(rl.Weight), *rl.StaticPerWindow, floorText)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	switch {
	case !coordinated:
		_, err := fmt.Fprintf(c.stdout, "live shares: none (sync agents coordinate global token_bucket, fixed_window and sliding_window rules only)\n")
		return err
	case !queried:
		_, err := fmt.Fprintln(c.stdout, "live shares: give --agents [REGION=]URL,... (or APPORTION_AGENTS) to ask the regions' sync agents")
		return err
	}
	if err := c.printLive(v, max(liveKeys, lq.top), lq.top); err != nil {
		return err
	}
	return liveErr
}

// printLive prints the live-share tables of showLimits.
func (c *cli) printLive(v limitsView, limit, top int) error {
	fmt.Fprintf(c.stdout, "\nlive shares (from each region's sync agent; RATE/S and BURST sum the region's shares of its top %d keys by units):\n", limit)
	tw := c.table()
	fmt.Fprintln(tw, "REGION\tSTATUS\tINCARNATION\tFENCED\tKEYS\tLIVE RATE/S\tLIVE BURST\tAGENT")
	row := func(region string, l *liveShare) {
		if l == nil {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\t-\t(no agent given)\n", region)
			return
		}
		if !l.ok() {
			fmt.Fprintf(tw, "%s\t%s\t-\t-\t-\t-\t-\t%s\n", region, l.Status, l.Agent)
			return
		}
		keys := fmt.Sprint(l.Keys)
		if l.TotalKeys > l.Keys {
			keys += fmt.Sprintf(" of %d", l.TotalKeys)
		}
		fenced := "no"
		if l.Fenced {
			fenced = "yes (floor)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\n", region, l.Status, l.Incarnation, fenced, keys, num(l.Rate), num(l.Burst), l.Agent)
	}
	for _, rl := range v.Regions {
		row(rl.Region, rl.Live)
	}
	for i := range v.OtherAgents {
		a := &v.OtherAgents[i]
		region := a.Region
		if region == "" {
			region = "?"
		}
		row(region, a)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if top == 0 {
		return nil
	}
	fmt.Fprintf(c.stdout, "\ntop %d keys per region by live share:\n", top)
	tw = c.table()
	fmt.Fprintln(tw, "REGION\tKEY\tUNITS\tSHARE\tRATE/S\tBURST")
	for _, rl := range v.Regions {
		if rl.Live == nil {
			continue
		}
		for _, k := range rl.Live.Top {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s%%\t%s\t%s\n", rl.Region, k.Key, k.Units, num(100*k.Share), num(k.Rate), num(k.Burst))
		}
	}
	return tw.Flush()
}
