package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"
)

func commands() map[string]command {
	var (
		file    string
		ifMatch int64
		create  bool
		rate    float64
		burst   int64
		live    liveFlags
		ck      checkFlags
	)
	return map[string]command{
		"rules put": {
			args: "-f FILE",
			flags: func(fs *flag.FlagSet) {
				fs.StringVar(&file, "file", "", "rule file: one rule or a list, JSON or YAML (short: -f)")
				fs.Int64Var(&ifMatch, "if-match", 0, "store only if the rule is still at this revision (single rule)")
				fs.BoolVar(&create, "create", false, "store only if the rule does not exist yet")
			},
			run: func(c *cli, ctx context.Context, args []string) error {
				return c.rulesPut(ctx, args, file, ifMatch, create)
			},
		},
		"rules get":  {args: "ID", run: (*cli).rulesGet},
		"rules list": {run: (*cli).rulesList},
		"rules delete": {
			args: "ID",
			flags: func(fs *flag.FlagSet) {
				fs.Int64Var(&ifMatch, "if-match", 0, "delete only if the rule is still at this revision")
			},
			run: func(c *cli, ctx context.Context, args []string) error {
				return c.rulesDelete(ctx, args, ifMatch)
			},
		},
		"rules validate": {
			args: "-f FILE",
			flags: func(fs *flag.FlagSet) {
				fs.StringVar(&file, "file", "", "rule file: one rule or a list, JSON or YAML (short: -f)")
			},
			run: func(c *cli, ctx context.Context, args []string) error { return c.rulesValidate(args, file) },
		},
		"rules shadow": {args: "ID on|off", run: (*cli).rulesShadow},
		"limits show": {
			args:  "ID",
			flags: live.register,
			run: func(c *cli, ctx context.Context, args []string) error {
				return c.limitsShow(ctx, args, &live)
			},
		},
		"limits set": {
			args: "ID",
			flags: func(fs *flag.FlagSet) {
				fs.Float64Var(&rate, "rate", 0, "global rate: refill_per_second (tokens per second)")
				fs.Int64Var(&burst, "burst", 0, "global burst: capacity (tokens)")
				fs.Int64Var(&ifMatch, "if-match", 0, "update only if the rule is still at this revision (default: the revision just read)")
			},
			run: func(c *cli, ctx context.Context, args []string) error {
				return c.limitsSet(ctx, args, rate, burst, ifMatch)
			},
		},
		"check": {
			flags: ck.register,
			run: func(c *cli, ctx context.Context, args []string) error {
				return c.check(ctx, args, &ck)
			},
		},
	}
}

