package stack

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
)

// FaultsPath is the prefix of the fault control's endpoints.
const FaultsPath = "/faults"

// faults is the stack's fault control (Config.FaultsAddr): one region at a
// time, its NATS gateways cut or healed, its redis-server restarted empty,
// its sync agent stopped or started again, by hand, to watch what the
// limiter does under each fault.
type faults struct {
	s  *Stack
	mu sync.Mutex // serializes the faults
}

// FaultState is what GET /faults answers: per region, whether its gateways
// are cut and whether its sync agent runs.
type FaultState struct {
	Regions []RegionFaults `json:"regions"`
}

// RegionFaults is one region's entry of FaultState.
type RegionFaults struct {
	Region string `json:"region"`
	Cut    bool   `json:"cut"`
	Agent  bool   `json:"agent_running"`
}

// faultActions are the POST endpoints, by the path after FaultsPath.
var faultActions = map[string]string{
	"/cut":           "its NATS gateways to every other region cut (connections dropped and refused until healed; etcd and Redis stay reachable)",
	"/heal":          "its NATS gateways healed (they reconnect by themselves)",
	"/restart-redis": "its redis-server restarted empty on the same port (a new run id: the sync agent writes its records and marker again)",
	"/stop-agent":    "its sync agent stopped (its store falls to the floors once the marker's lease ends; peers reclaim its share)",
	"/start-agent":   "its sync agent started again, with no state",
}

// ServeHTTP answers GET /faults with the FaultState and POST
// /faults/<action>?region=R with {"region":R,"done":"..."}; an error is
// {"error":"..."} with 400 (no or unknown region), 404 (no such action),
// 405 (another method), 409 (the region is already in that state, or the
// stack cannot do it: no proxies, the embedded Redis).
func (f *faults) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	action, ok := strings.CutPrefix(r.URL.Path, FaultsPath)
	switch {
	case !ok:
		faultError(w, http.StatusNotFound, "no such path %q: the fault control is under %s", r.URL.Path, FaultsPath)
		return
	case action == "" || action == "/":
		if r.Method != http.MethodGet {
			w.Header().Set("Allow", http.MethodGet)
			faultError(w, http.StatusMethodNotAllowed, "%s %s: use GET", r.Method, r.URL.Path)
			return
		}
		writeJSON(w, http.StatusOK, f.state())
		return
	}
	done, ok := faultActions[action]
	if !ok {
		faultError(w, http.StatusNotFound, "no fault %q: the faults are cut, heal, restart-redis, stop-agent and start-agent", strings.TrimPrefix(action, "/"))
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		faultError(w, http.StatusMethodNotAllowed, "%s %s: use POST", r.Method, r.URL.Path)
		return
	}
	region := r.URL.Query().Get("region")
	if f.s.regionIndex(region) < 0 {
		faultError(w, http.StatusBadRequest, "region %q: want one of %s (?region=NAME)", region, strings.Join(f.s.cfg.RegionNames, ", "))
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var err error
	switch action {
	case "/cut", "/heal":
		cut := action == "/cut"
		if f.s.isCut(region) == cut {
			faultError(w, http.StatusConflict, "region %s is already %s", region, map[bool]string{true: "cut", false: "healed"}[cut])
			return
		}
		err = f.s.Partition(region, cut)
	case "/restart-redis":
		err = f.s.RestartRedis(region)
	case "/stop-agent":
		err = f.s.StopAgent(region)
	case "/start-agent":
		err = f.s.StartAgent(r.Context(), region)
	}
	if err != nil {
		code := http.StatusInternalServerError
		for _, e := range []error{ErrNoProxy, ErrEmbeddedRedis, ErrAgentRunning, ErrAgentStopped} {
			if errors.Is(err, e) {
				code = http.StatusConflict
			}
		}
		faultError(w, code, "%s %s: %v", strings.TrimPrefix(action, "/"), region, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"region": region, "done": done})
}

func (f *faults) state() FaultState {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	var st FaultState
	for _, r := range f.s.Regions {
		st.Regions = append(st.Regions, RegionFaults{Region: r.Name, Cut: f.s.isCut(r.Name), Agent: f.s.stopAgent[r.Name] != nil})
	}
	return st
}

func faultError(w http.ResponseWriter, code int, format string, args ...any) {
	writeJSON(w, code, map[string]string{"error": fmt.Sprintf(format, args...)})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

// isCut reports whether region is cut off (Partition), whoever cut it,
// over HTTP or from Go. Not what its links' proxies say: a link is cut
// while either of its regions is, so a region whose peers are all cut has
// every link cut without being cut itself, and a cut region's link to
// another is cut until both are healed.
func (s *Stack) isCut(region string) bool {
	s.cutMu.Lock()
	defer s.cutMu.Unlock()
	return s.cut[region]
}

// serveFaults listens on addr and serves the fault control until Close.
func (s *Stack) serveFaults(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("stack: fault control: %w", err)
	}
	srv := &http.Server{Handler: &faults{s: s}}
	s.faultSrv = srv
	s.FaultsAddr = ln.Addr().String()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		srv.Serve(ln)
	}()
	return nil
}
