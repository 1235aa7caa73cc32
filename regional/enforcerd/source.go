package enforcerd

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/admin"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/connectivity"
)

// ruleSource is the rule source the flags name, plus what closes it and the
// admin API when rules live in etcd.
type ruleSource struct {
	src   rules.Source
	admin http.Handler // nil unless --admin-addr and etcd
	close func()
}

// newSource returns the rule source the flags name.
func newSource(o *options, log *slog.Logger, reg prometheus.Registerer) (*ruleSource, error) {
	if o.rulesFile != "" {
		if o.adminAddr != "" {
			return nil, errors.New("--admin-addr needs --etcd-endpoints: the admin API writes rules to etcd")
		}
		fs, err := rules.NewFileSource(o.rulesFile, rules.WithPollInterval(o.rulesPoll), rules.WithLogger(log))
		if err != nil {
			return nil, err
		}
		return &ruleSource{src: fs, close: func() {}}, nil
	}
	ecfg, err := o.etcd.Config(2 * time.Second)
	if err != nil {
		return nil, err
	}
	cli, err := clientv3.New(ecfg)
	if err != nil {
		return nil, fmt.Errorf("etcd client: %w", err)
	}
	invalid := prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_rule_invalid_documents_total",
		ConstLabels: prometheus.Labels{"region": o.region},
		Help:        "Rule documents found in etcd that failed validation and were skipped (the previous version stays)."})
	gauge := func(name, help string) prometheus.Gauge {
		return prometheus.NewGauge(prometheus.GaugeOpts{Name: name, ConstLabels: prometheus.Labels{"region": o.region}, Help: help})
	}
	reachable := gauge("apportion_rule_etcd_reachable",
		"1 while the enforcer reaches etcd (its rule snapshot, watch or a probe of a watch silent for 5 s answered), 0 before the first snapshot and while etcd does not answer (the last rule set stays).")
	revision := gauge("apportion_rule_revision", "etcd revision of the rule set this process enforces.")
	invalidNow := gauge("apportion_rule_invalid_documents",
		"Rule documents stored in etcd now whose current version is invalid (skipped; the last good version stays); 0 once each is fixed or deleted.")
	adminRequests := newAdminCounter(o.region)
	reg.MustRegister(invalid, invalidNow, reachable, revision, adminRequests)
	wopts := []etcdstore.Option{etcdstore.WithPrefix(o.etcd.Prefix), etcdstore.WithRegistryPrefix(o.registry), etcdstore.WithLogger(log),
		etcdstore.WithInvalidCounter(invalid), etcdstore.WithInvalidGauge(invalidNow), etcdstore.WithReachableGauge(reachable), etcdstore.WithRevisionGauge(revision)}
	if o.etcdCache != "" {
		wopts = append(wopts, etcdstore.WithCacheFile(o.etcdCache))
	}
	w, err := etcdstore.NewWatcher(cli, wopts...)
	if err != nil {
		cli.Close()
		return nil, err
	}
	rs := &ruleSource{src: w, close: func() { cli.Close() }}
	if o.adminAddr != "" {
		st, err := etcdstore.New(cli, etcdstore.WithPrefix(o.etcd.Prefix), etcdstore.WithRegistryPrefix(o.registry), etcdstore.WithLogger(log))
		if err != nil {
			cli.Close()
			return nil, err
		}
		aopts := []admin.Option{admin.WithStoreTimeout(o.adminTimeout)}
		switch {
		case o.adminToken != "":
			aopts = append(aopts, admin.WithToken(o.adminToken))
		case o.adminNoAuth:
			aopts = append(aopts, admin.WithoutAuth())
		default:
			cli.Close()
			return nil, errors.New("--admin-addr needs --admin-token (or APPORTION_ADMIN_TOKEN), or --admin-no-auth to serve it unauthenticated")
		}
		withLog := func(l *slog.Logger) (http.Handler, error) {
			return admin.New(st, append(aopts[:len(aopts):len(aopts)], admin.WithLogger(l))...)
		}
		h, err := newAdminAudit(withLog, log, adminRequests)
		if err != nil {
			cli.Close()
			return nil, err
		}
		rs.admin = reconnectFirst(cli, h)
	}
	return rs, nil
}

// reconnectFirst makes an etcd client that is waiting out its reconnect
// backoff try again at once when an admin request arrives, so the first
// request after etcd returns is served rather than answered 503.
func reconnectFirst(cli *clientv3.Client, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if cc := cli.ActiveConnection(); cc != nil && cc.GetState() == connectivity.TransientFailure {
			cc.ResetConnectBackoff()
		}
		next.ServeHTTP(w, r)
	})
}
