package main

import (
	"context"
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
		ec, err := clientv3.New(cfg)
		if err != nil {
			return nil, nil, fmt.Errorf("etcd: %w", err)
		}
		s, err := etcdstore.New(ec, etcdstore.WithPrefix(g.etcd.Prefix), etcdstore.WithRegistryPrefix(g.registryPrefix))
		if err != nil {
			ec.Close()
			return nil, nil, usagef("--etcd-prefix, --registry-prefix: %v", err)
		}
		return s, func() { ec.Close() }, nil
	}
	return nil, nil, usagef("no rule store: give --etcd-endpoints URLS or --admin-url URL (or APPORTION_ETCD_ENDPOINTS / APPORTION_ADMIN_URL)")
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
