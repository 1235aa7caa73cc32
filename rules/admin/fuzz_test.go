package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
)

// FuzzParseETag: an If-Match value is accepted exactly when it is an entity
// tag the API writes, and then names that revision.
func FuzzParseETag(f *testing.F) {
	f.Add(`"42"`)
	f.Fuzz(func(t *testing.T, s string) {
		rev, err := parseETag(s)
		if err != nil {
			if !strings.Contains(err.Error(), "entity tag") {
				t.Fatalf("error %q does not say what is wrong", err)
			}
			return
		}
		if rev <= 0 || etag(rev) != strings.TrimSpace(s) {
			t.Fatalf("parseETag(%q) = %d, which the API writes as %s", s, rev, etag(rev))
		}
		if back, err := parseETag(etag(rev)); err != nil || back != rev {
			t.Fatalf("parseETag(etag(%d)) = %d %v", rev, back, err)
		}
	})
}

// topFields returns the top-level field names and raw values of a JSON
// object, in order, repeats included.
func topFields(t *testing.T, doc []byte) []string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(doc))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("%s is not an object: %v %v", doc, tok, err)
	}
	var out []string
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			t.Fatalf("%s: %v", doc, err)
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			t.Fatalf("%s: %v", doc, err)
		}
		out = append(out, k.(string)+"="+string(raw))
	}
	return out
}

// FuzzWithPathID: the body the admin API hands to rules.ParseRule is the
// client's body, field for field (repeats included, so that ParseRule can
// refuse them), with the path's id in front when the body has none; a body
// whose id differs from the path's is refused naming "id".
func FuzzWithPathID(f *testing.F) {
	f.Add([]byte(goodDoc), "orders")
	f.Fuzz(func(t *testing.T, body []byte, id string) {
		doc, err := withPathID(body, id)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error")
			}
			var fe *rules.FieldError
			if errors.As(err, &fe) && fe.Field != "id" {
				t.Fatalf("error %v names %q, not id", err, fe.Field)
			}
			return
		}
		got, want := topFields(t, doc), topFields(t, body)
		if !reflect.DeepEqual(got, want) {
			idJSON, _ := json.Marshal(id)
			if !reflect.DeepEqual(got, append([]string{"id=" + string(idJSON)}, want...)) {
				t.Fatalf("withPathID(%s, %q) = %s: fields %q, the body's %q", body, id, doc, got, want)
			}
		}
		if r, err := rules.ParseRule(doc); err == nil && r.ID != id {
			t.Fatalf("withPathID(%s, %q) parses as rule %q", body, id, r.ID)
		}
	})
}

// FuzzHandler sends arbitrary requests to the admin API over a real etcd:
// every answer has a documented status, every refusal is a JSON error, a
// refused request changes nothing stored, and a stored rule reads back as
// the API answered it.
func FuzzHandler(f *testing.F) {
	f.Add("PUT", "/rules/orders", `"1"`, "", []byte(goodDoc))
	e := testutil.StartEtcd(f)
	c := e.Client(f)
	s, err := etcdstore.New(c)
	if err != nil {
		f.Fatal(err)
	}
	h, err := New(s, WithToken(token))
	if err != nil {
		f.Fatal(err)
	}
	revision := func(t *testing.T) int64 {
		resp, err := c.Get(context.Background(), "revision-probe")
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	documented := map[int]bool{200: true, 204: true, 400: true, 401: true, 404: true, 412: true, 413: true, 415: true, 422: true, 503: true}
	f.Fuzz(func(t *testing.T, method, target, ifMatch, ifNoneMatch string, body []byte) {
		req, err := http.NewRequest(method, "http://admin"+target, bytes.NewReader(body))
		if err != nil || req.URL.Path == "" || req.URL.Path[0] != '/' {
			return // net/http would not deliver it
		}
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		if ifMatch != "" {
			req.Header.Set("If-Match", ifMatch)
		}
		if ifNoneMatch != "" {
			req.Header.Set("If-None-Match", ifNoneMatch)
		}
		before := revision(t)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		code := rec.Code
		if rec.Header().Get("Content-Type") != "application/json" {
			// The mux's own answers: no route (404), wrong method (405), a
			// path to clean (redirect). They never reach the store.
			if code != 404 && code != 405 && code/100 != 3 {
				t.Fatalf("%s %s: %d with Content-Type %q", method, target, code, rec.Header().Get("Content-Type"))
			}
			if revision(t) != before {
				t.Fatalf("%s %s: the mux answered %d but the store changed", method, target, code)
			}
			return
		}
		if !documented[code] {
			t.Fatalf("%s %s: undocumented status %d: %s", method, target, code, rec.Body)
		}
		if code >= 300 {
			var ae apiError
			if err := json.Unmarshal(rec.Body.Bytes(), &ae); err != nil || ae.Error == "" {
				t.Fatalf("%s %s: %d with a body that is not a JSON error: %q", method, target, code, rec.Body)
			}
			// 503: the store did not answer in time; the write may or may not be in.
			if code != http.StatusServiceUnavailable && revision(t) != before {
				t.Fatalf("%s %s: refused (%d %s) but the store changed", method, target, code, ae.Error)
			}
			return
		}
		if method != http.MethodPut {
			return
		}
		var put rules.Rule
		if err := json.Unmarshal(rec.Body.Bytes(), &put); err != nil {
			t.Fatalf("PUT answer %s: %v", rec.Body, err)
		}
		got, rev, err := s.Get(context.Background(), put.ID)
		if err != nil || !reflect.DeepEqual(got, put) {
			t.Fatalf("PUT answered %+v, the store holds %+v (%v)", put, got, err)
		}
		if tag := rec.Header().Get("ETag"); tag != `"`+strconv.FormatInt(rev, 10)+`"` {
			t.Fatalf("PUT ETag %s, stored at revision %d", tag, rev)
		}
	})
}

// A body without an id is not re-encoded: a repeated field is still refused
// (re-encoding kept only the last value and stored it).
func TestPutWithoutIDRefusesRepeatedField(t *testing.T) {
	e := newEnv(t)
	body := `{"algorithm":"fixed_window","limit":1,"limit":1000000,"window":"1s"}`
	r := e.do(t, "PUT", "/rules/r", body, nil)
	if r.code != http.StatusBadRequest || r.err.Field != "limit" || !strings.Contains(r.err.Error, "more than once") {
		t.Fatalf("got %d %+v, want 400 naming limit", r.code, r.err)
	}
	if got := e.stored(t); len(got) != 0 {
		t.Fatalf("stored %v", got)
	}
	for _, tag := range []string{`"+1"`, `"01"`} {
		if r := e.do(t, "DELETE", "/rules/r", "", map[string]string{"If-Match": tag}); r.code != http.StatusBadRequest || r.err.Field != "If-Match" {
			t.Fatalf("If-Match %s: %d %+v, want 400 naming If-Match", tag, r.code, r.err)
		}
	}
}
