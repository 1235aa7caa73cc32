package client_test

import (
	"context"
	"strings"
	"testing"

	"github.com/apportion/apportion/regional/client"
	"github.com/apportion/apportion/rules"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestInterceptorLimitsKeysTheEnforcerWouldRefuse: a caller whose key
// (x-api-key) is over 256 bytes or not UTF-8 is limited under its own
// hashed key, and a cost the enforcer refuses is refused: before, each
// check was refused by the enforcer, answered by the failure policy
// (FailOpen: the handler ran), and such a caller was never limited.
func TestInterceptorLimitsKeysTheEnforcerWouldRefuse(t *testing.T) {
	e := startEnforcer(t, []rules.Rule{tokenBucket("echo", "/demo.Echo/Echo", 2)})
	c := newClient(t, client.WithAddress(e.addr))
	conn := startEcho(t, c, client.WithKey(client.KeyFromMetadata("x-api-key")))
	// (A key that is not UTF-8 cannot travel in gRPC metadata: the caller's
	// library refuses it; FitKey's test covers it.)
	for _, key := range []string{strings.Repeat("k", 300), "sha256:" + strings.Repeat("0", 64)} {
		codesSeen := []codes.Code{}
		for range 3 {
			_, err := echo(conn, key)
			codesSeen = append(codesSeen, status.Code(err))
		}
		if codesSeen[0] != codes.OK || codesSeen[1] != codes.OK || codesSeen[2] != codes.ResourceExhausted {
			t.Errorf("key of %d bytes %.12q...: %v, want OK OK ResourceExhausted", len(key), key, codesSeen)
		}
	}
	// A cost the enforcer refuses is refused, not let through.
	neg := startEcho(t, c, client.WithCost(func(context.Context, string) int64 { return -1 }))
	if _, err := echo(neg, "any"); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "cost") {
		t.Errorf("negative cost: %v, want InvalidArgument naming cost", err)
	}
	huge := startEcho(t, c, client.WithCost(func(context.Context, string) int64 { return 1 << 40 }))
	if _, err := echo(huge, "any"); status.Code(err) != codes.InvalidArgument {
		t.Errorf("cost above the maximum: %v, want InvalidArgument", err)
	}
}

// TestFitKeyIsInjective: valid keys are kept; an over-long or invalid one
// and one already of the hashed form become hashed forms, distinct for
// distinct inputs.
func TestFitKeyIsInjective(t *testing.T) {
	long := strings.Repeat("a", 257)
	in := []string{"user:1", strings.Repeat("a", 256), long, long + "b", "x\xff", "x\xfe", "sha256:" + strings.Repeat("0", 64)}
	seen := map[string]string{}
	for _, s := range in {
		k := client.FitKey(s)
		if prev, ok := seen[k]; ok {
			t.Fatalf("%.20q and %.20q both fit to %q", prev, s, k)
		}
		seen[k] = s
		if len(k) > 256 || !strings.HasPrefix(k, "sha256:") && k != s {
			t.Fatalf("FitKey(%.20q) = %q", s, k)
		}
	}
	if client.FitKey("user:1") != "user:1" {
		t.Fatal("a valid key changed")
	}
}
