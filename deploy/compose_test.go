package deploy

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// ---------------------------------------------------------------------------
// docker-compose.

type composeService struct {
	Image       string         `json:"image"`
	Build       any            `json:"build"`
	Command     any            `json:"command"`
	Environment any            `json:"environment"`
	Ports       []string       `json:"ports"`
	Volumes     []string       `json:"volumes"`
	DependsOn   any            `json:"depends_on"`
	Healthcheck *composeHealth `json:"healthcheck"`
}

type composeHealth struct {
	Test []string `json:"test"`
}

type composeFile struct {
	Services map[string]composeService `json:"services"`
	Volumes  map[string]any            `json:"volumes"`
}

func loadCompose(t testing.TB) composeFile {
	t.Helper()
	var c composeFile
	yamlInto(t, "docker-compose.yml", &c)
	if len(c.Services) == 0 {
		t.Fatal("docker-compose.yml: no services")
	}
	return c
}

func (s composeService) command() []string {
	switch c := s.Command.(type) {
	case string:
		return strings.Fields(c)
	case []any:
		var out []string
		for _, e := range c {
			out = append(out, toString(e))
		}
		return out
	}
	return nil
}

// binary is the apportion binary the service runs ("" if not ours).
func (s composeService) binary() string {
	if !strings.Contains(s.Image, "apportion") {
		return ""
	}
	if cmd := s.command(); len(cmd) > 0 {
		return cmd[0]
	}
	return "ratelimitd" // the image's CMD
}

func (s composeService) env() map[string]string {
	out := map[string]string{}
	switch e := s.Environment.(type) {
	case map[string]any:
		for k, v := range e {
			out[k] = toString(v)
		}
	case []any:
		for _, kv := range e {
			k, v, _ := strings.Cut(toString(kv), "=")
			out[k] = v
		}
	}
	return out
}

func (s composeService) dependsOn() []string {
	switch d := s.DependsOn.(type) {
	case []any:
		var out []string
		for _, e := range d {
			out = append(out, toString(e))
		}
		return out
	case map[string]any:
		var out []string
		for k := range d {
			out = append(out, k)
		}
		return out
	}
	return nil
}

