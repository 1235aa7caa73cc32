package regional

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"unicode/utf8"

	"github.com/apportion/apportion/regional/header"
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
		h.e.metrics.request("http", Response{}, ErrInvalidRequest)
		w.Header().Set("Allow", http.MethodPost)
		badRequest(w, http.StatusMethodNotAllowed, "", "use POST")
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		h.e.metrics.request("http", Response{}, ErrInvalidRequest)
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
			badRequest(w, http.StatusBadRequest, re.Field, re.Field+": "+re.Msg) // as gRPC says it
		case errors.Is(err, ErrNoRules):
			badRequest(w, http.StatusServiceUnavailable, "", err.Error())
		default:
			badRequest(w, http.StatusInternalServerError, "", err.Error())
		}
		return
	}
	writeAnswer(w, resp, req.Cost)
}

// jsonKind names a Go kind as JSON spells its values.
func jsonKind(k reflect.Kind) string {
	switch k {
	case reflect.Struct, reflect.Map:
		return "object"
	case reflect.Slice, reflect.Array:
		return "array"
	case reflect.Bool:
		return "boolean"
	case reflect.String:
		return "string"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "integer"
	}
	return k.String()
}

// decodeCheck parses a strict JSON CheckLimit request. It returns the name
// of the offending field when it can tell.
func decodeCheck(body []byte) (Request, string, error) {
	var req Request
	if valid := utf8.Valid(body); !valid || hasSurrogateEscape(body) {
		// encoding/json would turn these into U+FFFD: one bucket for all.
		if err := invalidString(body); err != nil {
			return req, err.Field, err
		}
		if !valid {
			return req, "", errors.New("body is not valid UTF-8")
		}
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		var te *json.UnmarshalTypeError
		var se *json.SyntaxError
		switch {
		case errors.As(err, &te):
			field := te.Field
			if field == "" {
				field = "body"
			}
			return req, te.Field, fmt.Errorf("%s: must be a JSON %s, got %s", field, jsonKind(te.Type.Kind()), te.Value)
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
	if field, err := exactFields(body); err != nil {
		return req, field, err
	}
	return req, "", nil
}

// HeaderAnswer is the header writer's view of resp, the answer to a request
// of cost tokens: regional/header writes the headers of every front end
// (this HTTP API, the middleware, the Envoy service) from it.
func HeaderAnswer(resp Response, cost int64) header.Answer {
	a := header.Answer{Allowed: resp.Allowed, Cost: cost, Binding: resp.RuleID, Rules: make([]header.Rule, len(resp.Statuses)), FailOpen: resp.FailOpen}
	for i, s := range resp.Statuses {
		a.Rules[i] = header.Rule{ID: s.RuleID, Allowed: s.Allowed, Shadow: s.Shadow, Limit: s.Limit, Remaining: s.Remaining,
			RetryAfterMs: s.RetryAfterMs, ResetAfterMs: s.ResetAfterMs, WindowMs: s.WindowMs}
	}
	return a
}

// checkBody is the JSON body of an answer: the response, and for a
// rejection that waiting cannot help, the reason.
type checkBody struct {
	Response
	Reason string `json:"reason,omitempty"`
}

// writeAnswer writes the headers (regional/header), the status and the JSON
// body of an answer: 200, 429, or 413 when the cost is above what a rule
// can ever admit.
func writeAnswer(w http.ResponseWriter, resp Response, cost int64) {
	a := HeaderAnswer(resp, cost)
	header.Set(w.Header(), a)
	code, reason := header.Status(a)
	body := checkBody{Response: resp}
	if _, ok := w.Header()[header.RetryAfter]; !ok && !resp.Allowed {
		body.Reason = reason // waiting cannot help: say why
	}
	writeJSON(w, code, body)
}
