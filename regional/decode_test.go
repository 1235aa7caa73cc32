package regional

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/alicebob/miniredis/v2"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// miniStore is the real store on an embedded miniredis.
func miniStore(t testing.TB) (*redisstore.Store, *miniredis.Miniredis) {
	t.Helper()
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { client.Close() })
	st, err := redisstore.New(client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st, mr
}

// miniEnforcer is an enforcer over the real store on an embedded
// miniredis, with one token bucket keyed by client key.
func miniEnforcer(t testing.TB) (*Enforcer, *miniredis.Miniredis) {
	t.Helper()
	st, mr := miniStore(t)
	cfg := DefaultConfig()
	cfg.Region = "us-east"
	cfg.Timeout = time.Second // the CI machine is small and shared; a fail-open answer stores nothing
	cfg.Logger = quietLogger()
	cfg.Metrics = NewMetrics(prometheus.NewRegistry(), cfg.Region)
	enf, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	r := tokenBucket("tb", 10, 1)
	r.Normalize()
	if err := enf.SetRules([]rules.Rule{r}); err != nil {
		t.Fatal(err)
	}
	return enf, mr
}

// JSON escapes of lone UTF-16 surrogates are not valid UTF-8: encoding/json
// would turn each into U+FFFD, so that "\ud800", "\udfff" and "\ufffd" would
// share one bucket. They are refused, naming the field, as invalid UTF-8
// bytes are (and as gRPC refuses such keys).
func TestHTTPRefusesStringsThatAreNotUTF8(t *testing.T) {
	enf, mr := miniEnforcer(t)
	srv := httptest.NewServer(NewHTTPHandler(enf, nil, nil))
	t.Cleanup(srv.Close)
	post := func(t *testing.T, body string) (int, errorBody) {
		t.Helper()
		resp, err := http.Post(srv.URL+"/v1/check", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var eb errorBody
		if resp.StatusCode != http.StatusOK {
			if err := json.NewDecoder(resp.Body).Decode(&eb); err != nil {
				t.Fatalf("error body: %v", err)
			}
		}
		return resp.StatusCode, eb
	}
	refused := []struct {
		name, body, field string
	}{
		{"lone high surrogate", `{"client_key":"\ud800"}`, "client_key"},
		{"lone low surrogate", `{"client_key":"\udfff"}`, "client_key"},
		{"last high surrogate", `{"client_key":"u\udbff"}`, "client_key"},
		{"upper-case hex", `{"client_key":"\uD800x"}`, "client_key"},
		{"high then high", `{"client_key":"\ud800\ud800"}`, "client_key"},
		{"high then a letter escape", `{"client_key":"\ud800\u0041"}`, "client_key"},
		{"low then high (reversed pair)", `{"client_key":"\ude00\ud83d"}`, "client_key"},
		{"after an escaped backslash", `{"client_key":"\\\ud800"}`, "client_key"},
		{"field name in another case", `{"Client_Key":"\udfff"}`, "client_key"},
		{"resource", `{"client_key":"u","resource":"GET /\udc00"}`, "resource"},
		{"attribute value", `{"client_key":"u","attributes":{"tier":"\ud800"}}`, "attributes"},
		{"attribute name", `{"client_key":"u","attributes":{"\udfff":"free"}}`, "attributes"},
		{"invalid bytes", "{\"client_key\":\"u\xff\"}", "client_key"},
		{"invalid bytes in an attribute", "{\"client_key\":\"u\",\"attributes\":{\"a\":\"\xc3\"}}", "attributes"},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			code, eb := post(t, tc.body)
			if code != http.StatusBadRequest || eb.Field != tc.field || !strings.Contains(eb.Error, "UTF-8") || !strings.Contains(eb.Error, tc.field) {
				t.Fatalf("got %d %+v, want 400 naming %s and UTF-8", code, eb, tc.field)
			}
		})
	}
	if keys := mr.Keys(); len(keys) != 0 {
		t.Fatalf("refused requests reached the store: %q", keys)
	}
	// Valid strings, escaped or not, are served, each in its own bucket.
	accepted := []string{
		`{"client_key":"\ufffd"}`,                  // U+FFFD itself is a valid character
		`{"client_key":"\ud83d\ude00"}`,            // a surrogate pair: U+1F600
		`{"client_key":"\\ud800"}`,                 // a backslash, then the text ud800
		`{"client_key":"é"}`,                       // raw UTF-8
		`{"client_key":"a","resource":"\u00e9\/"}`, // other escapes
	}
	for _, body := range accepted {
		if code, eb := post(t, body); code != http.StatusOK {
			t.Fatalf("%s: got %d %+v, want 200", body, code, eb)
		}
	}
	if keys := mr.Keys(); len(keys) != len(accepted) {
		t.Fatalf("%d requests with different client keys made buckets %q", len(accepted), keys)
	}
}

