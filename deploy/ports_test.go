package deploy

import (
	"net"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

func portOf(t testing.TB, where, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s: address %q: %v", where, addr, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("%s: port of %q: %v", where, addr, err)
	}
	return n
}

// listenPorts returns the port of each listen-address variable (*_ADDR but
// the Redis address), by flag name.
func listenPorts(t testing.TB, where string, env map[string]string) map[string]int {
	out := map[string]int{}
	for k, v := range env {
		if strings.HasSuffix(k, "_ADDR") && k != "APPORTION_REDIS_ADDR" {
			out[flagOfEnv(k)] = portOf(t, where+" "+k, v)
		}
	}
	return out
}

var urlPort = regexp.MustCompile(`https?://[^/:]+:(\d+)(/\S*)?`)

func TestPortsMatchFlags(t *testing.T) {
	rl := ratelimitdFlags(t)
	// The deploy files' conventional ports are the flags' default ports;
	// the admin API has no default address (off), 9090 by convention.
	// --metrics-addr has no default either (off), 8082 by convention.
	want := map[string]map[string]int{
		"ratelimitd": {"grpc-addr": portOf(t, "ratelimitd --grpc-addr default", rl["grpc-addr"]),
			"http-addr": portOf(t, "ratelimitd --http-addr default", rl["http-addr"]), "admin-addr": 9090, "metrics-addr": 8082},
		"syncagent": {"http-addr": portOf(t, "syncagent --http-addr default", syncagentFlags(t)["http-addr"])},
	}
	if want["ratelimitd"]["grpc-addr"] != 8081 || want["ratelimitd"]["http-addr"] != 8080 || want["syncagent"]["http-addr"] != 9091 {
		t.Errorf("flag default ports changed (%v): update the deploy files and this test", want)
	}
	for _, f := range []string{"admin-addr", "metrics-addr"} {
		if _, ok := rl[f]; !ok {
			t.Errorf("ratelimitd has no --%s flag", f)
		}
	}

	c := loadCompose(t)
	metricsPort := map[string]int{} // compose service -> its /metrics port
	for name, s := range c.Services {
		bin := s.binary()
		if want[bin] == nil || name == "keys-init" { // keys-init: syncagent keys, a one-shot
			continue
		}
		where := "docker-compose.yml service " + name
		lp := listenPorts(t, where, s.env())
		for f, p := range lp {
			if w, ok := want[bin][f]; !ok || p != w {
				t.Errorf("%s: --%s port %d, want %d", where, f, p, w)
			}
		}
		if _, ok := lp["http-addr"]; !ok {
			t.Errorf("%s: no APPORTION_HTTP_ADDR (the default listens on loopback only)", where)
		}
		metricsPort[name] = healthPort(lp)
		listening := map[int]bool{}
		for _, p := range lp {
			listening[p] = true
		}
		for _, m := range s.Ports {
			m, _, _ = strings.Cut(m, "/")
			parts := strings.Split(m, ":")
			cp, err := strconv.Atoi(parts[len(parts)-1])
			if err != nil || !listening[cp] {
				t.Errorf("%s: publishes container port %q, on which %s does not listen (%v)", where, m, bin, lp)
			}
		}
		if s.Healthcheck != nil {
			hc := strings.Join(s.Healthcheck.Test, " ")
			m := urlPort.FindStringSubmatch(hc)
			if m == nil || m[1] != strconv.Itoa(healthPort(lp)) {
				t.Errorf("%s: healthcheck %q does not call the health port %d", where, hc, healthPort(lp))
			}
		}
	}

	// Prometheus scrapes the compose services on their /metrics ports.
	var prom struct {
		ScrapeConfigs []struct {
			JobName       string `json:"job_name"`
			StaticConfigs []struct {
				Targets []string `json:"targets"`
			} `json:"static_configs"`
		} `json:"scrape_configs"`
	}
	yamlInto(t, filepath.Join("prometheus", "prometheus.yml"), &prom)
	scraped := map[string]bool{}
	for _, sc := range prom.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			for _, tg := range st.Targets {
				host, _, _ := strings.Cut(tg, ":")
				if host == "localhost" {
					continue
				}
				want, ok := metricsPort[host]
				if !ok {
					t.Errorf("prometheus.yml job %s: target %s is not an apportion service of docker-compose.yml", sc.JobName, tg)
					continue
				}
				if p := portOf(t, "prometheus.yml "+tg, tg); p != want {
					t.Errorf("prometheus.yml job %s: target %s, but %s serves /metrics on %d", sc.JobName, tg, host, want)
				}
				scraped[host] = true
			}
		}
	}
	for name := range metricsPort {
		if !scraped[name] && c.Services[name].binary() != "rlctl" {
			t.Errorf("prometheus.yml does not scrape %s", name)
		}
	}

	// Kubernetes: env listen ports = named containerPorts = probe ports.
	objs := k8sObjects(t, "k8s")
	for _, ct := range workloadContainers(objs) {
		bin := ct.binary()
		if want[bin] == nil {
			continue
		}
		env := map[string]string{}
		for k, e := range ct.env() {
			env[k] = toString(e["value"])
		}
		lp := listenPorts(t, ct.where(), env)
		ports := ct.ports()
		for f, p := range lp {
			if w := want[bin][f]; p != w {
				t.Errorf("%s: --%s port %d, want %d", ct.where(), f, p, w)
			}
			name := strings.TrimSuffix(f, "-addr")
			// A loopback listener is reachable from inside the pod only
			// (kubectl port-forward): it has no containerPort.
			if loopback(env[flagenvName(f)]) {
				if _, ok := ports[name]; ok {
					t.Errorf("%s: --%s listens on loopback but has containerPort %q", ct.where(), f, name)
				}
				delete(lp, f)
				continue
			}
			if ports[name] != p {
				t.Errorf("%s: listens on %d (--%s) but containerPort %q is %d", ct.where(), p, f, name, ports[name])
			}
		}
		for name, p := range ports {
			if lp[name+"-addr"] != p {
				t.Errorf("%s: containerPort %s=%d matches no listen flag (%v)", ct.where(), name, p, lp)
			}
		}
		for _, probe := range []string{"readinessProbe", "livenessProbe"} {
			hg, ok := get(ct.spec, probe, "httpGet").(map[string]any)
			if !ok {
				t.Errorf("%s: no %s.httpGet", ct.where(), probe)
				continue
			}
			p, path := resolvePort(hg["port"], ports), toString(hg["path"])
			if p != healthPort(lp) {
				t.Errorf("%s: %s on port %v, want the health port %d", ct.where(), probe, hg["port"], healthPort(lp))
			}
			if wantPath := map[string]string{"readinessProbe": "/readyz", "livenessProbe": "/healthz"}[probe]; path != wantPath {
				t.Errorf("%s: %s path %s, want %s", ct.where(), probe, path, wantPath)
			}
		}
		if ann := toString(get(ct.obj.doc, "spec", "template", "metadata", "annotations", "prometheus.io/port")); ann != strconv.Itoa(healthPort(lp)) {
			t.Errorf("%s: prometheus.io/port %q, want %d", ct.where(), ann, healthPort(lp))
		}
	}

	// Services point at ports the selected pods have.
	for _, o := range objs {
		if o.kind != "Service" {
			continue
		}
		sel, _ := get(o.doc, "spec", "selector").(map[string]any)
		var targets []container
		for _, ct := range workloadContainers(objs) {
			labels, _ := get(ct.obj.doc, "spec", "template", "metadata", "labels").(map[string]any)
			match := len(sel) > 0
			for k, v := range sel {
				match = match && labels[k] == v
			}
			if match {
				targets = append(targets, ct)
			}
		}
		if len(targets) == 0 {
			t.Errorf("%s: Service/%s selects no workload", o.file, o.name)
			continue
		}
		for _, sp := range list(get(o.doc, "spec", "ports")) {
			found := false
			for _, ct := range targets {
				found = found || resolvePort(sp["targetPort"], ct.ports()) != 0
			}
			if !found {
				t.Errorf("%s: Service/%s targetPort %v is no containerPort of the selected pods", o.file, o.name, sp["targetPort"])
			}
		}
	}
}

// healthPort is where /metrics, /healthz and /readyz are served: the
// --metrics-addr port when set, else the --http-addr port.
func healthPort(lp map[string]int) int {
	if p, ok := lp["metrics-addr"]; ok {
		return p
	}
	return lp["http-addr"]
}

// loopback reports whether a listen address binds the loopback interface.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// resolvePort resolves a probe or Service port (name or number).
func resolvePort(v any, ports map[string]int) int {
	switch p := v.(type) {
	case string:
		return ports[p]
	case float64:
		for _, n := range ports {
			if n == int(p) {
				return n
			}
		}
	}
	return 0
}
