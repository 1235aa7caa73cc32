// Package admin serves the rules admin HTTP API over an etcdstore.Store and
// provides a client for it:
//
//	PUT    /rules/{id}   one rule document; If-Match: "<rev>" or If-None-Match: *
//	GET    /rules/{id}   the rule, ETag: "<mod revision>"
//	GET    /rules        all valid rules as a JSON array, ETag: "<store revision>",
//	                     Apportion-Invalid-Documents: <how many stored documents are not valid rules>
//	GET    /rules?include=invalid
//	                     {"rules": [...], "invalid": [{"id","revision","error","field"}, ...]}
//	DELETE /rules/{id}   If-Match honoured
//	GET    /healthz      no auth
//
// Invariants: a request that is refused changes nothing stored; every refusal
// is a JSON body {"error": "...", "field": "..."} with field set when one
// input is at fault (400 invalid, 401 auth, 404, 412 stale precondition, 413
// body over MaxBodyBytes, 415 not JSON, 422 the stored document is not a
// valid rule, 503 the store did not answer). Bodies are read through
// http.MaxBytesReader, so an oversized body is refused without being read
// whole. Every /rules route needs the bearer token unless auth was explicitly
// disabled with WithoutAuth.
package admin

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
)

// MaxBodyBytes is the largest rule document accepted (64 KiB).
const MaxBodyBytes = 64 << 10

// DefaultStoreTimeout bounds each request's calls to the store (2 s).
const DefaultStoreTimeout = 2 * time.Second

// Option configures a Handler.
type Option func(*Handler) error

// WithToken requires "Authorization: Bearer <token>" on every /rules route.
// The comparison takes constant time. There is no default: New needs either
// WithToken or WithoutAuth.
func WithToken(token string) Option {
	return func(h *Handler) error {
		if token == "" {
			return errors.New("admin: empty token")
		}
		sum := sha256.Sum256([]byte(token))
		h.tokenHash = &sum
		return nil
	}
}

// WithoutAuth serves without authentication (a loopback-only test stack).
func WithoutAuth() Option {
	return func(h *Handler) error {
		h.noAuth = true
		return nil
	}
}

// WithLogger sets the logger for writes and server errors. Default: discard.
func WithLogger(l *slog.Logger) Option {
	return func(h *Handler) error {
		if l == nil {
			return errors.New("admin: nil logger")
		}
		h.log = l
		return nil
	}
}

// WithStoreTimeout bounds the time a request spends in the store (etcd):
// past it the answer is 503. Default DefaultStoreTimeout.
func WithStoreTimeout(d time.Duration) Option {
	return func(h *Handler) error {
		if d <= 0 {
			return errors.New("admin: store timeout must be positive")
		}
		h.timeout = d
		return nil
	}
}

// Handler is the admin API. It is safe for concurrent use.
type Handler struct {
	store     *etcdstore.Store
	tokenHash *[sha256.Size]byte
	noAuth    bool
	timeout   time.Duration
	log       *slog.Logger
	mux       *http.ServeMux
}

// New returns the admin API over store. It returns an error unless exactly
// one of WithToken and WithoutAuth is given.
func New(store *etcdstore.Store, opts ...Option) (*Handler, error) {
	if store == nil {
		return nil, errors.New("admin: nil store")
	}
	h := &Handler{store: store, timeout: DefaultStoreTimeout, log: slog.New(slog.DiscardHandler)}
	for _, o := range opts {
		if err := o(h); err != nil {
			return nil, err
		}
	}
	switch {
	case h.tokenHash == nil && !h.noAuth:
		return nil, errors.New("admin: no auth configured: use WithToken, or WithoutAuth to serve without authentication")
	case h.tokenHash != nil && h.noAuth:
		return nil, errors.New("admin: WithToken and WithoutAuth are exclusive")
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "ok\n")
	})
	mux.Handle("GET /rules", h.auth(h.list))
	mux.Handle("GET /rules/{id}", h.auth(h.get))
	mux.Handle("PUT /rules/{id}", h.auth(h.put))
	mux.Handle("DELETE /rules/{id}", h.auth(h.delete))
	h.mux = mux
	return h, nil
}

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.mux.ServeHTTP(w, r) }

// apiError is the JSON error body.
type apiError struct {
	Error string `json:"error"`
	Field string `json:"field,omitempty"`
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, code int, field, format string, args ...any) {
	writeJSON(w, code, apiError{Error: fmt.Sprintf(format, args...), Field: field})
}

