package stack

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// counters are the cumulative figures the live view differentiates.
type counters struct {
	allowed, rejected, failOpen float64
	share                       float64 // units of the hottest key of the global rule, -1 if unknown
}

// Scrape reads the Prometheus metrics a component serves at addr/metrics.
func Scrape(ctx context.Context, addr string) (map[string]*dto.MetricFamily, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	io.Copy(io.Discard, resp.Body)
	return mfs, err
}

// Label returns the value of a metric's label name ("" if it has none).
func Label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// read scrapes one region's enforcer (and agent, when it has one).
func (s *Stack) read(ctx context.Context, r Region) counters {
	var c counters
	c.share = -1
	if mfs, err := Scrape(ctx, r.HTTPAddr); err == nil {
		if mf := mfs["apportion_requests_total"]; mf != nil {
			for _, m := range mf.GetMetric() {
				switch Label(m, "result") {
				case "allowed":
					c.allowed += m.GetCounter().GetValue()
				case "rejected":
					c.rejected += m.GetCounter().GetValue()
				}
			}
		}
		if mf := mfs["apportion_checks_total"]; mf != nil {
			for _, m := range mf.GetMetric() {
				if strings.HasPrefix(Label(m, "decision"), "fail_") {
					c.failOpen += m.GetCounter().GetValue()
				}
			}
		}
	}
	if r.AgentHTTPAddr != "" {
		if mfs, err := Scrape(ctx, r.AgentHTTPAddr); err == nil {
			if mf := mfs["apportion_sync_share_units"]; mf != nil {
				for _, m := range mf.GetMetric() {
					if Label(m, "rule") == GlobalRule && strings.Contains(Label(m, "key"), DemoKey) {
						c.share = m.GetGauge().GetValue()
					}
				}
			}
		}
	}
	return c
}

// View writes a per-region table to w every interval until ctx is done,
// as plain lines (for files, pipes and logs): checks/s, allowed/s,
// rejected/s, failure-policy answers/s, and the region's share of the
// global demo rule for the demo key.
func (s *Stack) View(ctx context.Context, w io.Writer, interval time.Duration) {
	s.watch(ctx, interval, func(table string) { io.WriteString(w, "\n"+table) })
}

// Terminal control sequences of Screen (VT100, understood by every
// terminal emulator in use).
const (
	ansiHome       = "\x1b[H"    // cursor to the top left
	ansiClear      = "\x1b[2J"   // erase the screen
	ansiClearLine  = "\x1b[K"    // erase to the end of the line
	ansiClearBelow = "\x1b[J"    // erase from the cursor to the end of the screen
	ansiHideCursor = "\x1b[?25l" // no blinking cursor over the figures
	ansiShowCursor = "\x1b[?25h" // restored when Screen returns
)

// StopHint ends the plain summary and every screen Screen draws.
const StopHint = "Ctrl-C stops everything."

// Screen draws one screen on the terminal w and redraws it in place every
// interval until ctx is done, instead of scrolling: the addresses and ready
// commands (Summary) pinned at the top, then View's per-region table. The
// last screen stays when it returns, with the cursor below it.
func (s *Stack) Screen(ctx context.Context, w io.Writer, interval time.Duration) {
	summary := s.Summary()
	draw := func(table string) {
		var b strings.Builder
		b.WriteString(ansiHome)
		for _, line := range strings.Split(summary+"\n"+table+"\n"+StopHint, "\n") {
			b.WriteString(line + ansiClearLine + "\n")
		}
		b.WriteString(ansiClearBelow)
		io.WriteString(w, b.String())
	}
	io.WriteString(w, ansiHideCursor+ansiHome+ansiClear)
	defer io.WriteString(w, ansiShowCursor)
	draw(fmt.Sprintf("(live figures every %v)\n", interval))
	s.watch(ctx, interval, draw)
}

// watch calls show with the per-region table every interval until ctx is
// done; the rates are over the last interval.
func (s *Stack) watch(ctx context.Context, interval time.Duration, show func(table string)) {
	prev := make([]counters, len(s.Regions))
	for i, r := range s.Regions {
		prev[i] = s.read(ctx, r)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		var b strings.Builder
		fmt.Fprintf(&b, "%s  %-10s %9s %9s %9s %9s   %s\n", time.Now().Format("15:04:05"), "region", "checks/s", "allowed", "rejected", "fail", "share of "+GlobalRule+" for "+DemoKey)
		for i, r := range s.Regions {
			cur := s.read(ctx, r)
			sec := interval.Seconds()
			allowed, rejected := (cur.allowed-prev[i].allowed)/sec, (cur.rejected-prev[i].rejected)/sec
			share := "n/a (no traffic coordinated yet)"
			if cur.share >= 0 {
				share = fmt.Sprintf("%5.1f%%  %s", cur.share/10000, bar(cur.share/1e6, 30))
			}
			fmt.Fprintf(&b, "          %-10s %9.0f %9.0f %9.0f %9.0f   %s\n", r.Name, allowed+rejected, allowed, rejected,
				(cur.failOpen-prev[i].failOpen)/sec, share)
			prev[i] = cur
		}
		if ctx.Err() != nil {
			return // the scrapes were cut short: no figures
		}
		show(b.String())
	}
}

func bar(frac float64, width int) string {
	if frac < 0 {
		frac = 0
	}
	if frac > 1 {
		frac = 1
	}
	n := int(frac*float64(width) + 0.5)
	return strings.Repeat("#", n) + strings.Repeat(".", width-n)
}
