package regional

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// maxBody bounds a POST /v1/check body.
const maxBody = 64 << 10

// HTTPHandler serves POST /v1/check, /metrics, /healthz and /readyz.
type HTTPHandler struct {
	e        *Enforcer
	mux      *http.ServeMux
	ready    func() bool
	gatherer prometheus.Gatherer
}

// NewHTTPHandler returns the enforcer's HTTP API. gatherer serves /metrics
// (nil: no /metrics); ready reports readiness beyond a loaded rule set (nil: always).
func NewHTTPHandler(e *Enforcer, gatherer prometheus.Gatherer, ready func() bool) *HTTPHandler {
	h := &HTTPHandler{e: e, mux: http.NewServeMux(), ready: ready, gatherer: gatherer}
	h.mux.HandleFunc("/v1/check", h.check)
	h.mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "ok\n")
	})
	h.mux.HandleFunc("/readyz", h.readyz)
	if gatherer != nil {
		h.mux.Handle("/metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
	return h
}

func (h *HTTPHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.mux.ServeHTTP(w, r) }

func (h *HTTPHandler) readyz(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	switch {
	case !h.e.Ready():
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, "not ready: no rule set loaded\n")
	case h.ready != nil && !h.ready():
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, "not ready: shutting down\n")
	default:
		fmt.Fprintf(w, "ready breaker=%s\n", h.e.BreakerState())
	}
}

type errorBody struct {
	Error string `json:"error"`
	Field string `json:"field,omitempty"`
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

func badRequest(w http.ResponseWriter, code int, field, msg string) {
	writeJSON(w, code, errorBody{Error: msg, Field: field})
}

func (h *HTTPHandler) check(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		badRequest(w, http.StatusMethodNotAllowed, "", "use POST")
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			badRequest(w, http.StatusRequestEntityTooLarge, "", fmt.Sprintf("body is larger than %d bytes", maxBody))
			return
		}
		badRequest(w, http.StatusBadRequest, "", "reading body: "+err.Error())
		return
	}
	req, field, err := decodeCheck(body)
	if err != nil {
		h.e.metrics.request("http", Response{}, ErrInvalidRequest)
		badRequest(w, http.StatusBadRequest, field, err.Error())
		return
	}
	resp, err := h.e.Check(r.Context(), req)
	h.e.metrics.request("http", resp, err)
	if err != nil {
		var re *RequestError
		switch {
		case errors.As(err, &re):
			badRequest(w, http.StatusBadRequest, re.Field, re.Error())
		case errors.Is(err, ErrNoRules):
			badRequest(w, http.StatusServiceUnavailable, "", err.Error())
		default:
			badRequest(w, http.StatusInternalServerError, "", err.Error())
		}
		return
	}
	setHeaders(w.Header(), resp)
	code := http.StatusOK
	if !resp.Allowed {
		code = http.StatusTooManyRequests
	}
	writeJSON(w, code, resp)
}

// decodeCheck parses a strict JSON CheckLimit request. It returns the name
// of the offending field when it can tell.
func decodeCheck(body []byte) (Request, string, error) {
	var req Request
	if !utf8.Valid(body) {
		return req, "", errors.New("body is not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		var te *json.UnmarshalTypeError
		var se *json.SyntaxError
		switch {
		case errors.As(err, &te):
			return req, te.Field, fmt.Errorf("%s: must be a JSON %s", te.Field, te.Type.Kind())
		case errors.As(err, &se):
			return req, "", fmt.Errorf("invalid JSON at offset %d: %v", se.Offset, se)
		case strings.HasPrefix(err.Error(), "json: unknown field "):
			f := strings.Trim(strings.TrimPrefix(err.Error(), "json: unknown field "), `"`)
			return req, f, fmt.Errorf("%s: unknown field", f)
		case errors.Is(err, io.EOF):
			return req, "", errors.New("empty body: want a JSON object such as {\"client_key\":\"user:42\",\"resource\":\"GET /\"}")
		}
		return req, "", fmt.Errorf("invalid JSON: %v", err)
	}
	if dec.More() {
		return req, "", errors.New("invalid JSON: data after the object")
	}
	return req, "", nil
}

// setHeaders writes the rate-limit headers of the binding rule:
// X-RateLimit-Limit (tokens), X-RateLimit-Remaining (tokens),
// X-RateLimit-Reset (whole seconds until the bucket is full again / the
// window resets, rounded up), the IETF RateLimit-Policy and RateLimit fields,
// and on a rejection Retry-After (whole seconds, rounded up).
func setHeaders(h http.Header, r Response) {
	if r.RuleID == "" {
		return // no rule matched: nothing limits this request
	}
	reset := ceilSeconds(r.ResetAfterMs)
	h.Set("X-RateLimit-Limit", strconv.FormatInt(r.Limit, 10))
	h.Set("X-RateLimit-Remaining", strconv.FormatInt(r.Remaining, 10))
	h.Set("X-RateLimit-Reset", strconv.FormatInt(reset, 10))
	w := ceilSeconds(r.windowMs)
	if w < 1 {
		w = 1
	}
	name := strconv.Quote(r.RuleID)
	h.Set("RateLimit-Policy", fmt.Sprintf("%s;q=%d;w=%d", name, r.Limit, w))
	h.Set("RateLimit", fmt.Sprintf("%s;r=%d;t=%d", name, r.Remaining, reset))
	if !r.Allowed {
		ra := ceilSeconds(r.RetryAfterMs)
		if ra < 1 {
			ra = 1
		}
		h.Set("Retry-After", strconv.FormatInt(ra, 10))
	}
}

func ceilSeconds(ms int64) int64 {
	if ms <= 0 {
		return 0
	}
	return (ms + 999) / 1000
}
