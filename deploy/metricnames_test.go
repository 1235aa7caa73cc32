package deploy

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/agent"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// histograms are the metrics whose _bucket, _sum and _count series queries use.
var histograms = []string{regional.MetricLatency, "apportion_sync_tick_duration_seconds"}

// ---------------------------------------------------------------------------
// Metrics used by alerts and the dashboard.

// recorder is a Registerer that remembers what was registered.
type recorder struct {
	*prometheus.Registry
	cs []prometheus.Collector
}

func (r *recorder) Register(c prometheus.Collector) error {
	r.cs = append(r.cs, c)
	return r.Registry.Register(c)
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

var descRE = regexp.MustCompile(`^Desc\{fqName: "([^"]+)", .*constLabels: \{([^}]*)\}, variableLabels: \{([^}]*)\}\}$`)

// enforcerMetrics returns the metrics ratelimitd exports, by name, with
// their labels.
// agentMetrics returns the sync agent's metric names and labels, from the
// collectors agent.New registers.
func agentMetrics(t testing.TB) map[string][]string {
	t.Helper()
	reg := &recorder{Registry: prometheus.NewRegistry()}
	cfg := agent.DefaultConfig()
	cfg.Region, cfg.Metrics = "r", reg
	cfg.InsecureUnsigned = true // metrics only
	if _, err := agent.New(cfg, noStore{}, &nats.Conn{}, noRegistry{}, rules.StaticSource(nil)); err != nil {
		t.Fatal(err)
	}
	return describe(t, reg)
}

// describe parses the name and labels of every metric the collectors
// registered on reg describe.
func describe(t testing.TB, reg *recorder) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	ch := make(chan *prometheus.Desc, 64)
	go func() {
		for _, c := range reg.cs {
			c.Describe(ch)
		}
		close(ch)
	}()
	for d := range ch {
		m := descRE.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("cannot parse %s", d)
		}
		var labels []string
		for _, cl := range strings.Split(m[2], ",") {
			if k, _, ok := strings.Cut(cl, "="); ok {
				labels = append(labels, k)
			}
		}
		for _, vl := range strings.Split(m[3], ",") {
			if vl != "" {
				labels = append(labels, strings.TrimSuffix(strings.TrimPrefix(vl, "c("), ")"))
			}
		}
		out[m[1]] = labels
	}
	return out
}

// noStore and noRegistry only let agent.New register its metrics.
type noStore struct{ agent.Store }
type noRegistry struct{ agent.Registry }

func enforcerMetrics(t testing.TB) map[string][]string {
	t.Helper()
	reg := &recorder{Registry: prometheus.NewRegistry()}
	regional.NewMetrics(reg, "r")
	reg.MustRegister(regional.ScriptLoadsCollector("r", func() uint64 { return 0 }))
	// The usage publisher's metrics (ratelimitd with --nats-url). NewPublisher
	// does not use the connection before Start.
	if _, err := usage.NewPublisher(&nats.Conn{}, usage.NewRecorder(16), "r", "e", usage.WithMetrics(reg)); err != nil {
		t.Fatal(err)
	}
	out := describe(t, reg)
	// Registered by regional/enforcerd when rules come from etcd.
	src, err := os.ReadFile(filepath.Join("..", "regional", "enforcerd", "source.go"))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"apportion_rule_invalid_documents_total", "apportion_rule_invalid_documents",
		"apportion_rule_etcd_reachable", "apportion_rule_revision"} {
		if !bytes.Contains(src, []byte(`"`+name+`"`)) {
			t.Fatalf("regional/enforcerd/source.go no longer registers %s: update this test", name)
		}
		out[name] = []string{"region"}
	}
	if _, ok := out[regional.MetricChecks]; !ok || len(out) < 10 {
		t.Fatalf("enforcer metrics incomplete: %v", out)
	}
	return out
}

var metricName = regexp.MustCompile(`apportion_[a-z_]+`)
var selector = regexp.MustCompile(`(apportion_[a-z_]+)\{([^}]*)\}`)
var matcher = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)

func TestMetricNamesExist(t *testing.T) {
	known := enforcerMetrics(t)
	for name, labels := range agentMetrics(t) {
		known[name] = labels
	}
	// Labels Prometheus adds to every series, and le of histogram buckets.
	extra := []string{"job", "instance", "le"}

	files := map[string][]string{} // file -> strings to search
	for _, f := range []string{filepath.Join("prometheus", "alerts.yml")} {
		for _, d := range yamlDocs(t, f) {
			files[f] = append(files[f], allStrings(d)...)
		}
	}
	for _, f := range deployFiles(t, ".json") {
		if !strings.HasPrefix(f, "grafana") {
			continue
		}
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var v any
		if err := json.Unmarshal(data, &v); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		files[f] = allStrings(v)
	}
	for f, texts := range files {
		used := map[string]bool{}
		for _, s := range texts {
			for _, name := range metricName.FindAllString(s, -1) {
				used[name] = true
				if _, ok := known[name]; ok {
					continue
				}
				base := name
				for _, suf := range []string{"_bucket", "_sum", "_count"} {
					base = strings.TrimSuffix(base, suf)
				}
				if base == name || !slices.Contains(histograms, base) {
					t.Errorf("%s: metric %s is not exported by ratelimitd nor in the syncagent contract", f, name)
				}
			}
			for _, sel := range selector.FindAllStringSubmatch(s, -1) {
				name, base := sel[1], sel[1]
				for _, suf := range []string{"_bucket", "_sum", "_count"} {
					base = strings.TrimSuffix(base, suf)
				}
				labels, ok := known[base]
				if !ok {
					continue // reported above
				}
				for _, m := range matcher.FindAllStringSubmatch(sel[2], -1) {
					if !slices.Contains(labels, m[1]) && !slices.Contains(extra, m[1]) {
						t.Errorf("%s: %s{%s}: %s has no label %q (labels: %v)", f, name, sel[2], base, m[1], labels)
					}
				}
			}
		}
		if len(used) < 8 {
			t.Errorf("%s uses only %d apportion metrics: %v", f, len(used), keys(used))
		}
	}
	// The alerts and panels the deploy files promise.
	all := strings.Join(append(files[filepath.Join("prometheus", "alerts.yml")], files[filepath.Join("grafana", "apportion-dashboard.json")]...), "\n")
	for _, want := range []string{"apportion_store_errors_total", "apportion_breaker_state", "apportion_sync_peer_lag_seconds",
		"apportion_sync_fenced", `decision="rejected"`, "apportion_rule_invalid_documents_total",
		"apportion_check_duration_seconds_bucket", "apportion_sync_share_units", "apportion_sync_keys_coordinated",
		`decision=~"fail_.*"`, "shadow_rejected", "apportion_sync_peers_seen"} {
		if !strings.Contains(all, want) {
			t.Errorf("neither alerts.yml nor the dashboard uses %s", want)
		}
	}
}