func TestComposeStructure(t *testing.T) {
	c := loadCompose(t)
	for _, r := range regions {
		for _, svc := range []string{"redis-", "nats-", "ratelimitd-", "syncagent-"} {
			if _, ok := c.Services[svc+r]; !ok {
				t.Errorf("docker-compose.yml: no service %s%s", svc, r)
			}
		}
	}
	for _, name := range []string{"etcd", "rules-init", "prometheus", "grafana"} {
		if _, ok := c.Services[name]; !ok {
			t.Errorf("docker-compose.yml: no service %s", name)
		}
	}
	for name, s := range c.Services {
		if s.Image == "" && s.Build == nil {
			t.Errorf("service %s: neither image nor build", name)
		}
		for _, d := range s.dependsOn() {
			if _, ok := c.Services[d]; !ok {
				t.Errorf("service %s depends on unknown service %q", name, d)
			}
		}
		for _, v := range s.Volumes {
			src, _, _ := strings.Cut(v, ":")
			if strings.HasPrefix(src, ".") || strings.HasPrefix(src, "/") {
				if _, err := os.Stat(src); err != nil {
					t.Errorf("service %s mounts %s, which does not exist: %v", name, src, err)
				}
			} else if _, ok := c.Volumes[src]; !ok {
				t.Errorf("service %s uses volume %q, not declared under volumes:", name, src)
			}
		}
		b := s.binary()
		if name == "keys-init" { // a one-shot, like rules-init
			continue
		}
		if (b == "ratelimitd" || b == "syncagent" || strings.HasPrefix(name, "redis-") || strings.HasPrefix(name, "nats-") || name == "etcd") &&
			(s.Healthcheck == nil || len(s.Healthcheck.Test) == 0) {
			t.Errorf("service %s has no healthcheck", name)
		}
		if (b == "ratelimitd" || b == "syncagent") && !strings.Contains(strings.Join(s.Healthcheck.Test, " "), "/healthz") {
			t.Errorf("service %s: healthcheck %q does not call /healthz", name, s.Healthcheck.Test)
		}
	}
	// rules-init loads the very rules file that rlstack embeds.
	ri := c.Services["rules-init"]
	cmd := strings.Join(ri.command(), " ")
	if !strings.HasPrefix(cmd, "rlctl ") || !strings.Contains(cmd, "rules put -f /rules.yaml") || !strings.Contains(cmd, "--etcd-endpoints") {
		t.Errorf("rules-init command = %q, want rlctl --etcd-endpoints ... rules put -f /rules.yaml", cmd)
	}
	if !slices.Contains(ri.Volumes, "./rules.yaml:/rules.yaml:ro") {
		t.Errorf("rules-init does not mount ./rules.yaml at /rules.yaml: %v", ri.Volumes)
	}
	// The admin API: on the us-east enforcer, token from the environment,
	// required (compose refuses to start without it), no default.
	env := c.Services["ratelimitd-us-east"].env()
	if tok := env["APPORTION_ADMIN_TOKEN"]; !strings.HasPrefix(tok, "${APPORTION_ADMIN_TOKEN:?") {
		t.Errorf("ratelimitd-us-east APPORTION_ADMIN_TOKEN = %q, want ${APPORTION_ADMIN_TOKEN:?message}: required, no default", tok)
	}
	if env["APPORTION_ADMIN_ADDR"] == "" {
		t.Error("ratelimitd-us-east serves no admin API (APPORTION_ADMIN_ADDR)")
	}
	// Each region's enforcer and agent talk to their own region's Redis and NATS.
	for _, r := range regions {
		for _, svc := range []string{"ratelimitd-" + r, "syncagent-" + r} {
			env := c.Services[svc].env()
			if env["APPORTION_REGION"] != r {
				t.Errorf("%s: APPORTION_REGION = %q, want %q", svc, env["APPORTION_REGION"], r)
			}
			if got, want := env["APPORTION_REDIS_ADDR"], "redis-"+r+":6379"; got != want {
				t.Errorf("%s: APPORTION_REDIS_ADDR = %q, want %q", svc, got, want)
			}
			if got, want := env["APPORTION_NATS_URL"], "nats://nats-"+r+":4222"; got != want {
				t.Errorf("%s: APPORTION_NATS_URL = %q, want %q", svc, got, want)
			}
		}
		found := false
		for _, v := range c.Services["nats-"+r].Volumes {
			found = found || strings.HasPrefix(v, "./nats/"+r+".conf:")
		}
		if !found {
			t.Errorf("nats-%s does not mount ./nats/%s.conf", r, r)
		}
		// The agent signs with its own key (made by keys-init), which also
		// authenticates it to its NATS server, and verifies every region's.
		env := c.Services["syncagent-"+r].env()
		seed := "/keys/" + r + ".nk"
		if env["APPORTION_REPORT_SEED_FILE"] != seed || env["APPORTION_NATS_NKEY"] != seed || env["APPORTION_REPORT_PEER_KEYS"] != "@/keys/peers" {
			t.Errorf("syncagent-%s: report seed %q, NATS nkey %q, peer keys %q; want %s, %s, @/keys/peers", r,
				env["APPORTION_REPORT_SEED_FILE"], env["APPORTION_NATS_NKEY"], env["APPORTION_REPORT_PEER_KEYS"], seed, seed)
		}
		if env["APPORTION_INSECURE_UNSIGNED_REPORTS"] != "" {
			t.Errorf("syncagent-%s accepts unsigned reports", r)
		}
		if !slices.Contains(c.Services["nats-"+r].Volumes, "keys:/etc/nats/keys:ro") || !slices.Contains(c.Services["syncagent-"+r].Volumes, "keys:/keys:ro") {
			t.Errorf("nats-%s or syncagent-%s does not mount the keys volume", r, r)
		}
	}
	if cmd := c.Services["keys-init"].command(); !slices.Equal(cmd, append([]string{"syncagent", "keys", "/keys"}, regions...)) {
		t.Errorf("keys-init runs %q, want syncagent keys /keys %s", cmd, strings.Join(regions, " "))
	}
}

// Every host port the compose stack publishes is bound to 127.0.0.1: the
// laptop stack (plain text, etcd without auth) is never on the network.
func TestComposePublishesOnLoopbackOnly(t *testing.T) {
	n := 0
	for name, s := range loadCompose(t).Services {
		for _, p := range s.Ports {
			n++
			if !strings.HasPrefix(p, "127.0.0.1:") {
				t.Errorf("docker-compose.yml service %s publishes %q: bind it to 127.0.0.1", name, p)
			}
		}
	}
	if n < 10 {
		t.Errorf("found only %d published ports", n)
	}
}

// TestComposeConfig runs docker compose's own validation where it is installed.
func TestComposeConfig(t *testing.T) {
	var cmd []string
	switch {
	case exec.Command("docker", "compose", "version").Run() == nil:
		cmd = []string{"docker", "compose"}
	case exec.Command("docker-compose", "version").Run() == nil:
		cmd = []string{"docker-compose"}
	default:
		t.Log("neither `docker compose` nor `docker-compose` works here: docker-compose.yml was checked by this package's own tests only, not by `docker compose config`")
		return
	}
	args := append(cmd[1:], "-f", "docker-compose.yml", "config", "-q")
	c := exec.Command(cmd[0], args...)
	c.Env = append(os.Environ(), "APPORTION_ADMIN_TOKEN=deploy-test") // required, no default
	out, err := c.CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(append(cmd[:1:1], args...), " "), err, out)
	}
}
