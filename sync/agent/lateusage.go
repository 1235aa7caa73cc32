package agent

import (
	"strings"
	"time"

	"github.com/apportion/apportion/regional/usage"
)

// Late usage. Every enforcer publishes a batch at every usage flush
// (usage.DefaultInterval, on the wall clock), an empty one when it has
// no usage, so an agent that hears an enforcer at all hears it at every
// flush. The agent keeps when it last heard each enforcer (by the id in
// its batches). At a tick, an enforcer heard within UsageGrace but not
// for more than a flush and a quarter has missed a flush: its usage is
// late, not zero. That is a stalled NATS server (paused, or starved of
// CPU: it holds its connections and delivers nothing, then everything),
// a slow link, or the enforcer gone. The tick then leaves the demand
// estimates as they are (driver.UsageLate), and the first tick whose
// usage is complete folds in everything that came meanwhile as one
// interval. Without it, a stall of a second read as traffic that
// stopped: the estimates decayed (half in 250 ms), the region gave its
// global keys' shares away, and it ran at about its floors until NATS
// delivered again (an explorer: SIGSTOP of the NATS servers for 1 s).
//
// The wait is bounded: an enforcer not heard for UsageGrace counts as
// gone (one that stopped waits that long once), and a tick observes
// anyway once the estimates have waited UsageGrace, so ids that come and
// go (anyone who can publish on the usage subject can send any) hold
// them at most that long at a time. At most maxEnforcers ids are kept;
// further ones make nothing late. An enforcer of a release that sends no
// empty batches is late after every burst of traffic it stops sending:
// the estimates then follow its region's demand UsageGrace late.

// lateAfter is how long an enforcer heard at every flush may go unheard
// before its usage counts as late: a flush and a quarter. The agent ticks
// half a flush after the enforcers flush (nextTick), so an enforcer on
// time was heard about half a flush ago, and one that missed a flush
// about one and a half.
const lateAfter = usage.DefaultInterval * 5 / 4

// maxEnforcers bounds the enforcer ids kept.
const maxEnforcers = 4096

// heardEnforcer records a batch of enforcer id received at now (called
// from onUsage, with usageMu held).
func (a *Agent) heardEnforcer(id string, now time.Time) {
	if _, ok := a.enforcers[id]; !ok {
		if len(a.enforcers) >= maxEnforcers {
			return
		}
		if a.enforcers == nil {
			a.enforcers = map[string]time.Time{}
		}
		id = strings.Clone(id) // not the message's bytes
	}
	a.enforcers[id] = now
}

// usageLate reports whether some of the usage of the interval that ends
// at now is late and the demand estimates should wait for it (loop). It
// forgets the enforcers not heard within UsageGrace, and sets
// apportion_sync_usage_enforcers.
func (a *Agent) usageLate(now time.Time) bool {
	late := false
	a.usageMu.Lock()
	for id, at := range a.enforcers {
		switch silent := now.Sub(at); {
		case silent > a.cfg.UsageGrace:
			delete(a.enforcers, id)
		case silent > lateAfter:
			late = true
		}
	}
	n := len(a.enforcers)
	a.usageMu.Unlock()
	a.m.enforcers.Set(float64(n))
	if !late || a.cfg.UsageGrace <= 0 {
		a.waitingSince = time.Time{}
		return false
	}
	if a.waitingSince.IsZero() {
		a.waitingSince = now
	}
	if now.Sub(a.waitingSince) >= a.cfg.UsageGrace {
		a.waitingSince = time.Time{} // observe now; the next tick may wait again
		return false
	}
	a.m.lateTicks.Inc()
	return true
}