// A request that is not protobuf answers InvalidArgument, not Internal, and
// the server keeps serving.
func TestMalformedProtobufIsInvalidArgument(t *testing.T) {
	enf, _ := miniEnforcer(t)
	conn := serveGRPC(t, enf)
	truncated := protowire.AppendTag(nil, 1, protowire.BytesType) // a length that never comes
	badTag := []byte{0x00}                                        // field number 0
	var inBatch []byte                                            // a batch whose second request is cut short
	inBatch = protowire.AppendTag(inBatch, 1, protowire.BytesType)
	inBatch = protowire.AppendBytes(inBatch, protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "u"))
	inBatch = protowire.AppendTag(inBatch, 1, protowire.BytesType)
	inBatch = protowire.AppendBytes(inBatch, []byte{0x0a, 0x05, 'u'})
	tests := []struct {
		name, method string
		body         []byte
	}{
		{"truncated CheckLimit", "CheckLimit", truncated},
		{"field 0 CheckLimit", "CheckLimit", badTag},
		{"truncated CheckLimits", "CheckLimits", truncated},
		{"bad request inside a batch", "CheckLimits", inBatch},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var resp ratelimitv1.CheckLimitResponse
			err := conn.Invoke(context.Background(), "/ratelimit.v1.RateLimiter/"+tc.method, tc.body, &resp, grpc.ForceCodec(rawCodec{}))
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "malformed ratelimit.v1.RateLimiter/"+tc.method) {
				t.Fatalf("got %v, want InvalidArgument naming the method", err)
			}
		})
	}
	c := ratelimitv1.NewRateLimiterClient(conn)
	if r, err := c.CheckLimit(context.Background(), &ratelimitv1.CheckLimitRequest{ClientKey: "a"}); err != nil || !r.Allowed {
		t.Fatalf("valid request after malformed ones: %v %v", r, err)
	}
}

