package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// The sync agent's live-shares endpoint (sync/agent.SharesPath); rlctl
// mirrors its JSON rather than importing the agent (and NATS, Redis) into
// the CLI. The tests pin the two together.
const (
	sharesPath = "/v1/shares"
	// liveKeys is how many keys rlctl asks each agent for (at least --top).
	liveKeys = 100
	// maxLiveKeys is the agent's largest limit.
	maxLiveKeys = 10_000
	// agentTimeout bounds one agent query within the command's --timeout.
	agentTimeout = 5 * time.Second
)

// Status of one agent's answer in liveShare.
const (
	liveOK             = "ok"
	liveUnreachable    = "unreachable"     // no HTTP answer (or not the endpoint's JSON)
	liveNotCoordinated = "not-coordinated" // 404: the agent does not coordinate the rule
	liveUnavailable    = "unavailable"     // 503: standby, or stopping
	liveError          = "error"           // any other answer
)

// agentShares is the agent's 200 answer (sync/agent.RuleShares).
type agentShares struct {
	Region      string `json:"region"`
	Rule        string `json:"rule"`
	Incarnation uint64 `json:"incarnation"`
	Fenced      bool   `json:"fenced"`
	Units       int64  `json:"units"`
	Floor       int64  `json:"floor"`
	TotalKeys   int    `json:"total_keys"`
	Keys        []struct {
		Key   string  `json:"key"`
		Units int64   `json:"units"`
		Rate  float64 `json:"rate"`
		Burst float64 `json:"burst"`
	} `json:"keys"`
}

// agentError is the agent's error answer.
type agentError struct {
	Error  string `json:"error"`
	Region string `json:"region"`
}

// agentRef is one --agents entry.
type agentRef struct {
	region string // "" unless given as REGION=URL
	url    string // base URL, no trailing slash
}

// parseAgents parses --agents: comma-separated [REGION=]URL, where URL may
// omit http://.
func parseAgents(s string) ([]agentRef, error) {
	var out []agentRef
	for _, e := range strings.Split(s, ",") {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		var ref agentRef
		if i := strings.Index(e, "="); i > 0 && !strings.ContainsAny(e[:i], ":/") {
			ref.region, e = e[:i], e[i+1:]
		}
		if !strings.Contains(e, "://") {
			e = "http://" + e
		}
		u, err := url.Parse(e)
		if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
			return nil, usagef("--agents: %q is not [REGION=]URL of a sync agent (e.g. us-east=http://10.0.0.5:9091)", e)
		}
		ref.url = strings.TrimRight(e, "/")
		out = append(out, ref)
	}
	if len(out) == 0 {
		return nil, usagef("--agents: no agent URL in %q", s)
	}
	return out, nil
}

// liveShare is one region's live share of a rule, as its sync agent
// answered: sums over the keys it returned (its top keys by units).
type liveShare struct {
	Region      string    `json:"region,omitempty"`
	Agent       string    `json:"agent"`
	Status      string    `json:"status"`
	Error       string    `json:"error,omitempty"`
	Incarnation uint64    `json:"incarnation,omitempty"`
	Fenced      bool      `json:"fenced"`
	Units       int64     `json:"units,omitempty"`       // U: the whole limit in units
	FloorUnits  int64     `json:"floor_units,omitempty"` // the region's floor, in units
	Keys        int       `json:"keys"`                  // keys summed
	TotalKeys   int       `json:"total_keys"`            // keys the agent coordinates
	Rate        float64   `json:"rate"`                  // sum over the keys, tokens/s
	Burst       float64   `json:"burst"`                 // sum over the keys, tokens
	Top         []liveKey `json:"top,omitempty"`
}

// liveKey is one key's live share.
type liveKey struct {
	Key   string  `json:"key"`
	Units int64   `json:"units"`
	Share float64 `json:"share"` // units / U
	Rate  float64 `json:"rate"`
	Burst float64 `json:"burst"`
}

func (l *liveShare) ok() bool { return l.Status == liveOK }

// rank orders answers of one region: a share beats an error beats silence.
func (l *liveShare) rank() int {
	switch l.Status {
	case liveOK:
		return 3
	case liveUnreachable:
		return 1
	}
	return 2
}

