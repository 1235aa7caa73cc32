package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// promtool returns promtool's path, failing the test with the install line
// when it is missing: the alert rules are tested by promtool itself, and a
// full run never skips that (only the -short loop does, like the
// integration tests).
func promtool(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: the quick loop runs no external tools (bash .ci/test installs promtool for the full run)")
	}
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool is not on PATH; it tests the alert rules. Install it: apt-get install prometheus " +
			"(Debian/Ubuntu; only its promtool is used), or put promtool from a Prometheus release on PATH")
	}
	return p
}

// TestPromtool runs promtool's checks of the rules and the config, and the
// alert unit tests of prometheus/alerts_test.yml.
func TestPromtool(t *testing.T) {
	bin := promtool(t)
	for _, args := range [][]string{
		{"check", "rules", filepath.Join("prometheus", "alerts.yml")},
		{"check", "config", "--syntax-only", filepath.Join("prometheus", "prometheus.yml")},
		{"test", "rules", filepath.Join("prometheus", "alerts_test.yml")},
	} {
		out, err := exec.Command(bin, args...).CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// TestEveryAlertTested: every alert of alerts.yml fires in at least one
// test of alerts_test.yml, and is shown silent in at least one.
func TestEveryAlertTested(t *testing.T) {
	var alerts []string
	for _, d := range yamlDocs(t, filepath.Join("prometheus", "alerts.yml")) {
		for _, g := range d.(map[string]any)["groups"].([]any) {
			for _, r := range g.(map[string]any)["rules"].([]any) {
				if a, ok := r.(map[string]any)["alert"].(string); ok {
					alerts = append(alerts, a)
				}
			}
		}
	}
	fires, silent := map[string]bool{}, map[string]bool{}
	for _, d := range yamlDocs(t, filepath.Join("prometheus", "alerts_test.yml")) {
		for _, tc := range d.(map[string]any)["tests"].([]any) {
			for _, at := range tc.(map[string]any)["alert_rule_test"].([]any) {
				m := at.(map[string]any)
				name, _ := m["alertname"].(string)
				if exp, _ := m["exp_alerts"].([]any); len(exp) > 0 {
					fires[name] = true
				} else {
					silent[name] = true
				}
			}
		}
	}
	if len(alerts) < 15 {
		t.Fatalf("only %d alerts found in alerts.yml: %v", len(alerts), alerts)
	}
	for _, a := range alerts {
		if !fires[a] {
			t.Errorf("alert %s never fires in prometheus/alerts_test.yml: add a test case", a)
		}
		if !silent[a] {
			t.Errorf("alert %s is never shown silent in prometheus/alerts_test.yml (the healthy case)", a)
		}
	}
	for a := range fires {
		if !slices.Contains(alerts, a) {
			t.Errorf("alerts_test.yml tests %s, which alerts.yml does not define", a)
		}
	}
}

// TestRunbookLinks: every docs/operations.md#anchor that a deploy file
// names is a heading of docs/operations.md.
func TestRunbookLinks(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		if h, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " "); ok && strings.HasPrefix(line, "#") {
			a := strings.Map(func(r rune) rune {
				switch {
				case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '-':
					return r
				case r == ' ':
					return '-'
				}
				return -1
			}, strings.ToLower(h))
			anchors[a] = true
		}
	}
	link := regexp.MustCompile(`operations\.md#([a-z0-9-]+)`)
	n := 0
	for _, f := range deployFiles(t, ".yml", ".yaml", ".json", ".md") {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range link.FindAllStringSubmatch(string(data), -1) {
			n++
			if !anchors[m[1]] {
				t.Errorf("%s links docs/operations.md#%s, which is no heading there", f, m[1])
			}
		}
	}
	if n < 5 {
		t.Errorf("only %d links to docs/operations.md found", n)
	}
}
