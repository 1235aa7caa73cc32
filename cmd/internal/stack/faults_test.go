package stack

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/apportion/apportion/internal/testutil"
)

// TestFaultControl drives the fault control of a two-region stack over
// HTTP: every fault takes effect (the gateway proxies of the region cut
// and healed, a new Redis run id, the agent stopped and running again) and
// every bad request is refused with a status and an error naming what is
// wrong.
func TestFaultControl(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	testutil.RedisServerPath(t)
	s := startStack(t, Config{Regions: 2, Partitionable: true, FaultsAddr: "127.0.0.1:0"})
	base := "http://" + s.FaultsAddr + FaultsPath
	if !strings.Contains(s.Summary(), base+"/cut?region=eu-west") {
		t.Errorf("the summary has no fault line:\n%s", s.Summary())
	}
	call := func(method, path string, wantCode int, want string) {
		t.Helper()
		req, err := http.NewRequest(method, base+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != wantCode || !strings.Contains(string(b), want) {
			t.Errorf("%s %s: %d %s, want %d and %q", method, path, resp.StatusCode, b, wantCode, want)
		}
	}
	state := func() FaultState {
		t.Helper()
		resp, err := http.Get(base)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var st FaultState
		if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
			t.Fatal(err)
		}
		return st
	}
	linksCut := func(region string) (cut, all int) {
		for _, p := range s.proxies {
			if p.from == region || p.to == region {
				all++
				if p.IsCut() {
					cut++
				}
			}
		}
		return cut, all
	}

	if st := state(); len(st.Regions) != 2 || st.Regions[1].Cut || !st.Regions[1].Agent {
		t.Fatalf("state %+v, want two regions, none cut, agents running", st)
	}
	call("POST", "/cut?region=eu-west", 200, "gateways to every other region cut")
	if cut, all := linksCut("eu-west"); all == 0 || cut != all {
		t.Errorf("after cut: %d of eu-west's %d gateway links cut", cut, all)
	}
	if st := state(); !st.Regions[1].Cut {
		t.Errorf("state %+v after the cut", st)
	}
	call("POST", "/cut?region=eu-west", 409, "already cut")
	call("POST", "/heal?region=eu-west", 200, "healed")
	if cut, _ := linksCut("eu-west"); cut != 0 {
		t.Errorf("after heal: %d links still cut", cut)
	}

	runID := redisRunID(t, s.Regions[0].RedisAddr)
	before := runID()
	call("POST", "/restart-redis?region=us-east", 200, "restarted empty")
	if after := runID(); after == before {
		t.Errorf("run id %s unchanged after restart-redis", after)
	}

	call("POST", "/stop-agent?region=us-east", 200, "sync agent stopped")
	if st := state(); st.Regions[0].Agent {
		t.Errorf("state %+v after stop-agent", st)
	}
	call("POST", "/stop-agent?region=us-east", 409, "no sync agent is running")
	call("POST", "/start-agent?region=us-east", 200, "started again")
	call("POST", "/start-agent?region=us-east", 409, "the sync agent is running")
	if st := state(); !st.Regions[0].Agent {
		t.Errorf("state %+v after start-agent", st)
	}
	if _, err := Scrape(context.Background(), s.Regions[0].AgentHTTPAddr); err != nil {
		t.Errorf("the restarted agent does not serve its metrics at %s: %v", s.Regions[0].AgentHTTPAddr, err)
	}

	call("POST", "/cut?region=mars", 400, `region \"mars\": want one of us-east, eu-west`)
	call("POST", "/cut", 400, `region \"\"`)
	call("GET", "/cut?region=eu-west", 405, "use POST")
	call("POST", "", 405, "use GET")
	call("POST", "/explode?region=eu-west", 404, `no fault \"explode\"`)
}

// startStack starts a stack of cfg, closed (and its error reported) when
// the test ends.
func startStack(t *testing.T, cfg Config) *Stack {
	t.Helper()
	s, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return s
}