// FuzzDecodeCheck: the HTTP body decoder never panics, never lets a string
// that is not valid UTF-8 through as U+FFFD, names the field it refuses, and
// what it accepts re-encodes to a body that decodes to the same request.
func FuzzDecodeCheck(f *testing.F) {
	f.Add([]byte(`{"client_key":"user:42","resource":"GET /","cost":2,"attributes":{"tier":"free"}}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		req, field, err := decodeCheck(body)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error")
			}
			if field != "" && !strings.Contains(err.Error(), field) {
				t.Fatalf("error %q does not name field %q", err, field)
			}
			var re *RequestError
			if errors.As(err, &re) && re.Field != field {
				t.Fatalf("field %q, error names %q", field, re.Field)
			}
			return
		}
		strs := []string{req.ClientKey, req.Resource}
		for k, v := range req.Attributes {
			strs = append(strs, k, v)
		}
		literal := bytes.Contains(body, []byte("\uFFFD")) || bytes.Contains(bytes.ToLower(body), []byte(`\ufffd`))
		for _, s := range strs {
			if !utf8.ValidString(s) {
				t.Fatalf("accepted invalid UTF-8 %q", s)
			}
			if strings.ContainsRune(s, utf8.RuneError) && !literal {
				t.Fatalf("accepted %q: a U+FFFD the body does not contain", s)
			}
		}
		again, err := json.Marshal(req)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		back, _, err := decodeCheck(again)
		if err != nil {
			t.Fatalf("re-encoded body %s refused: %v", again, err)
		}
		if len(req.Attributes) == 0 {
			req.Attributes = nil
		}
		if !reflect.DeepEqual(back, req) {
			t.Fatalf("round trip: %+v, then %+v", req, back)
		}
	})
}

// FuzzLenientCodec: the server's codec never panics; it decodes exactly
// what proto does, and beyond that only messages whose strings are not valid
// UTF-8 (which the enforcer then refuses naming the field); its failures
// are the ones a RegisterService handler answers InvalidArgument.
func FuzzLenientCodec(f *testing.F) {
	for _, m := range []proto.Message{
		&ratelimitv1.CheckLimitRequest{ClientKey: "user:42", Resource: "GET /", Cost: 3, Attributes: map[string]string{"tier": "free", "ip": "10.0.0.1"}},
		&ratelimitv1.CheckLimitsRequest{Requests: []*ratelimitv1.CheckLimitRequest{{ClientKey: "a"}, {ClientKey: "b", Cost: -1}}},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c := lenientCodec{}
		for _, mk := range []func() proto.Message{
			func() proto.Message { return &ratelimitv1.CheckLimitRequest{} },
			func() proto.Message { return &ratelimitv1.CheckLimitsRequest{} },
		} {
			strict, lenient := mk(), mk()
			serr := proto.Unmarshal(data, strict)
			lerr := c.Unmarshal(data, lenient)
			target := &decodeTarget{msg: mk()}
			if err := c.Unmarshal(data, target); err != nil || (target.err == nil) != (lerr == nil) {
				t.Fatalf("decodeTarget: %v, recorded %v; direct %v", err, target.err, lerr)
			}
			switch {
			case serr == nil && lerr != nil:
				t.Fatalf("proto decodes %x, the codec refuses it: %v", data, lerr)
			case serr == nil:
				if !proto.Equal(strict, lenient) {
					t.Fatalf("codec decodes %x as %v, proto as %v", data, lenient, strict)
				}
			case lerr == nil && allValidUTF8(lenient):
				// proto refused it for a reason other than UTF-8: so must we,
				// or re-encoding must at least give a message proto reads.
				b, err := proto.Marshal(lenient)
				if err != nil {
					t.Fatalf("codec accepted %x (proto: %v) as %v, which does not encode: %v", data, serr, lenient, err)
				}
				if err := proto.Unmarshal(b, mk()); err != nil {
					t.Fatalf("codec accepted %x (proto: %v) as %v: %v", data, serr, lenient, err)
				}
			}
			if lerr == nil {
				b, err := c.Marshal(lenient)
				if err == nil {
					back := mk()
					if err := c.Unmarshal(b, back); err != nil || !proto.Equal(back, lenient) {
						t.Fatalf("round trip of %v: %v %v", lenient, back, err)
					}
				} else if allValidUTF8(lenient) {
					t.Fatalf("decoded %v does not encode: %v", lenient, err)
				}
			}
		}
	})
}

func allValidUTF8(m proto.Message) bool {
	var reqs []*ratelimitv1.CheckLimitRequest
	switch v := m.(type) {
	case *ratelimitv1.CheckLimitRequest:
		reqs = append(reqs, v)
	case *ratelimitv1.CheckLimitsRequest:
		reqs = v.GetRequests()
	}
	for _, r := range reqs {
		if !utf8.ValidString(r.GetClientKey()) || !utf8.ValidString(r.GetResource()) {
			return false
		}
		for k, v := range r.GetAttributes() {
			if !utf8.ValidString(k) || !utf8.ValidString(v) {
				return false
			}
		}
	}
	return true
}

// TestSetRulesWarnsOfStrandedFloors: a global rule stored before the rule
// store refused it (rules.Rule.CheckFloors: a capacity of 1 with
// min_share 0.1, no region can ever hold the token) is still loaded and
// enforced, and its load is logged as a warning naming it; a rule that
// passes the check is not named.
func TestSetRulesWarnsOfStrandedFloors(t *testing.T) {
	st, _ := miniStore(t)
	var logs bytes.Buffer
	cfg := DefaultConfig()
	cfg.Region = "us-east"
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	cfg.Metrics = NewMetrics(prometheus.NewRegistry(), cfg.Region)
	enf, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	stranded := tokenBucket("stranded", 1, 1)
	stranded.Scope, stranded.Regions, stranded.MinShare = rules.Global, map[string]float64{"us-east": 1, "eu-west": 1}, 0.1
	fine := tokenBucket("fine", 100, 1)
	fine.Scope, fine.Regions, fine.MinShare = rules.Global, map[string]float64{"us-east": 1, "eu-west": 1}, 0.1
	for _, r := range []*rules.Rule{&stranded, &fine} {
		r.Normalize()
		if err := r.Validate(); err != nil {
			t.Fatal(err)
		}
	}
	if err := enf.SetRules([]rules.Rule{stranded, fine}); err != nil {
		t.Fatalf("SetRules refused a stored rule: %v", err)
	}
	if _, ok := enf.index.Load().params["stranded"]; !ok {
		t.Fatal("the stranded rule is not enforced")
	}
	var warned []string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "can never hold a whole token") {
			warned = append(warned, line)
		}
	}
	if len(warned) != 1 || !strings.Contains(warned[0], "rule=stranded") || !strings.Contains(warned[0], "min_share") {
		t.Fatalf("want one warning, naming the stranded rule and min_share; got %q", warned)
	}
}

// The HTTP API's field names are exact: encoding/json would fill
// client_key from "CLIENT_KEY" and let the last of two keys win, so that
// one body could mean two things to two readers. Errors name the field as
// gRPC does, with no package prefix.
func TestHTTPFieldsAreExact(t *testing.T) {
	enf, mr := miniEnforcer(t)
	srv := httptest.NewServer(NewHTTPHandler(enf, nil, nil))
	t.Cleanup(srv.Close)
	for _, tc := range []struct{ body, field, msg string }{
		{`{"CLIENT_KEY":"dup","client_key":"x"}`, "CLIENT_KEY", "CLIENT_KEY: unknown field (the fields are client_key, resource, cost, attributes, spelled exactly)"},
		{`{"client_key":"x","Resource":"tb"}`, "Resource", "Resource: unknown field"},
		{`{"client_key":"a","client_key":"b"}`, "client_key", "client_key: given twice"},
		{`[]`, "", "body: must be a JSON object, got array"},
		{`{"client_key":5}`, "client_key", "client_key: must be a JSON string, got number"},
		{`{"client_key":"u","attributes":[]}`, "attributes", "attributes: must be a JSON object, got array"},
		{`{"resource":"tb"}`, "client_key", "client_key: is required"},
		{`{"client_key":"u","attributes":{"tier":"free","tier":"pro"}}`, "attributes", `attributes: "tier" given twice`},
		{`{"client_key":"a", "client\u005fkey":"b"}`, "client_key", "client_key: given twice"},
		{`{ "attributes" : { "t\u0069er":"a", "tier":"b" } , "client_key":"u"}`, "attributes", `attributes: "tier" given twice`},
	} {
		resp, err := http.Post(srv.URL+"/v1/check", "application/json", strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		var eb errorBody
		err = json.NewDecoder(resp.Body).Decode(&eb)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusBadRequest || eb.Field != tc.field || !strings.HasPrefix(eb.Error, tc.msg) {
			t.Errorf("%s: got %d %+v (%v), want 400, field %q, error starting %q", tc.body, resp.StatusCode, eb, err, tc.field, tc.msg)
		}
	}
	if keys := mr.Keys(); len(keys) != 0 {
		t.Fatalf("refused requests reached the store: %q", keys)
	}
	// An answer has the gRPC fields, window_ms too (capacity 10 at 1/s: 10 s).
	resp, err := http.Post(srv.URL+"/v1/check", "application/json", strings.NewReader(`{"client_key":"u"}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		WindowMs *int64 `json:"window_ms"`
		Statuses []struct {
			WindowMs *int64 `json:"window_ms"`
		} `json:"statuses"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || body.WindowMs == nil || *body.WindowMs != 10_000 ||
		len(body.Statuses) != 1 || body.Statuses[0].WindowMs == nil || *body.Statuses[0].WindowMs != 10_000 {
		t.Fatalf("answer %+v (%v): want window_ms 10000 at the top and in the status", body, err)
	}
}