// queryAgents asks every agent for rule's live shares, in parallel, for
// limit keys each, keeping top keys in each answer.
func queryAgents(ctx context.Context, client *http.Client, refs []agentRef, rule string, limit, top int) []liveShare {
	out := make([]liveShare, len(refs))
	var wg sync.WaitGroup
	for i, ref := range refs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = queryAgent(ctx, client, ref, rule, limit, top)
		}()
	}
	wg.Wait()
	return out
}

func queryAgent(ctx context.Context, client *http.Client, ref agentRef, rule string, limit, top int) liveShare {
	ls := liveShare{Region: ref.region, Agent: ref.url}
	fail := func(status string, err error) liveShare {
		ls.Status, ls.Error = status, err.Error()
		return ls
	}
	ctx, cancel := context.WithTimeout(ctx, agentTimeout)
	defer cancel()
	q := url.Values{"rule": {rule}, "limit": {fmt.Sprint(limit)}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, ref.url+sharesPath+"?"+q.Encode(), nil)
	if err != nil {
		return fail(liveUnreachable, err)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return fail(liveUnreachable, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return fail(liveUnreachable, err)
	}
	if resp.StatusCode != http.StatusOK {
		var ae agentError
		if json.Unmarshal(body, &ae) != nil || ae.Error == "" {
			return fail(liveUnreachable, fmt.Errorf("HTTP %s, not a sync agent's answer", resp.Status))
		}
		if err := ls.checkRegion(ae.Region); err != nil {
			return fail(liveError, err)
		}
		status := liveError
		switch resp.StatusCode {
		case http.StatusNotFound:
			status = liveNotCoordinated
		case http.StatusServiceUnavailable:
			status = liveUnavailable
		}
		return fail(status, fmt.Errorf("HTTP %d: %s", resp.StatusCode, ae.Error))
	}
	var as agentShares
	if err := json.Unmarshal(body, &as); err != nil || as.Region == "" {
		return fail(liveUnreachable, fmt.Errorf("not a sync agent's answer: %v", err))
	}
	if err := ls.checkRegion(as.Region); err != nil {
		return fail(liveError, err)
	}
	if as.Rule != rule {
		return fail(liveError, fmt.Errorf("answered for rule %q, not %q", as.Rule, rule))
	}
	ls.Status = liveOK
	ls.Incarnation, ls.Fenced, ls.Units, ls.FloorUnits = as.Incarnation, as.Fenced, as.Units, as.Floor
	ls.Keys, ls.TotalKeys = len(as.Keys), as.TotalKeys
	for i, k := range as.Keys {
		ls.Rate += k.Rate
		ls.Burst += k.Burst
		if i < top {
			lk := liveKey{Key: k.Key, Units: k.Units, Rate: k.Rate, Burst: k.Burst}
			if as.Units > 0 {
				lk.Share = float64(k.Units) / float64(as.Units)
			}
			ls.Top = append(ls.Top, lk)
		}
	}
	return ls
}

// checkRegion sets the region from the agent's answer, or checks it
// against the one given as REGION=URL.
func (l *liveShare) checkRegion(answered string) error {
	switch {
	case answered == "":
	case l.Region == "":
		l.Region = answered
	case l.Region != answered:
		return fmt.Errorf("the agent serves region %s, not %s", answered, l.Region)
	}
	return nil
}

// assignLive keeps, for each of the rule's regions, the best answer of its
// agents; the other answers (no or another region, or a second agent of a
// region) are returned apart.
func assignLive(regions []string, answers []liveShare) (byRegion map[string]*liveShare, other []liveShare) {
	byRegion = map[string]*liveShare{}
	known := map[string]bool{}
	for _, r := range regions {
		known[r] = true
	}
	for i := range answers {
		a := &answers[i]
		if !known[a.Region] {
			other = append(other, *a)
			continue
		}
		cur := byRegion[a.Region]
		switch {
		case cur == nil:
			byRegion[a.Region] = a
		case a.rank() > cur.rank():
			other = append(other, *cur)
			byRegion[a.Region] = a
		default:
			other = append(other, *a)
		}
	}
	return byRegion, other
}
