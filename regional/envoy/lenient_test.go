package envoy

import (
	"context"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// rawRequest encodes a RateLimitRequest by hand, so that its strings may
// be what proto3 refuses to encode: the domain and, per descriptor, its
// entries as key, value pairs.
func rawRequest(domain string, descriptors ...[]string) []byte {
	b := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), domain)
	for _, kv := range descriptors {
		var d []byte
		for i := 0; i+1 < len(kv); i += 2 {
			e := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), kv[i])
			e = protowire.AppendString(protowire.AppendTag(e, 2, protowire.BytesType), kv[i+1])
			d = protowire.AppendBytes(protowire.AppendTag(d, 1, protowire.BytesType), e)
		}
		b = protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), d)
	}
	return b
}

// Envoy forwards header bytes as they came, and HTTP allows bytes that are
// not UTF-8 in a header value: a request whose descriptor holds one is
// answered and limited like any other (proto3 refuses it, and a failed call
// is allowed by Envoy's default failure_mode_deny: one such byte would skip
// every limit keyed on a header), each value in its own bucket, and the
// call's other descriptors keep their limits.
func TestInvalidUTF8IsLimited(t *testing.T) {
	e := miniEnforcer(t, []rules.Rule{{ID: "per-key", Match: map[string]string{"domain": "edge"}, Key: []string{"client_key"},
		Algorithm: rules.SlidingLog, Limit: 2, Window: rules.Duration(time.Hour)}})
	conn := serve(t, e)
	call := func(body []byte) []rlsv3.RateLimitResponse_Code {
		t.Helper()
		var resp rlsv3.RateLimitResponse
		if err := conn.Invoke(context.Background(), "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", body, &resp, grpc.ForceCodec(rawCodec{})); err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		var codes []rlsv3.RateLimitResponse_Code
		for _, st := range resp.GetStatuses() {
			codes = append(codes, st.GetCode())
		}
		return codes
	}
	bad := []string{"api_key", "k\xff\xfe"}
	both := rawRequest("edge", bad, []string{"api_key", "valid"})
	if proto.Unmarshal(both, &rlsv3.RateLimitRequest{}) == nil {
		t.Fatal("proto3 decoded a string that is not UTF-8: the test sends nothing lenient")
	}
	ok, over := rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT
	for i, want := range [][]rlsv3.RateLimitResponse_Code{{ok, ok}, {ok, ok}, {over, over}} {
		if got := call(both); len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
			t.Fatalf("call %d: %v, want %v", i+1, got, want)
		}
	}
	// Another value that is not UTF-8 has its own bucket, and so does its
	// sha256: form sent as a valid string.
	if got := call(rawRequest("edge", []string{"api_key", "k\xff\xfd"})); len(got) != 1 || got[0] != ok {
		t.Fatalf("another invalid value: %v, want OK", got)
	}
	if got := call(rawRequest("edge", []string{"api_key", hashedForm(bad[1])})); len(got) != 1 || got[0] != ok {
		t.Fatalf("the sha256: form of the invalid value: %v, want OK (its own bucket)", got)
	}
	// A domain that is not UTF-8 is a domain like any other.
	if got := call(rawRequest("edge\xff", []string{"api_key", "x"})); len(got) != 1 || got[0] != ok {
		t.Fatalf("invalid UTF-8 domain: %v, want OK (no rule matches it)", got)
	}
	// Fields of the wrong wire type are skipped as proto skips them.
	if got := call(append(protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 7), rawRequest("edge", bad)...)); len(got) != 1 || got[0] != over {
		t.Fatalf("with a domain of the wrong wire type first: %v, want OVER_LIMIT (the same key, spent)", got)
	}
}

// FuzzDecodeLenient: the lenient decoder never panics, and on every request
// proto decodes it decodes the same (unknown fields aside); on a request
// whose strings it made valid UTF-8 (a byte replaced), proto agrees too.
func FuzzDecodeLenient(f *testing.F) {
	f.Add(rawRequest("edge", []string{"api_key", "k\xff"}, []string{"remote_address", "10.0.0.1", "path", "/"}))
	f.Add(rawRequest("", []string{}))
	f.Fuzz(func(t *testing.T, data []byte) {
		var got rlsv3.RateLimitRequest
		lerr := decodeLenient(data, &got)
		var want rlsv3.RateLimitRequest
		if err := (proto.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(data, &want); err == nil {
			if lerr != nil {
				t.Fatalf("proto decodes it, decodeLenient: %v", lerr)
			}
			if !proto.Equal(&got, &want) {
				t.Fatalf("decodeLenient %v, proto %v", &got, &want)
			}
		}
	})
}