func (h *Handler) auth(next http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !h.noAuth {
			tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			sum := sha256.Sum256([]byte(tok))
			if !ok || subtle.ConstantTimeCompare(sum[:], h.tokenHash[:]) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="apportion-admin"`)
				writeError(w, http.StatusUnauthorized, "Authorization", "missing or wrong bearer token")
				return
			}
		}
		ctx, cancel := context.WithTimeout(r.Context(), h.timeout)
		defer cancel()
		next(w, r.WithContext(ctx))
	})
}

// storeError maps a store error to a response.
func (h *Handler) storeError(w http.ResponseWriter, r *http.Request, err error) {
	var fe *rules.FieldError
	switch {
	case errors.Is(err, etcdstore.ErrNotFound):
		writeError(w, http.StatusNotFound, "", "%v", err)
	case errors.Is(err, etcdstore.ErrConflict):
		// Name the precondition the request gave; none: the rule kept
		// changing while the store checked an unconditional put.
		field := ""
		switch {
		case r.Header.Get("If-None-Match") != "":
			field = "If-None-Match"
		case r.Header.Get("If-Match") != "":
			field = "If-Match"
		}
		writeError(w, http.StatusPreconditionFailed, field, "%v", err)
	case errors.Is(err, etcdstore.ErrInvalidDocument):
		// A hand-written bad document (a wrong field, or not JSON at all):
		// the server's data is at fault, not the store's availability.
		writeError(w, http.StatusUnprocessableEntity, errField(err), "%v", err)
	case errors.As(err, &fe):
		writeError(w, http.StatusBadRequest, fe.Field, "%v", err)
	case errors.Is(r.Context().Err(), context.Canceled):
		// The client went away; nothing useful to answer.
	default:
		h.log.Error("admin: store error", "method", r.Method, "path", r.URL.Path, "err", err)
		msg := fmt.Sprintf("rule store unavailable: %v", err)
		if r.Context().Err() != nil {
			msg = fmt.Sprintf("rule store unavailable: etcd did not answer within %v (down or unreachable?); retry later", h.timeout)
		}
		if r.Method != http.MethodGet {
			msg += "; the change may or may not have been applied: GET the rule to see"
		}
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, "", "%s", msg)
	}
}

func etag(rev int64) string { return `"` + strconv.FormatInt(rev, 10) + `"` }

// parseETag reads one strong entity tag holding a revision, exactly as etag
// writes it (entity tags compare character by character: "042" is not "42").
func parseETag(s string) (int64, error) {
	s = strings.TrimSpace(s)
	if len(s) < 3 || s[0] != '"' || s[len(s)-1] != '"' {
		return 0, fmt.Errorf("want one entity tag such as \"42\" (quotes included), got %q", s)
	}
	rev, err := strconv.ParseInt(s[1:len(s)-1], 10, 64)
	if err != nil || rev <= 0 || etag(rev) != s {
		return 0, fmt.Errorf("entity tag %s is not a revision from this API", s)
	}
	return rev, nil
}

// InvalidDocumentsHeader is the header of GET /rules that counts the stored
// documents that are not valid rules (left out of the array; GET
// /rules?include=invalid lists them).
const InvalidDocumentsHeader = "Apportion-Invalid-Documents"

// listing is the body of GET /rules?include=invalid.
type listing struct {
	Rules   []rules.Rule                `json:"rules"`
	Invalid []etcdstore.InvalidDocument `json:"invalid"`
}

func (h *Handler) list(w http.ResponseWriter, r *http.Request) {
	include := r.URL.Query().Get("include")
	if include != "" && include != "invalid" {
		writeError(w, http.StatusBadRequest, "include", "include=%q: only include=invalid is supported", include)
		return
	}
	rs, bad, rev, err := h.store.ListAll(r.Context())
	if err != nil {
		h.storeError(w, r, err)
		return
	}
	w.Header().Set("ETag", etag(rev))
	w.Header().Set(InvalidDocumentsHeader, strconv.Itoa(len(bad)))
	if include == "invalid" {
		if bad == nil {
			bad = []etcdstore.InvalidDocument{}
		}
		writeJSON(w, http.StatusOK, listing{Rules: rs, Invalid: bad})
		return
	}
	writeJSON(w, http.StatusOK, rs)
}

func (h *Handler) get(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	rule, rev, err := h.store.Get(r.Context(), id)
	if errors.Is(err, etcdstore.ErrNotFound) {
		// Nothing stored, and no rule could be: say why (a document
		// written by hand under such an id is still served above).
		var fe *rules.FieldError
		if verr := (&rules.Rule{ID: id}).Validate(); errors.As(verr, &fe) && fe.Field == "id" {
			writeError(w, http.StatusBadRequest, "id", "%v (and nothing is stored under it)", verr)
			return
		}
	}
	if err != nil {
		h.storeError(w, r, err)
		return
	}
	w.Header().Set("ETag", etag(rev))
	writeJSON(w, http.StatusOK, rule)
}

// precondition reads If-Match / If-None-Match into a store precondition.
// For "If-Match: *" it resolves the current revision (the rule must exist).
func (h *Handler) precondition(w http.ResponseWriter, r *http.Request, id string, allowCreate bool) (int64, bool) {
	im, inm := r.Header.Get("If-Match"), r.Header.Get("If-None-Match")
	switch {
	case im != "" && inm != "":
		writeError(w, http.StatusBadRequest, "If-None-Match", "give If-Match or If-None-Match, not both")
		return 0, false
	case inm != "":
		if strings.TrimSpace(inm) != "*" || !allowCreate {
			writeError(w, http.StatusBadRequest, "If-None-Match", "only \"If-None-Match: *\" (create only) is supported, on PUT")
			return 0, false
		}
		return etcdstore.MustNotExist, true
	case strings.TrimSpace(im) == "*":
		_, rev, err := h.store.Get(r.Context(), id)
		if errors.Is(err, etcdstore.ErrNotFound) {
			writeError(w, http.StatusPreconditionFailed, "If-Match", "rule %q does not exist", id)
			return 0, false
		}
		if err != nil && !errors.Is(err, etcdstore.ErrInvalidDocument) {
			h.storeError(w, r, err)
			return 0, false
		}
		return rev, true
	case im != "":
		rev, err := parseETag(im)
		if err != nil {
			writeError(w, http.StatusBadRequest, "If-Match", "%v", err)
			return 0, false
		}
		return rev, true
	}
	return etcdstore.Unconditional, true
}

func (h *Handler) put(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	ct := r.Header.Get("Content-Type")
	if mt, _, err := mime.ParseMediaType(ct); err != nil || (mt != "application/json" && !strings.HasSuffix(mt, "+json")) {
		writeError(w, http.StatusUnsupportedMediaType, "Content-Type", "Content-Type must be application/json, got %q", ct)
		return
	}
	if r.ContentLength > MaxBodyBytes {
		writeError(w, http.StatusRequestEntityTooLarge, "", "rule document is %d bytes; the limit is %d", r.ContentLength, MaxBodyBytes)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			writeError(w, http.StatusRequestEntityTooLarge, "", "rule document exceeds the limit of %d bytes", MaxBodyBytes)
			return
		}
		writeError(w, http.StatusBadRequest, "", "reading body: %v", err)
		return
	}
	doc, err := withPathID(body, id)
	if err != nil {
		writeError(w, http.StatusBadRequest, errField(err), "%v", err)
		return
	}
	rule, err := rules.ParseRule(doc)
	if err != nil {
		writeError(w, http.StatusBadRequest, errField(err), "%v", err)
		return
	}
	ifMatch, ok := h.precondition(w, r, id, true)
	if !ok {
		return
	}
	rev, err := h.store.Put(r.Context(), rule, ifMatch)
	if err != nil {
		h.storeError(w, r, err)
		return
	}
	h.log.Info("admin: rule stored", "rule", id, "revision", rev)
	w.Header().Set("ETag", etag(rev))
	rule.Normalize()
	writeJSON(w, http.StatusOK, rule)
}

func (h *Handler) delete(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	ifMatch, ok := h.precondition(w, r, id, false)
	if !ok {
		return
	}
	if err := h.store.Delete(r.Context(), id, ifMatch); err != nil {
		h.storeError(w, r, err)
		return
	}
	h.log.Info("admin: rule deleted", "rule", id)
	w.WriteHeader(http.StatusNoContent)
}

func errField(err error) string {
	var fe *rules.FieldError
	if errors.As(err, &fe) {
		return fe.Field
	}
	return ""
}

// withPathID checks the body's "id" against the path and fills it in when
// the body leaves it out. Everything else is left to rules.ParseRule.
func withPathID(body []byte, id string) ([]byte, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil {
		return nil, fmt.Errorf("body is not a JSON rule document: %w", err)
	}
	if obj == nil {
		return nil, errors.New("body is not a JSON rule document: null")
	}
	raw, ok := obj["id"]
	if !ok {
		// Add the id in front and leave the rest as written: re-encoding the
		// map would drop a repeated field that rules.ParseRule must refuse.
		idJSON, _ := json.Marshal(id)
		rest := bytes.TrimLeft(body, " \t\r\n")[1:] // after the '{'
		sep := []byte(",")
		if bytes.TrimLeft(rest, " \t\r\n")[0] == '}' {
			sep = nil
		}
		return slices.Concat([]byte(`{"id":`), idJSON, sep, rest), nil
	}
	var bodyID string
	if err := json.Unmarshal(raw, &bodyID); err != nil {
		return nil, &rules.FieldError{Field: "id", Msg: "must be a string"}
	}
	if bodyID != id {
		return nil, &rules.FieldError{RuleID: bodyID, Field: "id", Msg: fmt.Sprintf("%q in the body does not match %q in the path", bodyID, id)}
	}
	return body, nil
}
