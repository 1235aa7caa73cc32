package enforcerd

import (
	"log/slog"
	"net/http"
	"time"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/prometheus/client_golang/prometheus"
)

// metricAdminRequests counts admin API requests by result.
const metricAdminRequests = "apportion_admin_requests_total"

// adminResults are the values of apportion_admin_requests_total's result
// label: ok (answered 1xx to 3xx), unauthorized (401: missing or wrong
// bearer token), invalid (another 4xx: a bad rule, a failed precondition,
// not found), error (5xx: etcd unavailable).
var adminResults = []string{"ok", "unauthorized", "invalid", "error"}

// adminUnauthorizedEvery is the least time between two warnings of refused
// admin requests; the lines in between are counted in the next one's
// "suppressed".
const adminUnauthorizedEvery = 10 * time.Second

// maxLoggedPath bounds the request path a warning quotes (the client chose it).
const maxLoggedPath = 256

// adminAudit serves the admin API and leaves a trace of every request: it
// counts each by result, warns (at most once per adminUnauthorizedEvery)
// of those refused for their token with the caller's address, and a
// request that may change rules (not GET or HEAD) is served by a handler
// whose log lines (the rule stored or deleted, a store error) carry
// remote_addr.
type adminAudit struct {
	shared   http.Handler                             // for GET and HEAD
	withLog  func(*slog.Logger) (http.Handler, error) // the admin API logging to a given logger
	log      *slog.Logger
	sampled  *logsample.Logger
	requests map[string]prometheus.Counter // by result
}

// newAdminCounter is apportion_admin_requests_total, a series per result.
func newAdminCounter(region string) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: metricAdminRequests, ConstLabels: prometheus.Labels{"region": region},
		Help: "Admin API requests by result: ok, unauthorized (missing or wrong bearer token; also logged, at most once per 10 s, with the caller's address), invalid (another 4xx), error (5xx)."},
		[]string{"result"})
	for _, r := range adminResults {
		c.WithLabelValues(r)
	}
	return c
}

func newAdminAudit(withLog func(*slog.Logger) (http.Handler, error), log *slog.Logger, requests *prometheus.CounterVec) (*adminAudit, error) {
	shared, err := withLog(log)
	if err != nil {
		return nil, err
	}
	a := &adminAudit{shared: shared, withLog: withLog, log: log, sampled: logsample.New(log, adminUnauthorizedEvery),
		requests: map[string]prometheus.Counter{}}
	for _, r := range adminResults {
		a.requests[r] = requests.WithLabelValues(r)
	}
	return a, nil
}

// statusWriter records the status code of a response.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.code == 0 {
		w.code = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

func (a *adminAudit) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := a.shared
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		var err error
		if h, err = a.withLog(a.log.With("remote_addr", r.RemoteAddr)); err != nil {
			a.log.Error("admin: handler", "err", err) // not reached: the options were checked at start
			http.Error(w, "internal error", http.StatusInternalServerError)
			a.requests["error"].Inc()
			return
		}
	}
	sw := &statusWriter{ResponseWriter: w}
	h.ServeHTTP(sw, r)
	code := sw.code
	if code == 0 {
		code = http.StatusOK
	}
	switch {
	case code == http.StatusUnauthorized:
		a.requests["unauthorized"].Inc()
		path := r.URL.Path
		if len(path) > maxLoggedPath {
			path = path[:maxLoggedPath] + "..."
		}
		a.sampled.Log(slog.LevelWarn, "admin-unauthorized", "admin: request refused: missing or wrong bearer token",
			"remote_addr", r.RemoteAddr, "method", r.Method, "path", path)
	case code >= 500:
		a.requests["error"].Inc()
	case code >= 400:
		a.requests["invalid"].Inc()
	default:
		a.requests["ok"].Inc()
	}
}
