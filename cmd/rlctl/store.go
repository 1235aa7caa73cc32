package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/admin"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ruleStore is what rlctl needs from a rule backend: *etcdstore.Store (etcd
// directly) and *admin.Client (the admin API) both provide it, with the same
// errors.
type ruleStore interface {
	Get(ctx context.Context, id string) (rules.Rule, int64, error)
	List(ctx context.Context) ([]rules.Rule, int64, error)
	// ListAll also returns the stored documents that are not valid rules.
	ListAll(ctx context.Context) ([]rules.Rule, []etcdstore.InvalidDocument, int64, error)
	Put(ctx context.Context, r rules.Rule, ifMatch int64) (int64, error)
	Delete(ctx context.Context, id string, ifMatch int64) error
}

// store opens the backend chosen by the global flags; close releases it.
func (c *cli) store() (st ruleStore, close func(), err error) {
	g := &c.g
	switch {
	case g.etcd.Endpoints != "" && g.adminURL != "":
		msg := fmt.Sprintf("give --etcd-endpoints or --admin-url, not both: got %s and %s", c.flagSource("etcd-endpoints"), c.flagSource("admin-url"))
		for _, name := range []string{"etcd-endpoints", "admin-url"} {
			if c.fromEnv[name] {
				msg += fmt.Sprintf("; unset %s, or override it with --%s \"\"", flagenv.Name(name), name)
			}
		}
		return nil, nil, usagef("%s", msg)
	case g.adminURL != "":
		var hc *http.Client
		if g.tlsCA != "" || g.tlsCert != "" {
			tc, err := g.clientTLS()
			if err != nil {
				return nil, nil, usagef("%v", err)
			}
			hc = &http.Client{Transport: &http.Transport{TLSClientConfig: tc, Proxy: http.ProxyFromEnvironment}}
		}
		ac, err := admin.NewClient(g.adminURL, g.token, hc)
		if err != nil {
			return nil, nil, usagef("%v", err)
		}
		return ac, func() {}, nil
	case g.etcd.Endpoints != "":
		cfg, err := g.etcdConfig()
		if err != nil {
			return nil, nil, err
		}
		if err := c.checkPrefixes(); err != nil {
			return nil, nil, err
		}
		ec, err := clientv3.New(cfg)
		if err != nil {
			return nil, nil, fmt.Errorf("etcd: %w", err)
		}
		s, err := etcdstore.New(ec, etcdstore.WithPrefix(g.etcd.Prefix), etcdstore.WithRegistryPrefix(g.registryPrefix))
		if err != nil {
			ec.Close()
			return nil, nil, usagef("--etcd-prefix, --registry-prefix: %v", err)
		}
		return etcdStore{s, c}, func() { ec.Close() }, nil
	}
	return nil, nil, usagef("no rule store: give --etcd-endpoints URLS or --admin-url URL (or APPORTION_ETCD_ENDPOINTS / APPORTION_ADMIN_URL)")
}

// checkPrefixes refuses a rules prefix (--etcd-prefix) and a registry
// prefix (--registry-prefix) of which one holds the other: rules list would
// read the sync agents' registry documents as invalid rules (or the agents
// the rules as registry documents). A prefix that does not end in "/" is
// left to etcdstore.New, which refuses it.
func (c *cli) checkPrefixes() error {
	rulesP, regP := c.g.etcd.Prefix, c.g.registryPrefix
	if !strings.HasSuffix(rulesP, "/") || !strings.HasSuffix(regP, "/") {
		return nil
	}
	var how string
	switch {
	case rulesP == regP:
		how = "they are the same prefix"
	case strings.HasPrefix(regP, rulesP):
		how = "the registry's keys are under the rules' prefix, so they would be read as (invalid) rules"
	case strings.HasPrefix(rulesP, regP):
		how = "the rules' keys are under the registry's prefix, so the sync agents would read them as registry documents"
	default:
		return nil
	}
	return usagef("%s %q and %s %q overlap: %s; give prefixes neither of which holds the other (the defaults are --etcd-prefix %s and --registry-prefix %s)",
		c.flagSource("etcd-prefix"), rulesP, c.flagSource("registry-prefix"), regP, how, etcdstore.DefaultPrefix, etcdstore.DefaultRegistryPrefix)
}

// etcdStore is the rule store in etcd, whose errors say, when etcd does not
// answer in time, which endpoints did not and which flag sets the time.
type etcdStore struct {
	*etcdstore.Store
	c *cli
}

func (s etcdStore) Get(ctx context.Context, id string) (rules.Rule, int64, error) {
	r, rev, err := s.Store.Get(ctx, id)
	return r, rev, s.c.etcdError(err)
}

func (s etcdStore) List(ctx context.Context) ([]rules.Rule, int64, error) {
	rs, rev, err := s.Store.List(ctx)
	return rs, rev, s.c.etcdError(err)
}

func (s etcdStore) ListAll(ctx context.Context) ([]rules.Rule, []etcdstore.InvalidDocument, int64, error) {
	rs, bad, rev, err := s.Store.ListAll(ctx)
	return rs, bad, rev, s.c.etcdError(err)
}

func (s etcdStore) Put(ctx context.Context, r rules.Rule, ifMatch int64) (int64, error) {
	rev, err := s.Store.Put(ctx, r, ifMatch)
	return rev, s.c.etcdError(err)
}

func (s etcdStore) Delete(ctx context.Context, id string, ifMatch int64) error {
	return s.c.etcdError(s.Store.Delete(ctx, id, ifMatch))
}

// etcdError explains err when etcd did not answer: the command's --timeout
// ran out (etcd's client waits for a connection until then), or the client
// found no etcd available. Other errors are returned as they are.
func (c *cli) etcdError(err error) error {
	if err == nil {
		return nil
	}
	code := codes.OK
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		code = se.GRPCStatus().Code()
	}
	where := fmt.Sprintf("etcd at %s (%s)", strings.Join(c.g.etcd.EndpointList(), ", "), c.flagSource("etcd-endpoints"))
	switch {
	case errors.Is(err, context.DeadlineExceeded) || code == codes.DeadlineExceeded:
		return fmt.Errorf("%s did not answer within %s (%s): check that etcd runs and is reachable at that address, or raise --timeout: %w",
			where, c.g.timeout, c.flagSource("timeout"), err)
	case code == codes.Unavailable:
		return fmt.Errorf("%s is unavailable: check that etcd runs and is reachable at that address: %w", where, err)
	}
	return err
}

// etcdConfig returns the etcd client configuration of the global flags
// (internal/backend's, as the daemons build theirs); a wrong combination of
// flags is a usage error.
func (g *globals) etcdConfig() (clientv3.Config, error) {
	if err := g.etcd.Validate(); err != nil {
		return clientv3.Config{}, usagef("%v", err)
	}
	return g.etcd.Config(5 * time.Second)
}

// completeRuleIDs completes the first argument with the IDs of the stored
// rules, when the flags or the environment name a store that answers
// quickly; else with nothing.
func (c *cli) completeRuleIDs(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
	if len(args) > 0 {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	set, err := applyEnv(cmd.Flags(), os.LookupEnv)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	c.fromEnv = set
	st, closeStore, err := c.store()
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	defer closeStore()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	rs, _, err := st.List(ctx)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	var ids []string
	for _, r := range rs {
		if strings.HasPrefix(r.ID, toComplete) {
			ids = append(ids, r.ID)
		}
	}
	return ids, cobra.ShellCompDirectiveNoFileComp
}
