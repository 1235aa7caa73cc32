package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// defaultSecret finds placeholder secrets that a deployment could go live
// with unchanged.
var defaultSecret = regexp.MustCompile(`(?i)change[-_ ]?me|\bchangeit\b|\bs3cret\b|password123`)

// secretVar names an environment variable that holds a secret.
var secretVar = regexp.MustCompile(`(?i)(TOKEN|PASSWORD|SECRET|_KEY|CREDS)$`)

// No deploy file ships a default secret: no placeholder such as change-me in
// any file, no compose secret with a ${VAR:-default} fallback, and the
// example Kubernetes Secret's values are all empty (ratelimitd refuses an
// empty admin token, so it cannot be applied as is).
func TestNoDefaultSecrets(t *testing.T) {
	for _, f := range deployFiles(t, ".yml", ".yaml", ".json", ".md", ".conf", "") {
		if filepath.Base(f) == "Dockerfile.dockerignore" {
			continue
		}
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(data), "\n") {
			if m := defaultSecret.FindString(line); m != "" {
				t.Errorf("%s:%d: %q looks like a default secret: %s", f, i+1, m, strings.TrimSpace(line))
			}
		}
	}
	fallback := regexp.MustCompile(`\$\{[A-Z0-9_]+:?-([^}]*)\}`)
	for name, s := range loadCompose(t).Services {
		for k, v := range s.env() {
			if !secretVar.MatchString(k) {
				continue
			}
			if m := fallback.FindStringSubmatch(v); m != nil && m[1] != "" {
				t.Errorf("docker-compose.yml service %s: %s=%q falls back to a default secret; use ${%s:?message}", name, k, v, k)
			}
			if !strings.HasPrefix(v, "${") {
				t.Errorf("docker-compose.yml service %s: %s is set to a literal secret", name, k)
			}
		}
	}
	for _, d := range yamlDocs(t, filepath.Join("k8s", "base", "secret.example.yaml")) {
		data, _ := get(d, "stringData").(map[string]any)
		if len(data) == 0 {
			t.Error("secret.example.yaml: no stringData")
		}
		for k, v := range data {
			if toString(v) != "" {
				t.Errorf("secret.example.yaml: %s has the value %q; leave every example value empty", k, v)
			}
		}
	}
	// Kubernetes workloads read every secret from a Secret, never a literal.
	for _, c := range workloadContainers(k8sObjects(t, "k8s")) {
		for name, e := range c.env() {
			if secretVar.MatchString(name) && e["value"] != nil {
				t.Errorf("%s: %s is a literal value; read it from a Secret (valueFrom.secretKeyRef)", c.where(), name)
			}
		}
	}
}