func (c *cli) json(v any) error {
	enc := json.NewEncoder(c.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func (c *cli) table() *tabwriter.Writer {
	return tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
}

// parseRuleFile reads one rule document or a list (JSON, or YAML).
func parseRuleFile(path string) ([]rules.Rule, error) {
	if path == "" {
		return nil, usagef("-f FILE is required")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	doc := bytes.TrimSpace(data)
	if len(doc) > 0 && doc[0] != '{' && doc[0] != '[' {
		// YAML: a single mapping is one rule; convert it to JSON for ParseRule.
		if j, err := yaml.YAMLToJSON(doc); err == nil && len(j) > 0 && j[0] == '{' {
			doc = j
		}
	}
	if len(doc) > 0 && doc[0] == '{' && !hasKey(doc, "rules") {
		r, err := rules.ParseRule(doc)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return []rules.Rule{r}, nil
	}
	rs, err := rules.ParseRules(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return rs, nil
}

func hasKey(doc []byte, key string) bool {
	var m map[string]json.RawMessage
	if json.Unmarshal(doc, &m) != nil {
		return false
	}
	_, ok := m[key]
	return ok
}

func (c *cli) rulesPut(ctx context.Context, args []string, file string, ifMatch int64, create bool) error {
	if err := wantArgs(args, 0, "no arguments (the rules come from -f FILE)"); err != nil {
		return err
	}
	rs, err := parseRuleFile(file)
	if err != nil {
		return err
	}
	if ifMatch != 0 && create {
		return usagef("--if-match and --create are exclusive")
	}
	if ifMatch != 0 && len(rs) != 1 {
		return usagef("--if-match needs a file with exactly one rule, %s holds %d", file, len(rs))
	}
	if create {
		ifMatch = etcdstore.MustNotExist
	}
	st, closeStore, err := c.g.store()
	if err != nil {
		return err
	}
	defer closeStore()
	type stored struct {
		ID       string `json:"id"`
		Revision int64  `json:"revision"`
	}
	var out []stored
	var putErr error
	for _, r := range rs {
		rev, err := st.Put(ctx, r, ifMatch)
		if err != nil {
			putErr = fmt.Errorf("rule %q: %w", r.ID, err)
			break
		}
		out = append(out, stored{r.ID, rev})
	}
	if c.g.output == "json" {
		if out == nil {
			out = []stored{}
		}
		if err := c.json(out); err != nil {
			return err
		}
	} else {
		tw := c.table()
		fmt.Fprintln(tw, "ID\tREVISION\tSTATUS")
		for _, s := range out {
			fmt.Fprintf(tw, "%s\t%d\tstored\n", s.ID, s.Revision)
		}
		tw.Flush()
	}
	if putErr != nil && len(rs) > 1 {
		return fmt.Errorf("%w (stored %d of %d rules before this one)", putErr, len(out), len(rs))
	}
	return putErr
}

func (c *cli) rulesGet(ctx context.Context, args []string) error {
	if err := wantArgs(args, 1, "ID"); err != nil {
		return err
	}
	st, closeStore, err := c.g.store()
	if err != nil {
		return err
	}
	defer closeStore()
	r, rev, err := st.Get(ctx, args[0])
	if err != nil {
		return err
	}
	if c.g.output == "json" {
		// The rule document alone, so it can be edited and put back.
		return c.json(r)
	}
	tw := c.table()
	row := func(k string, v any) { fmt.Fprintf(tw, "%s\t%v\n", k, v) }
	row("id", r.ID)
	row("revision", rev)
	row("match", formatMap(r.Match))
	row("key", strings.Join(r.Key, ","))
	row("algorithm", r.Algorithm)
	row("limit", limitText(r))
	row("scope", r.Scope)
	if r.Scope == rules.Global {
		row("regions", formatWeights(r.Regions))
		row("min_share", r.MinShare)
	}
	row("failure_mode", r.FailureMode)
	row("shadow", r.Shadow)
	if r.LocalBatch != 0 {
		row("local_batch", r.LocalBatch)
	}
	if r.Split > 1 {
		row("split", r.Split)
	}
	return tw.Flush()
}

func (c *cli) rulesList(ctx context.Context, args []string) error {
	if err := wantArgs(args, 0, "no arguments"); err != nil {
		return err
	}
	st, closeStore, err := c.g.store()
	if err != nil {
		return err
	}
	defer closeStore()
	rs, _, err := st.List(ctx)
	if err != nil {
		return err
	}
	if c.g.output == "json" {
		if rs == nil {
			rs = []rules.Rule{}
		}
		return c.json(rs)
	}
	tw := c.table()
	fmt.Fprintln(tw, "ID\tALGORITHM\tLIMIT\tSCOPE\tSHADOW\tMATCH")
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\t%s\n", r.ID, r.Algorithm, limitText(r), r.Scope, r.Shadow, formatMap(r.Match))
	}
	return tw.Flush()
}

func (c *cli) rulesDelete(ctx context.Context, args []string, ifMatch int64) error {
	if err := wantArgs(args, 1, "ID"); err != nil {
		return err
	}
	if ifMatch < 0 {
		return usagef("--if-match must be a revision (> 0)")
	}
	st, closeStore, err := c.g.store()
	if err != nil {
		return err
	}
	defer closeStore()
	if err := st.Delete(ctx, args[0], ifMatch); err != nil {
		return err
	}
	if c.g.output == "json" {
		return c.json(map[string]any{"id": args[0], "deleted": true})
	}
	_, err = fmt.Fprintf(c.stdout, "deleted %s\n", args[0])
	return err
}

func (c *cli) rulesValidate(args []string, file string) error {
	if err := wantArgs(args, 0, "no arguments (the rules come from -f FILE)"); err != nil {
		return err
	}
	rs, err := parseRuleFile(file)
	if err != nil {
		return err
	}
	ids := make([]string, len(rs))
	for i, r := range rs {
		ids[i] = r.ID
	}
	if c.g.output == "json" {
		return c.json(map[string]any{"valid": true, "rules": ids})
	}
	_, err = fmt.Fprintf(c.stdout, "ok: %d valid rule(s): %s\n", len(rs), strings.Join(ids, ", "))
	return err
}

func (c *cli) rulesShadow(ctx context.Context, args []string) error {
	if err := wantArgs(args, 2, "ID on|off"); err != nil {
		return err
	}
	var on bool
	switch args[1] {
	case "on":
		on = true
	case "off":
	default:
		return usagef("shadow mode is on or off, got %q", args[1])
	}
	st, closeStore, err := c.g.store()
	if err != nil {
		return err
	}
	defer closeStore()
	r, rev, err := st.Get(ctx, args[0])
	if err != nil {
		return err
	}
	changed := r.Shadow != on
	if changed {
		r.Shadow = on
		if rev, err = st.Put(ctx, r, rev); err != nil {
			return err
		}
	}
	if c.g.output == "json" {
		return c.json(map[string]any{"id": r.ID, "shadow": on, "revision": rev, "changed": changed})
	}
	state := "set"
	if !changed {
		state = "already"
	}
	_, err = fmt.Fprintf(c.stdout, "rule %s: shadow %s %s (revision %d)\n", r.ID, state, args[1], rev)
	return err
}

func (c *cli) limitsSet(ctx context.Context, args []string, rate float64, burst int64, ifMatch int64) error {
	if err := wantArgs(args, 1, "ID"); err != nil {
		return err
	}
	if rate == 0 && burst == 0 {
		return usagef("give --rate N and/or --burst N")
	}
	if ifMatch < 0 {
		return usagef("--if-match must be a revision (> 0)")
	}
	st, closeStore, err := c.g.store()
	if err != nil {
		return err
	}
	defer closeStore()
	r, rev, err := st.Get(ctx, args[0])
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

// liveFlags are the flags of limits show that query the sync agents.
type liveFlags struct {
	agents string
	top    int
}

func (f *liveFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.agents, "agents", "", "comma-separated sync agent HTTP addresses, one per region: [REGION=]URL")
	fs.IntVar(&f.top, "top", 0, "also list each region's N keys with the largest live share (with --agents)")
}

func (c *cli) limitsShow(ctx context.Context, args []string, lf *liveFlags) error {
	if err := wantArgs(args, 1, "ID"); err != nil {
		return err
	}
	var refs []agentRef
	if lf.agents != "" {
		var err error
		if refs, err = parseAgents(lf.agents); err != nil {
			return err
		}
	}
	if lf.top < 0 || lf.top > maxLiveKeys {
		return usagef("--top must be from 0 to %d", maxLiveKeys)
	}
	if lf.top > 0 && refs == nil {
		return usagef("--top needs --agents")
	}
	st, closeStore, err := c.g.store()
	if err != nil {
		return err
	}
	defer closeStore()
	r, rev, err := st.Get(ctx, args[0])
	if err != nil {
		return err
	}
	return c.showLimits(ctx, r, rev, &liveQuery{agents: refs, top: lf.top})
}

// liveQuery asks showLimits for live shares.
type liveQuery struct {
	agents []agentRef
	top    int
}

// regionLimit is one region's part of a rule's limit.
type regionLimit struct {
	Region      string     `json:"region"`
	Weight      float64    `json:"weight,omitempty"`
	StaticRate  float64    `json:"static_rate"`
	StaticBurst float64    `json:"static_burst"`
	FloorRate   float64    `json:"floor_rate"`
	Live        *liveShare `json:"live,omitempty"`
}

type limitsView struct {
	ID       string        `json:"id"`
	Revision int64         `json:"revision"`
	Scope    rules.Scope   `json:"scope"`
	Rate     float64       `json:"rate"`
	Burst    int64         `json:"burst"`
	MinShare float64       `json:"min_share"`
	Regions  []regionLimit `json:"regions"`
	// OtherAgents are the answers of agents that match none of the rule's
	// regions (or a region another agent already answered for).
	OtherAgents []liveShare `json:"other_agents,omitempty"`
}

// showLimits prints r's limits; with lq and a global token-bucket rule, also
// each region's live share from its sync agent. It fails (after printing)
// when every agent failed.
func (c *cli) showLimits(ctx context.Context, r rules.Rule, rev int64, lq *liveQuery) error {
	rate, burst := r.RefillPerSecond, r.Capacity
	if r.Algorithm != rules.TokenBucket && r.Algorithm != rules.LeakyBucket {
		rate, burst = 0, r.Limit
	}
	v := limitsView{ID: r.ID, Revision: rev, Scope: r.Scope, Rate: rate, Burst: burst, MinShare: r.MinShare, Regions: []regionLimit{}}
	regions := slices.Sorted(maps.Keys(r.Regions))
	coordinated := r.Scope == rules.Global && r.Algorithm == rules.TokenBucket
	queried := lq != nil && len(lq.agents) > 0 && coordinated
	var live map[string]*liveShare
	var answers []liveShare
	if queried {
		answers = queryAgents(ctx, &http.Client{}, lq.agents, r.ID, max(liveKeys, lq.top), lq.top)
		live, v.OtherAgents = assignLive(regions, answers)
	}
	for _, name := range regions {
		frac, _ := r.StaticShare(name)
		v.Regions = append(v.Regions, regionLimit{Region: name, Weight: r.Regions[name],
			StaticRate: rate * frac, StaticBurst: float64(burst) * frac, FloorRate: rate * frac * r.MinShare, Live: live[name]})
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
	if c.g.output == "json" {
		if err := c.json(v); err != nil {
			return err
		}
		return liveErr
	}
	fmt.Fprintf(c.stdout, "rule %s (revision %d): %s, scope %s\n", r.ID, rev, limitText(r), r.Scope)
	if r.Scope != rules.Global {
		_, err := fmt.Fprintln(c.stdout, "regional rule: every region enforces the whole limit")
		return err
	}
	fmt.Fprintf(c.stdout, "global limit: rate %s/s, burst %d, min_share %s\n", num(rate), burst, num(r.MinShare))
	tw := c.table()
	fmt.Fprintln(tw, "REGION\tWEIGHT\tSTATIC RATE/S\tSTATIC BURST\tFLOOR RATE/S")
	for _, rl := range v.Regions {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", rl.Region, num(rl.Weight), num(rl.StaticRate), num(rl.StaticBurst), num(rl.FloorRate))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	switch {
	case !coordinated:
		_, err := fmt.Fprintf(c.stdout, "live shares: none (sync agents coordinate global token_bucket rules only)\n")
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

// checkFlags are the flags of the check command.
type checkFlags struct {
	addr      string
	clientKey string
	resource  string
	cost      int64
	attrs     attrFlag
	tls       bool
	tlsCA     string
}

func (f *checkFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.addr, "addr", "", "enforcer gRPC address HOST:PORT")
	fs.StringVar(&f.clientKey, "client-key", "", "client key, e.g. user:42")
	fs.StringVar(&f.resource, "resource", "", "resource, e.g. \"POST /orders\"")
	fs.Int64Var(&f.cost, "cost", 1, "request cost")
	f.attrs = attrFlag{}
	fs.Var(&f.attrs, "attr", "attribute k=v (repeatable; comma-separated pairs also accepted)")
	fs.BoolVar(&f.tls, "tls", false, "connect over TLS (server certificate checked against the system roots)")
	fs.StringVar(&f.tlsCA, "tls-ca", "", "PEM CA bundle that signs the enforcer's certificate (implies --tls)")
}

// attrFlag collects k=v pairs.
type attrFlag map[string]string

func (a attrFlag) String() string { return formatMap(a) }

func (a attrFlag) Set(s string) error {
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return fmt.Errorf("attribute %q is not k=v", kv)
		}
		a[k] = v
	}
	return nil
}

func (c *cli) check(ctx context.Context, args []string, f *checkFlags) error {
	if err := wantArgs(args, 0, "no arguments"); err != nil {
		return err
	}
	if f.addr == "" || f.clientKey == "" {
		return usagef("check needs --addr and --client-key")
	}
	creds := insecure.NewCredentials()
	if f.tls || f.tlsCA != "" {
		tc, err := tlsConfig(f.tlsCA, "", "", "--tls-")
		if err != nil {
			return err
		}
		creds = credentials.NewTLS(tc)
	}
	conn, err := grpc.NewClient(f.addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return usagef("--addr %q: %v", f.addr, err)
	}
	defer conn.Close()
	resp, err := ratelimitv1.NewRateLimiterClient(conn).CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{
		ClientKey: f.clientKey, Resource: f.resource, Cost: f.cost, Attributes: f.attrs,
	})
	if err != nil {
		return fmt.Errorf("CheckLimit on %s: %w", f.addr, err)
	}
	if c.g.output == "json" {
		b, err := protojson.MarshalOptions{Multiline: true, UseProtoNames: true, EmitUnpopulated: true}.Marshal(resp)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(c.stdout, "%s\n", b)
		return err
	}
	decision := "REJECTED"
	if resp.GetAllowed() {
		decision = "ALLOWED"
	}
	if resp.GetFailOpen() {
		decision += " (fail-open: store unreachable)"
	}
	fmt.Fprintf(c.stdout, "%s rule=%s limit=%d remaining=%d retry_after_ms=%d reset_after_ms=%d\n",
		decision, resp.GetRuleId(), resp.GetLimit(), resp.GetRemaining(), resp.GetRetryAfterMs(), resp.GetResetAfterMs())
	if len(resp.GetStatuses()) == 0 {
		return nil
	}
	tw := c.table()
	fmt.Fprintln(tw, "RULE\tALLOWED\tLIMIT\tREMAINING\tRETRY_AFTER_MS\tRESET_AFTER_MS\tSHADOW")
	for _, s := range resp.GetStatuses() {
		fmt.Fprintf(tw, "%s\t%v\t%d\t%d\t%d\t%d\t%v\n", s.GetRuleId(), s.GetAllowed(), s.GetLimit(), s.GetRemaining(), s.GetRetryAfterMs(), s.GetResetAfterMs(), s.GetShadow())
	}
	return tw.Flush()
}

// limitText is a short human form of a rule's limit.
func limitText(r rules.Rule) string {
	switch r.Algorithm {
	case rules.TokenBucket, rules.LeakyBucket:
		return fmt.Sprintf("%s/s burst %d", num(r.RefillPerSecond), r.Capacity)
	default:
		return fmt.Sprintf("%d per %s", r.Limit, r.Window)
	}
}

func num(f float64) string { return strconv.FormatFloat(f, 'g', 6, 64) }

func formatMap(m map[string]string) string {
	if len(m) == 0 {
		return "*"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, k+"="+m[k])
	}
	return strings.Join(parts, ",")
}

func formatWeights(m map[string]float64) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, k+"="+num(m[k]))
	}
	return strings.Join(parts, ",")
}
