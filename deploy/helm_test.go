package deploy

// The Helm chart (helm/apportion) is checked as `helm lint` and `helm
// template` check it, by Helm's own packages used as a library (the chart
// loader, the linter and the template engine of helm.sh/helm/v3), so no
// helm binary is needed: every ci/*-values.yaml lints clean and renders,
// the chart refuses values without a region or backends (its
// values.schema.json), and the rendered objects pass the same checks as
// the Kubernetes base: well-formed names and labels, every APPORTION_*
// variable a flag of its binary, ports that agree with the listen
// addresses, Services and selectors that reach their pods, one image name.

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"sigs.k8s.io/yaml"
)

var chartDir = filepath.Join("helm", "apportion")

// chartValues returns the values files of ci/, by name.
func chartValues(t *testing.T) map[string]map[string]any {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no %s/ci/*-values.yaml (%v)", chartDir, err)
	}
	out := map[string]map[string]any{}
	for _, f := range files {
		v, err := chartutil.ReadValuesFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out[filepath.Base(f)] = v.AsMap()
	}
	return out
}

func TestHelmLint(t *testing.T) {
	for name, vals := range chartValues(t) {
		t.Run(name, func(t *testing.T) {
			l := lint.AllWithKubeVersion(chartDir, vals, "us-east", nil)
			for _, m := range l.Messages {
				if m.Severity >= support.WarningSev {
					t.Errorf("helm lint: %s", m)
				} else {
					t.Logf("helm lint: %s", m)
				}
			}
		})
	}
	// Without a region and backends the chart refuses to lint (and to install).
	l := lint.AllWithKubeVersion(chartDir, nil, "us-east", nil)
	var errs []string
	for _, m := range l.Messages {
		if m.Severity == support.ErrorSev {
			errs = append(errs, m.Error())
		}
	}
	joined := strings.Join(errs, "\n")
	for _, want := range []string{"region", "addr", "url", "endpoints"} {
		if !strings.Contains(joined, want) {
			t.Errorf("lint with the default values: no error naming %s; errors:\n%s", want, joined)
		}
	}
}

// render is `helm template rl helm/apportion -n us-east` with vals.
func render(t *testing.T, vals map[string]any) ([]k8sObject, string, error) {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return renderChart(t, ch, vals)
}

func renderChart(t *testing.T, ch *chart.Chart, vals map[string]any) ([]k8sObject, string, error) {
	t.Helper()
	rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{Name: "rl", Namespace: "us-east", IsInstall: true, Revision: 1},
		chartutil.DefaultCapabilities)
	if err != nil {
		return nil, "", err
	}
	files, err := engine.Render(ch, rv)
	if err != nil {
		return nil, "", err
	}
	var objs []k8sObject
	var notes string
	for _, name := range keys(files) {
		text := files[name]
		if strings.HasSuffix(name, "NOTES.txt") {
			notes = text
			continue
		}
		if !strings.HasSuffix(name, ".yaml") {
			continue
		}
		for i, doc := range docSep.Split(text, -1) {
			var m map[string]any
			if err := yaml.Unmarshal([]byte(doc), &m); err != nil {
				t.Fatalf("%s: document %d does not parse: %v\n%s", name, i+1, err, doc)
			}
			if m == nil {
				continue
			}
			kind, _ := m["kind"].(string)
			objName, _ := get(m, "metadata", "name").(string)
			if kind == "" || m["apiVersion"] == nil {
				t.Errorf("%s: a document without apiVersion and kind", name)
			}
			objs = append(objs, k8sObject{file: name, kind: kind, name: objName, doc: m})
		}
	}
	return objs, notes, nil
}

var dns1123 = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
var labelValue = regexp.MustCompile(`^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$`)

func TestHelmTemplate(t *testing.T) {
	bins := binaryFlags(t)
	for name, vals := range chartValues(t) {
		t.Run(name, func(t *testing.T) {
			objs, notes, err := render(t, vals)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, o := range objs {
				got = append(got, o.kind+"/"+o.name)
				if len(o.name) > 63 || !dns1123.MatchString(o.name) {
					t.Errorf("%s: name %q is not a DNS-1123 label", o.file, o.name)
				}
				labels, _ := get(o.doc, "metadata", "labels").(map[string]any)
				if labels["app.kubernetes.io/instance"] != "rl" || labels["apportion.io/region"] != vals["region"] {
					t.Errorf("%s %s: labels %v lack the instance and region", o.file, o.name, labels)
				}
				for k, v := range labels {
					if s := toString(v); len(s) > 63 || !labelValue.MatchString(s) {
						t.Errorf("%s %s: label %s=%q is not a valid label value", o.file, o.name, k, s)
					}
				}
			}
			sort.Strings(got)
			want := []string{"Deployment/rl-apportion-ratelimitd", "Deployment/rl-apportion-syncagent",
				"PodDisruptionBudget/rl-apportion-ratelimitd", "PodDisruptionBudget/rl-apportion-syncagent", "Service/rl-apportion-ratelimitd",
				"Service/rl-apportion-ratelimitd-headless", "Service/rl-apportion-syncagent"}
			if !slices.Equal(got, want) {
				t.Fatalf("objects %v, want %v", got, want)
			}
			checkWorkloads(t, objs, bins)
			for _, w := range []string{"rl-apportion-ratelimitd.us-east.svc:8081", "rlctl --admin-url"} {
				if !strings.Contains(notes, w) {
					t.Errorf("NOTES.txt lacks %q:\n%s", w, notes)
				}
			}
		})
	}
}

// checkWorkloads checks the containers and Services of a rendered chart.
func checkWorkloads(t *testing.T, objs []k8sObject, bins map[string]map[string]string) {
	t.Helper()
	podLabels := map[string]map[string]any{} // Deployment -> pod template labels
	ports := map[string]map[string]int{}     // Deployment -> container port names
	for _, c := range workloadContainers(objs) {
		bin := c.binary()
		flags := bins[bin]
		if flags == nil {
			t.Errorf("%s: runs %q", c.where(), bin)
			continue
		}
		img := toString(c.spec["image"])
		if repo, _, _ := strings.Cut(img, ":"); repo != image {
			t.Errorf("%s: image %q, want %s:TAG", c.where(), img, image)
		}
		values := map[string]string{}
		for name, e := range c.env() {
			if !strings.HasPrefix(name, "APPORTION_") {
				continue
			}
			if _, ok := flags[flagOfEnv(name)]; !ok {
				t.Errorf("%s: %s names no flag of %s (--%s)", c.where(), name, bin, flagOfEnv(name))
			}
			if e["value"] == nil && e["valueFrom"] == nil {
				t.Errorf("%s: %s has neither value nor valueFrom", c.where(), name)
			}
			values[name] = toString(e["value"])
		}
		cp := c.ports()
		for flag, p := range listenPorts(t, c.where(), values) {
			exposed := slices.Contains(mapValues(cp), p)
			// A loopback listener is reachable from inside the pod only.
			if lo := loopback(values[flagenvName(flag)]); lo == exposed {
				t.Errorf("%s: --%s listens on %s, containerPorts %v", c.where(), flag, values[flagenvName(flag)], cp)
			}
		}
		for _, probe := range []string{"readinessProbe", "livenessProbe"} {
			if port := toString(get(c.spec, probe, "httpGet", "port")); cp[port] == 0 {
				t.Errorf("%s: %s on port %q, which the container does not name", c.where(), probe, port)
			}
		}
		podLabels[c.obj.name], _ = get(c.obj.doc, "spec", "template", "metadata", "labels").(map[string]any)
		ports[c.obj.name] = cp
		sel, _ := get(c.obj.doc, "spec", "selector", "matchLabels").(map[string]any)
		if !selects(sel, podLabels[c.obj.name]) {
			t.Errorf("%s: selector %v does not select its pods %v", c.where(), sel, podLabels[c.obj.name])
		}
	}
	for _, o := range objs {
		if o.kind != "Service" && o.kind != "PodDisruptionBudget" {
			continue
		}
		sel, _ := get(o.doc, "spec", "selector").(map[string]any)
		if o.kind == "PodDisruptionBudget" {
			sel, _ = get(o.doc, "spec", "selector", "matchLabels").(map[string]any)
		}
		var target string
		for d, l := range podLabels {
			if selects(sel, l) {
				target = d
			}
		}
		if target == "" {
			t.Errorf("%s %s: selector %v selects no pods", o.kind, o.name, sel)
			continue
		}
		for _, p := range list(get(o.doc, "spec", "ports")) {
			if tp := toString(p["targetPort"]); ports[target][tp] == 0 {
				t.Errorf("Service %s: targetPort %q is no container port of %s (%v)", o.name, tp, target, ports[target])
			}
		}
	}
}

func selects(sel, labels map[string]any) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func mapValues(m map[string]int) []int {
	var out []int
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

// TestHelmValues: the switches of values.yaml change what is rendered.
func TestHelmValues(t *testing.T) {
	base := chartValues(t)["us-east-values.yaml"]
	if base == nil {
		t.Fatal("no ci/us-east-values.yaml")
	}
	with := func(path string, v any) map[string]any {
		// A copy of base along path, with v at its end.
		vals := map[string]any{}
		for k, v := range base {
			vals[k] = v
		}
		cur := vals
		parts := strings.Split(path, ".")
		for _, p := range parts[:len(parts)-1] {
			next, _ := cur[p].(map[string]any)
			cp := map[string]any{}
			for k, v := range next {
				cp[k] = v
			}
			cur[p] = cp
			cur = cp
		}
		cur[parts[len(parts)-1]] = v
		return vals
	}
	envOf := func(objs []k8sObject, deployment string) map[string]map[string]any {
		for _, c := range workloadContainers(objs) {
			if c.obj.name == deployment {
				return c.env()
			}
		}
		return nil
	}
	t.Run("no sync agent", func(t *testing.T) {
		objs, _, err := render(t, with("syncagent.enabled", false))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			if strings.Contains(o.name, "syncagent") {
				t.Errorf("%s/%s rendered with syncagent.enabled=false", o.kind, o.name)
			}
		}
	})
	t.Run("no admin API", func(t *testing.T) {
		objs, _, err := render(t, with("ratelimitd.admin", map[string]any{"enabled": false}))
		if err != nil {
			t.Fatal(err)
		}
		env := envOf(objs, "rl-apportion-ratelimitd")
		if env == nil || env["APPORTION_ADMIN_ADDR"] != nil || env["APPORTION_ADMIN_TOKEN"] != nil {
			t.Errorf("admin settings rendered with admin.enabled=false: %v", keys(env))
		}
		for _, o := range objs {
			if strings.HasSuffix(o.name, "-admin") {
				t.Errorf("%s/%s rendered with admin.enabled=false", o.kind, o.name)
			}
		}
	})
	t.Run("admin API on loopback unless exposed with mutual TLS", func(t *testing.T) {
		objs, _, err := render(t, base)
		if err != nil {
			t.Fatal(err)
		}
		env := envOf(objs, "rl-apportion-ratelimitd")
		if v := toString(env["APPORTION_ADMIN_ADDR"]["value"]); !loopback(v) {
			t.Errorf("APPORTION_ADMIN_ADDR=%q by default, want loopback", v)
		}
		if _, _, err := render(t, with("ratelimitd.admin", map[string]any{"enabled": true, "expose": true})); err == nil ||
			!strings.Contains(err.Error(), "mutual TLS") {
			t.Errorf("admin exposed without TLS: %v, want an error asking for mutual TLS", err)
		}
		vals := with("ratelimitd.admin", map[string]any{"enabled": true, "expose": true})
		vals["ratelimitd"].(map[string]any)["tls"] = map[string]any{"secretName": "ratelimitd-tls", "clientCA": true}
		objs, _, err = render(t, vals)
		if err != nil {
			t.Fatal(err)
		}
		env = envOf(objs, "rl-apportion-ratelimitd")
		if loopback(toString(env["APPORTION_ADMIN_ADDR"]["value"])) || toString(env["APPORTION_TLS_CLIENT_CA"]["value"]) != "/etc/apportion/tls/ca.crt" ||
			toString(env["APPORTION_TLS_CERT"]["value"]) == "" {
			t.Errorf("exposed admin with mutual TLS: env %v", env)
		}
		admin := false
		for _, o := range objs {
			admin = admin || o.name == "rl-apportion-ratelimitd-admin"
		}
		if !admin {
			t.Error("no admin Service with admin.expose and mutual TLS")
		}
		checkWorkloads(t, objs, binaryFlags(t))
	})
	t.Run("tracing", func(t *testing.T) {
		objs, _, err := render(t, base)
		if err != nil {
			t.Fatal(err)
		}
		env := envOf(objs, "rl-apportion-ratelimitd")
		if toString(env["APPORTION_OTLP_ENDPOINT"]["value"]) != "otel-collector.observability.svc:4317" ||
			toString(env["APPORTION_TRACE_SAMPLE_RATIO"]["value"]) != "0.01" {
			t.Errorf("tracing values not rendered: %v", env)
		}
		objs, _, err = render(t, with("ratelimitd.tracing", map[string]any{"otlpEndpoint": ""}))
		if err != nil {
			t.Fatal(err)
		}
		if env := envOf(objs, "rl-apportion-ratelimitd"); env["APPORTION_OTLP_ENDPOINT"] != nil {
			t.Error("tracing on without an endpoint")
		}
	})
	t.Run("one agent is not a standby", func(t *testing.T) {
		objs, _, err := render(t, with("syncagent.replicas", 1))
		if err != nil {
			t.Fatal(err)
		}
		if v := toString(envOf(objs, "rl-apportion-syncagent")["APPORTION_STANDBY"]["value"]); v != "false" {
			t.Errorf("APPORTION_STANDBY=%q with one replica, want false", v)
		}
	})
	for _, bad := range []struct{ path, want string }{
		{"region", "region"}, {"redis.addr", "addr"}, {"ratelimitd.tracing.sampleRatio", "sampleRatio"},
		{"syncagent.reportPeerKeys", "reportPeerKeys"},
	} {
		t.Run("refuses bad "+bad.path, func(t *testing.T) {
			v := any("")
			if bad.path == "ratelimitd.tracing.sampleRatio" {
				v = 2
			}
			_, _, err := render(t, with(bad.path, v))
			if err == nil || !strings.Contains(err.Error(), bad.want) {
				t.Errorf("render with %s=%v: %v, want an error naming %s", bad.path, v, err, bad.want)
			}
		})
	}
	// The chart sets every variable the Kubernetes base sets for the same binary.
	objs, _, err := render(t, base)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range workloadContainers(k8sObjects(t, "k8s")) {
		if c.binary() != "ratelimitd" && c.binary() != "syncagent" {
			continue
		}
		chartEnv := envOf(objs, "rl-apportion-"+c.binary())
		for name := range c.env() {
			if chartEnv[name] == nil {
				t.Errorf("%s sets %s; the chart's %s does not", c.where(), name, c.binary())
			}
		}
	}
	if _, err := os.Stat(filepath.Join(chartDir, "values.schema.json")); err != nil {
		t.Error(err)
	}
}
