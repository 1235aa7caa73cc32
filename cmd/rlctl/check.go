package main

import (
	"fmt"
	"strings"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
)

// checkFlags are the flags of the check command.
type checkFlags struct {
	addr      string
	clientKey string
	resource  string
	cost      int64
	attrs     attrFlag
	tls       bool
}

func (c *cli) checkCmd() *cobra.Command {
	f := checkFlags{attrs: attrFlag{}}
	cmd := &cobra.Command{
		Use:   "check --addr GRPC_ADDR --client-key K [--resource R] [--cost N] [--attr k=v ...]",
		Short: "Call RateLimiter/CheckLimit on an enforcer",
		Long: `Send one CheckLimit to an enforcer and print its answer: the decision, the
binding rule and every matched rule's status. A check costs tokens like any
request. Exit code 0 when the request is allowed (also fail-open), 5 when it
is rejected, 1 when the enforcer could not be asked.`,
		Example: `  rlctl check --addr 127.0.0.1:8081 --client-key user:42 --resource "POST /orders" --attr tier=free
  rlctl check --addr enforcer:8081 --client-key user:42 --tls-ca ca.pem -o json`,
		Args: exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error { return c.check(cmd, &f) },
	}
	fs := cmd.Flags()
	fs.StringVar(&f.addr, "addr", "", "enforcer gRPC address HOST:PORT")
	fs.StringVar(&f.clientKey, "client-key", "", "client key, e.g. user:42")
	fs.StringVar(&f.resource, "resource", "", "resource, e.g. \"POST /orders\"")
	fs.Int64Var(&f.cost, "cost", 1, "request cost")
	fs.Var(&f.attrs, "attr", "attribute k=v (repeatable; comma-separated pairs also accepted)")
	fs.BoolVar(&f.tls, "tls", false, "connect over TLS (server certificate checked against --tls-ca or the system roots; implied by --tls-ca and --tls-cert)")
	return cmd
}

// attrFlag collects k=v pairs.
type attrFlag map[string]string

func (a attrFlag) String() string { return formatMap(a) }

func (a attrFlag) Type() string { return "k=v" }

func (a attrFlag) Set(s string) error {
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return fmt.Errorf("attribute %q is not k=v", kv)
		}
		a[k] = v
	}
	return nil
}

func (c *cli) check(cmd *cobra.Command, f *checkFlags) error {
	if f.addr == "" || f.clientKey == "" {
		return usagef("check needs --addr and --client-key")
	}
	creds := insecure.NewCredentials()
	if f.tls || c.g.tlsCA != "" || c.g.tlsCert != "" {
		tc, err := c.g.clientTLS()
		if err != nil {
			return usagef("%v", err)
		}
		creds = credentials.NewTLS(tc)
	}
	conn, err := grpc.NewClient(f.addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return usagef("--addr %q: %v", f.addr, err)
	}
	defer conn.Close()
	resp, err := ratelimitv1.NewRateLimiterClient(conn).CheckLimit(cmd.Context(), &ratelimitv1.CheckLimitRequest{
		ClientKey: f.clientKey, Resource: f.resource, Cost: f.cost, Attributes: f.attrs,
	})
	if err != nil {
		return fmt.Errorf("CheckLimit on %s: %w", f.addr, err)
	}
	var rejected error
	switch {
	case resp.GetAllowed():
	case resp.GetRetryAfterMs() < 0:
		// -1: waiting cannot help (docs/api.md, retry_after_ms).
		rejected = fmt.Errorf("check: %w by rule %s: waiting cannot help (the cost is above what the rule can admit here, or its share of the rate here is zero); lower --cost or raise the limit", errRejected, resp.GetRuleId())
	default:
		rejected = fmt.Errorf("check: %w by rule %s (retry after %d ms)", errRejected, resp.GetRuleId(), resp.GetRetryAfterMs())
	}
	if c.structured() {
		b, err := protojson.MarshalOptions{Multiline: true, UseProtoNames: true, EmitUnpopulated: true}.Marshal(resp)
		if err != nil {
			return err
		}
		if err := c.emitJSON(b); err != nil {
			return err
		}
		return rejected
	}
	decision := "REJECTED"
	if resp.GetAllowed() {
		decision = "ALLOWED"
	}
	if resp.GetFailOpen() {
		decision += " (fail-open: store unreachable)"
	}
	fmt.Fprintf(c.stdout, "%s rule=%s limit=%d remaining=%d retry_after_ms=%d reset_after_ms=%d\n",
		decision, resp.GetRuleId(), resp.GetLimit(), resp.GetRemaining(), resp.GetRetryAfterMs(), resp.GetResetAfterMs())
	if len(resp.GetStatuses()) > 0 {
		tw := c.table()
		fmt.Fprintln(tw, "RULE\tALLOWED\tLIMIT\tREMAINING\tRETRY_AFTER_MS\tRESET_AFTER_MS\tSHADOW")
		for _, s := range resp.GetStatuses() {
			fmt.Fprintf(tw, "%s\t%v\t%d\t%d\t%d\t%d\t%v\n", s.GetRuleId(), s.GetAllowed(), s.GetLimit(), s.GetRemaining(), s.GetRetryAfterMs(), s.GetResetAfterMs(), s.GetShadow())
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	return rejected
}
