package sim

import (
	"context"
	"testing"
	"time"

	"github.com/apportion/apportion/simulations/scenario"
)

// pinger sends a message from region 0 to region 1 and one back every
// 10 ms and counts, per second of send time, what was delivered.
type pinger struct {
	env       *Env
	sent, got [2][]int // [direction][second]
}

func (p *pinger) Name() string { return "pinger" }

func (p *pinger) Start(env *Env) error {
	p.env = env
	var tick func()
	tick = func() {
		s := int(env.Now() / time.Second)
		for d, pair := range [2][2]int{{0, 1}, {1, 0}} {
			for len(p.sent[d]) <= s {
				p.sent[d] = append(p.sent[d], 0)
				p.got[d] = append(p.got[d], 0)
			}
			p.sent[d][s]++
			env.Send(pair[0], pair[1], 10, func() { p.got[d][s]++ })
		}
		env.After(10*time.Millisecond, tick)
	}
	env.After(0, tick)
	return nil
}

func (p *pinger) Admit(region, key int, cost int64) bool { return true }

// TestLossEvent: a loss event on region 1 drops about its share of the
// messages to and from it while in force (here from 2 s to 4 s, 60%), and
// none before or after (the network's own loss is 0).
func TestLossEvent(t *testing.T) {
	sc, err := scenario.Parse("loss", []byte(`
name: loss
duration: 6s
regions: [{name: a}, {name: b}]
network: {delay_ms: {a: {b: 5}}}
rule: {rate: 10}
demand: [{region: a, level: 0.1}]
events: [{kind: loss, regions: [b], at: 2s, for: 2s, loss: 0.6}]
`))
	if err != nil {
		t.Fatal(err)
	}
	p := &pinger{}
	if _, err := Run(context.Background(), sc, []Strategy{p}, Options{}); err != nil {
		t.Fatal(err)
	}
	for d := range 2 {
		for s := 0; s < 5; s++ { // the last second's messages may still be in flight at the end
			frac := float64(p.got[d][s]) / float64(p.sent[d][s])
			lossy := s == 2 || s == 3
			if lossy && (frac < 0.3 || frac > 0.5) || !lossy && frac != 1 {
				t.Errorf("direction %d second %d: %d of %d delivered (%.2f)", d, s, p.got[d][s], p.sent[d][s], frac)
			}
		}
	}
}
