package admin

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
)

// badDocs are stored documents that are not valid rules, with the field the
// answer names ("" when none is at fault: not a rule object at all).
var badDocs = map[string]struct{ doc, field string }{
	"notjson":  {`not json at all`, ""},
	"empty":    {``, ""},
	"truncate": {`{"id":"truncate"`, ""},
	"badcap":   {`{"id":"badcap","algorithm":"token_bucket","capacity":-1,"refill_per_second":1}`, "capacity"},
}

func (e *env) storeRaw(t *testing.T, id, doc string) {
	t.Helper()
	if _, err := e.etcd.Put(context.Background(), etcdstore.DefaultPrefix+id, doc); err != nil {
		t.Fatal(err)
	}
}

// Every stored document that is not a valid rule is answered 422 (the
// server's data is at fault), never 503 with Retry-After (the store is up):
// not JSON, empty and truncated documents as a wrong field is.
func TestInvalidStoredDocumentIs422(t *testing.T) {
	e := newEnv(t)
	for id, b := range badDocs {
		e.storeRaw(t, id, b.doc)
	}
	for id, b := range badDocs {
		t.Run(id, func(t *testing.T) {
			r := e.do(t, "GET", "/rules/"+id, "", nil)
			if r.code != http.StatusUnprocessableEntity || r.err.Field != b.field || r.hdr.Get("Retry-After") != "" ||
				!strings.Contains(r.err.Error, "invalid rule document") {
				t.Fatalf("GET %s: %d %v %s, want 422 naming field %q, no Retry-After", id, r.code, r.hdr, r.body, b.field)
			}
			// The client reads it back as the store's error.
			c, err := NewClient(e.srv.URL, token, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, _, err := c.Get(context.Background(), id); !errors.Is(err, etcdstore.ErrInvalidDocument) {
				t.Fatalf("client Get %s: %v, want ErrInvalidDocument", id, err)
			}
		})
	}
}

// GET /rules counts the invalid documents it leaves out in a header;
// GET /rules?include=invalid lists them, and Client.ListAll returns them.
func TestListShowsInvalidDocuments(t *testing.T) {
	e := newEnv(t)
	if r := e.do(t, "PUT", "/rules/orders", goodDoc, nil); r.code != 200 {
		t.Fatalf("seed: %d %s", r.code, r.body)
	}
	r := e.do(t, "GET", "/rules", "", nil)
	if r.code != 200 || r.hdr.Get(InvalidDocumentsHeader) != "0" {
		t.Fatalf("GET /rules with no invalid document: %d %v", r.code, r.hdr)
	}
	for id, b := range badDocs {
		e.storeRaw(t, id, b.doc)
	}
	r = e.do(t, "GET", "/rules", "", nil)
	var plain []rules.Rule
	if err := json.Unmarshal(r.body, &plain); err != nil || r.code != 200 || len(plain) != 1 || r.hdr.Get(InvalidDocumentsHeader) != "4" {
		t.Fatalf("GET /rules: %d %v %s (%v), want the valid rule and %s: 4", r.code, r.hdr, r.body, err, InvalidDocumentsHeader)
	}
	r = e.do(t, "GET", "/rules?include=invalid", "", nil)
	var l struct {
		Rules   []rules.Rule                `json:"rules"`
		Invalid []etcdstore.InvalidDocument `json:"invalid"`
	}
	if err := json.Unmarshal(r.body, &l); err != nil || r.code != 200 || len(l.Rules) != 1 || len(l.Invalid) != 4 || r.hdr.Get("ETag") == "" {
		t.Fatalf("GET /rules?include=invalid: %d %s (%v)", r.code, r.body, err)
	}
	for _, d := range l.Invalid {
		if d.Field != badDocs[d.ID].field || d.Error == "" || d.Revision == 0 {
			t.Errorf("invalid document %+v", d)
		}
	}
	if r := e.do(t, "GET", "/rules?include=everything", "", nil); r.code != 400 || r.err.Field != "include" {
		t.Fatalf("include=everything: %d %s, want 400 naming include", r.code, r.body)
	}
	c, err := NewClient(e.srv.URL, token, nil)
	if err != nil {
		t.Fatal(err)
	}
	rs, invalid, rev, err := c.ListAll(context.Background())
	if err != nil || len(rs) != 1 || len(invalid) != 4 || invalid[0].ID != "badcap" || rev == 0 {
		t.Fatalf("ListAll: %v %+v %d %v", rs, invalid, rev, err)
	}
}

// Small messages: a 412 names the precondition the request gave; an error
// the client reads back is the server's message, not wrapped in a second
// "rules: field:" prefix, and still a FieldError naming the field.
func TestErrorsNameWhatWasGiven(t *testing.T) {
	e := newEnv(t)
	if r := e.do(t, "PUT", "/rules/orders", goodDoc, nil); r.code != 200 {
		t.Fatalf("seed: %d %s", r.code, r.body)
	}
	if r := e.do(t, "PUT", "/rules/orders", goodDoc, map[string]string{"If-None-Match": "*"}); r.code != 412 || r.err.Field != "If-None-Match" {
		t.Fatalf("If-None-Match * on an existing rule: %d %s, want 412 naming If-None-Match", r.code, r.body)
	}
	if r := e.do(t, "PUT", "/rules/orders", goodDoc, map[string]string{"If-Match": `"1"`}); r.code != 412 || r.err.Field != "If-Match" {
		t.Fatalf("stale If-Match: %d %s, want 412 naming If-Match", r.code, r.body)
	}
	c, err := NewClient(e.srv.URL, token, nil)
	if err != nil {
		t.Fatal(err)
	}
	m2 := rules.Rule{ID: "m2", Algorithm: rules.TokenBucket, Capacity: 1, RefillPerSecond: 1,
		Scope: rules.Global, Regions: map[string]float64{"us-east": 1, "eu-west": 1}, MinShare: 0.5}
	_, err = c.Put(context.Background(), m2, etcdstore.Unconditional)
	var fe *rules.FieldError
	if !errors.As(err, &fe) || fe.Field != "min_share" {
		t.Fatalf("put: %v, want a FieldError naming min_share", err)
	}
	if msg := err.Error(); strings.Count(msg, "min_share:") != 1 || strings.Count(msg, "rules:") != 1 || !strings.HasPrefix(msg, `rules: rule "m2": min_share: `) {
		t.Fatalf("error wrapped twice: %q", msg)
	}
}

// A global rule re-created with another split than the sync agents
// registered for its id is refused 400 naming the field.
func TestPutRefusesASplitTheAgentsRegistered(t *testing.T) {
	e := newEnv(t)
	reg := `{"spec":{"units":1000000,"min_share":0,"regions":[{"Name":"eu-west","Weight":1},{"Name":"us-east","Weight":1}]},"state":{}}`
	if _, err := e.etcd.Put(context.Background(), etcdstore.DefaultRegistryPrefix+"g", reg); err != nil {
		t.Fatal(err)
	}
	doc := `{"id":"g","algorithm":"token_bucket","capacity":10,"refill_per_second":1,"scope":"global","regions":{"us-east":1,"ap-south":1}}`
	r := e.do(t, "PUT", "/rules/g", doc, nil)
	if r.code != 400 || r.err.Field != "regions" || !strings.Contains(r.err.Error, "new rule id") {
		t.Fatalf("%d %s, want 400 naming regions", r.code, r.body)
	}
	if got := e.stored(t); len(got) != 0 {
		t.Fatalf("stored %v", got)
	}
	same := strings.Replace(doc, `"ap-south":1`, `"eu-west":1`, 1)
	if r := e.do(t, "PUT", "/rules/g", same, nil); r.code != 200 {
		t.Fatalf("the registered split: %d %s", r.code, r.body)
	}
}
