package deploy

// These tests keep the deployment files honest: every file parses, every
// APPORTION_* variable and command-line flag names a real flag of the binary
// it configures, ports agree with the flags, every metric that an alert or a
// dashboard panel uses is exported, and one image name is used everywhere.
// They run without Docker or Kubernetes; where docker compose or kubectl is
// on PATH they also run its own validation. promtool is required
// (prometheus_test.go).

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/enforcerd"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/agent"
	"github.com/apportion/apportion/sync/agentd"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/yaml"
)

// image is the one image name of every apportion container.
const image = "apportion/apportion"

var regions = []string{"us-east", "eu-west", "ap-south"}

// rlctl is a main package too: its flags (global and per command), read from
// cmd/rlctl (root.go and one file per command group); --prefix is the
// deprecated name of --etcd-prefix. Switch to the real flag set the same way
// when rlctl's run moves into an importable package.
var rlctlFlags = map[string]string{
	"etcd-endpoints": "", "etcd-prefix": "/ratelimit/rules/", "prefix": "/ratelimit/rules/", "admin-url": "", "token": "",
	"output": "table", "timeout": "10s", "file": "", "if-match": "0", "create": "false",
	"rate": "0", "burst": "0", "addr": "", "client-key": "", "resource": "", "cost": "1", "attr": "",
}

// histograms are the metrics whose _bucket, _sum and _count series queries use.
var histograms = []string{regional.MetricLatency, "apportion_sync_tick_duration_seconds"}

// pendingBinaries are named by the command-line contract but may not be in cmd/
// yet (other work in progress); deploy files may reference them.
var pendingBinaries = []string{"rlsim"}

// ---------------------------------------------------------------------------
// Flags of the binaries.

var flagLine = regexp.MustCompile(`^\s+-([a-z0-9][a-z0-9-]*)`)
var flagDefault = regexp.MustCompile(`\(default "?([^")]*)"?\)`)

// ratelimitdFlags returns ratelimitd's flags and defaults, parsed from its
// usage text (enforcerd.Run with -h).
func ratelimitdFlags(t testing.TB) map[string]string {
	t.Helper()
	return daemonFlags(t, "enforcerd.Run", enforcerd.Run)
}

// syncagentFlags returns syncagent's flags and defaults, parsed from its
// usage text (agentd.RunCommand with -h).
func syncagentFlags(t testing.TB) map[string]string {
	t.Helper()
	return daemonFlags(t, "agentd.RunCommand", agentd.RunCommand)
}

func daemonFlags(t testing.TB, name string, run func(context.Context, []string, io.Writer, io.Writer) error) map[string]string {
	t.Helper()
	var buf bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := run(ctx, []string{"-h"}, io.Discard, &buf)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("%s -h: want flag.ErrHelp, got %v\n%s", name, err, buf.String())
	}
	flags := map[string]string{}
	var cur string
	for _, line := range strings.Split(buf.String(), "\n") {
		if m := flagLine.FindStringSubmatch(line); m != nil && !strings.HasPrefix(line, "    \t") {
			cur = m[1]
			flags[cur] = ""
			continue
		}
		if cur != "" {
			if m := flagDefault.FindStringSubmatch(line); m != nil {
				flags[cur] = m[1]
			}
		}
	}
	if len(flags) < 10 {
		t.Fatalf("parsed only %d flags from ratelimitd -h:\n%s", len(flags), buf.String())
	}
	return flags
}

// binaryFlags maps each apportion binary that deploy files run to its flags.
func binaryFlags(t testing.TB) map[string]map[string]string {
	return map[string]map[string]string{
		"ratelimitd": ratelimitdFlags(t),
		"syncagent":  syncagentFlags(t),
		"rlctl":      rlctlFlags,
	}
}

// flagOfEnv maps APPORTION_REDIS_ADDR to redis-addr.
func flagOfEnv(name string) string {
	return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(name, "APPORTION_")), "_", "-")
}

// cliFlags returns the --flag names in args.
func cliFlags(args []string) []string {
	var out []string
	for _, a := range args {
		if a == "--" {
			break
		}
		if strings.HasPrefix(a, "-") && len(a) > 1 {
			name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
			if name == "f" {
				name = "file"
			}
			if name == "o" {
				name = "output"
			}
			out = append(out, name)
		}
	}
	return out
}

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

// ---------------------------------------------------------------------------
// Files.

// deployFiles returns the files under deploy/ (the package directory) whose
// names end in one of exts, sorted.
func deployFiles(t testing.TB, exts ...string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && p == filepath.Join("helm", "apportion", "templates") {
			return filepath.SkipDir // Go templates, not YAML: helm_test.go renders them
		}
		if !d.IsDir() && slices.Contains(exts, filepath.Ext(p)) {
			out = append(out, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	return out
}

var docSep = regexp.MustCompile(`(?m)^---[ \t]*$`)

// yamlDocs parses every document of a YAML file; empty documents are skipped.
func yamlDocs(t testing.TB, path string) []any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []any
	for i, doc := range docSep.Split(string(data), -1) {
		var v any
		if err := yaml.Unmarshal([]byte(doc), &v); err != nil {
			t.Fatalf("%s: document %d: %v", path, i+1, err)
		}
		if v != nil {
			out = append(out, v)
		}
	}
	return out
}

func yamlInto(t testing.TB, path string, v any) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

func TestFilesParse(t *testing.T) {
	files := deployFiles(t, ".yml", ".yaml", ".json")
	if len(files) < 10 {
		t.Fatalf("found only %d YAML/JSON files under deploy/: %v", len(files), files)
	}
	for _, f := range files {
		t.Run(f, func(t *testing.T) {
			if filepath.Ext(f) == ".json" {
				data, err := os.ReadFile(f)
				if err != nil {
					t.Fatal(err)
				}
				var v any
				if err := json.Unmarshal(data, &v); err != nil {
					t.Fatalf("%s: invalid JSON: %v", f, err)
				}
				return
			}
			if len(yamlDocs(t, f)) == 0 {
				t.Fatalf("%s: no YAML document", f)
			}
		})
	}
}

// allStrings walks a parsed YAML/JSON value and returns every string in it.
func allStrings(v any) []string {
	var out []string
	var walk func(any)
	walk = func(v any) {
		switch x := v.(type) {
		case string:
			out = append(out, x)
		case []any:
			for _, e := range x {
				walk(e)
			}
		case map[string]any:
			for _, e := range x {
				walk(e)
			}
		}
	}
	walk(v)
	return out
}

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

func toString(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case nil:
		return ""
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64)
	case bool:
		return strconv.FormatBool(x)
	}
	b, _ := json.Marshal(v)
	return string(b)
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

// The admin API writes rules: in Kubernetes it listens on loopback only
// (kubectl port-forward), or, to be served to the network, only with mutual
// TLS. No Service exposes a loopback-only port.
func TestAdminNotPlainOnTheNetwork(t *testing.T) {
	found := false
	for _, c := range workloadContainers(k8sObjects(t, "k8s")) {
		if c.binary() != "ratelimitd" {
			continue
		}
		env := map[string]string{}
		for k, e := range c.env() {
			env[k] = toString(e["value"])
			if e["valueFrom"] != nil {
				env[k] = "(from " + toString(e["valueFrom"]) + ")"
			}
		}
		addr, ok := env["APPORTION_ADMIN_ADDR"]
		if !ok {
			continue
		}
		found = true
		if loopback(addr) {
			continue
		}
		if env["APPORTION_TLS_CERT"] == "" || env["APPORTION_TLS_CLIENT_CA"] == "" {
			t.Errorf("%s: admin API on %s in plain text or without client certificates: bind it to 127.0.0.1, or set APPORTION_TLS_CERT, APPORTION_TLS_KEY and APPORTION_TLS_CLIENT_CA", c.where(), addr)
		}
	}
	if !found {
		t.Error("no Kubernetes ratelimitd serves the admin API (APPORTION_ADMIN_ADDR)")
	}
	for _, o := range k8sObjects(t, "k8s") {
		if o.kind != "Service" {
			continue
		}
		for _, sp := range list(get(o.doc, "spec", "ports")) {
			if toString(sp["targetPort"]) == "admin" || toString(sp["port"]) == "9090" {
				t.Errorf("%s: Service/%s exposes the admin port, which listens on loopback only", o.file, o.name)
			}
		}
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

// ---------------------------------------------------------------------------
// Kubernetes.

type k8sObject struct {
	file string
	kind string
	name string
	doc  map[string]any
}

// k8sObjects returns the objects (documents with apiVersion and kind) of the
// YAML files under k8s/, except kustomization files.
func k8sObjects(t testing.TB, under string) []k8sObject {
	t.Helper()
	var out []k8sObject
	for _, f := range deployFiles(t, ".yaml", ".yml") {
		if !strings.HasPrefix(f, under) || filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		for _, d := range yamlDocs(t, f) {
			m, _ := d.(map[string]any)
			kind, _ := m["kind"].(string)
			if kind == "" || m["apiVersion"] == nil {
				t.Errorf("%s: a document without apiVersion and kind", f)
				continue
			}
			name, _ := get(m, "metadata", "name").(string)
			out = append(out, k8sObject{file: f, kind: kind, name: name, doc: m})
		}
	}
	return out
}

func get(v any, path ...string) any {
	for _, p := range path {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[p]
	}
	return v
}

func list(v any) []map[string]any {
	l, _ := v.([]any)
	var out []map[string]any
	for _, e := range l {
		if m, ok := e.(map[string]any); ok {
			out = append(out, m)
		}
	}
	return out
}

func strs(v any) []string {
	l, _ := v.([]any)
	var out []string
	for _, e := range l {
		out = append(out, toString(e))
	}
	return out
}

type container struct {
	obj  k8sObject
	spec map[string]any
}

func (c container) where() string {
	return c.obj.file + ": " + c.obj.kind + "/" + c.obj.name + " container " + toString(c.spec["name"])
}

func (c container) binary() string {
	if !strings.Contains(toString(c.spec["image"]), "apportion") {
		return ""
	}
	if cmd := strs(c.spec["command"]); len(cmd) > 0 {
		return cmd[0]
	}
	return "ratelimitd"
}

func (c container) env() map[string]map[string]any {
	out := map[string]map[string]any{}
	for _, e := range list(c.spec["env"]) {
		out[toString(e["name"])] = e
	}
	return out
}

// ports maps containerPort names to numbers (unnamed ports by their number).
func (c container) ports() map[string]int {
	out := map[string]int{}
	for _, p := range list(c.spec["ports"]) {
		n := int(p["containerPort"].(float64))
		name := toString(p["name"])
		if name == "" {
			name = strconv.Itoa(n)
		}
		out[name] = n
	}
	return out
}

func workloadContainers(objs []k8sObject) []container {
	var out []container
	for _, o := range objs {
		if o.kind != "Deployment" && o.kind != "StatefulSet" {
			continue
		}
		for _, c := range list(get(o.doc, "spec", "template", "spec", "containers")) {
			out = append(out, container{obj: o, spec: c})
		}
	}
	return out
}

// kustomizations returns the directories holding a kustomization.yaml.
func kustomizations(t testing.TB) []string {
	var dirs []string
	for _, f := range deployFiles(t, ".yaml") {
		if filepath.Base(f) == "kustomization.yaml" {
			dirs = append(dirs, filepath.Dir(f))
		}
	}
	if len(dirs) != 4 {
		t.Errorf("want 4 kustomizations (base and 3 overlays), found %v", dirs)
	}
	return dirs
}

type kustomization struct {
	Resources             []string `json:"resources"`
	Components            []string `json:"components"`
	PatchesStrategicMerge []string `json:"patchesStrategicMerge"`
	Patches               []struct {
		Path string `json:"path"`
	} `json:"patches"`
	ConfigMapGenerator []struct {
		Name     string   `json:"name"`
		Behavior string   `json:"behavior"`
		Literals []string `json:"literals"`
		Files    []string `json:"files"`
		Envs     []string `json:"envs"`
	} `json:"configMapGenerator"`
	Images []struct {
		Name    string `json:"name"`
		NewName string `json:"newName"`
	} `json:"images"`
}

// generatedKeys maps each ConfigMap that a kustomization generates to its keys.
func (k kustomization) generatedKeys() map[string][]string {
	out := map[string][]string{}
	for _, g := range k.ConfigMapGenerator {
		for _, l := range g.Literals {
			key, _, _ := strings.Cut(l, "=")
			out[g.Name] = append(out[g.Name], key)
		}
		for _, f := range g.Files {
			key, file, ok := strings.Cut(f, "=")
			if !ok {
				key = filepath.Base(file)
				if file == "" {
					key = filepath.Base(key)
				}
			}
			out[g.Name] = append(out[g.Name], key)
		}
	}
	return out
}

func TestKustomizations(t *testing.T) {
	var base kustomization
	for _, dir := range kustomizations(t) {
		var k kustomization
		yamlInto(t, filepath.Join(dir, "kustomization.yaml"), &k)
		if dir == filepath.Join("k8s", "base") {
			base = k
		}
		var listed []string
		listed = append(listed, k.Resources...)
		listed = append(listed, k.Components...)
		listed = append(listed, k.PatchesStrategicMerge...)
		for _, p := range k.Patches {
			if p.Path != "" {
				listed = append(listed, p.Path)
			}
		}
		for _, g := range k.ConfigMapGenerator {
			for _, f := range g.Files {
				_, file, ok := strings.Cut(f, "=")
				if !ok {
					file = f
				}
				listed = append(listed, file)
			}
			listed = append(listed, g.Envs...)
		}
		for _, f := range listed {
			p := filepath.Join(dir, f)
			st, err := os.Stat(p)
			if err != nil {
				t.Errorf("%s/kustomization.yaml lists %s, which does not exist", dir, f)
				continue
			}
			if st.IsDir() {
				if _, err := os.Stat(filepath.Join(p, "kustomization.yaml")); err != nil {
					t.Errorf("%s/kustomization.yaml lists directory %s, which has no kustomization.yaml", dir, f)
				}
			}
		}
		for _, img := range k.Images {
			if img.Name != image || (img.NewName != "" && img.NewName != image) {
				t.Errorf("%s/kustomization.yaml: image %q (newName %q), want %s", dir, img.Name, img.NewName, image)
			}
		}
	}

	// Every ConfigMap key the base's workloads read is generated by the base,
	// and overlays that merge into it only set keys the base has.
	keys := base.generatedKeys()
	for _, c := range workloadContainers(k8sObjects(t, filepath.Join("k8s", "base"))) {
		for name, e := range c.env() {
			ref, ok := get(e, "valueFrom", "configMapKeyRef").(map[string]any)
			if !ok {
				continue
			}
			cm, key := toString(ref["name"]), toString(ref["key"])
			if !slices.Contains(keys[cm], key) {
				t.Errorf("%s: %s reads ConfigMap %s key %s, which k8s/base does not generate", c.where(), name, cm, key)
			}
		}
	}
	for _, r := range regions {
		dir := filepath.Join("k8s", "overlays", r)
		var k kustomization
		yamlInto(t, filepath.Join(dir, "kustomization.yaml"), &k)
		got := map[string]string{}
		for _, g := range k.ConfigMapGenerator {
			for _, l := range g.Literals {
				key, val, _ := strings.Cut(l, "=")
				if g.Behavior == "merge" && !slices.Contains(keys[g.Name], key) {
					t.Errorf("%s: merges key %s into ConfigMap %s, which the base does not have", dir, key, g.Name)
				}
				got[key] = val
			}
		}
		if got["region"] != r || got["nats-gateway-name"] != r {
			t.Errorf("%s: region=%q nats-gateway-name=%q, want %q", dir, got["region"], got["nats-gateway-name"], r)
		}
		if !strings.Contains(got["redis-addr"], r) || !strings.Contains(got["nats-url"], r) {
			t.Errorf("%s: redis-addr=%q nats-url=%q do not name the region's own servers", dir, got["redis-addr"], got["nats-url"])
		}
	}
}

// TestKustomizeBuild renders base and overlays with kubectl where installed.
func TestKustomizeBuild(t *testing.T) {
	if _, err := exec.LookPath("kubectl"); err != nil {
		t.Log("kubectl is not installed: the kustomizations were checked by this package's own tests only, not rendered by `kubectl kustomize`")
		return
	}
	for _, dir := range kustomizations(t) {
		out, err := exec.Command("kubectl", "kustomize", dir).CombinedOutput()
		if err != nil {
			t.Errorf("kubectl kustomize %s: %v\n%s", dir, err, out)
			continue
		}
		for i, doc := range docSep.Split(string(out), -1) {
			var v any
			if err := yaml.Unmarshal([]byte(doc), &v); err != nil {
				t.Errorf("kubectl kustomize %s: document %d: %v", dir, i+1, err)
			}
		}
		if r := filepath.Base(dir); slices.Contains(regions, r) && !strings.Contains(string(out), "namespace: apportion-"+r) {
			t.Errorf("kubectl kustomize %s: objects are not in namespace apportion-%s", dir, r)
		}
	}
}

// ---------------------------------------------------------------------------
// Environment variables, flags and ports.

func TestEnvAndFlagsMatchBinaries(t *testing.T) {
	bins := binaryFlags(t)
	check := func(where, bin string, env []string, args []string) {
		if bin == "" {
			for _, e := range env {
				if strings.HasPrefix(e, "APPORTION_") {
					t.Errorf("%s: sets %s but runs no apportion binary", where, e)
				}
			}
			return
		}
		flags, ok := bins[bin]
		if !ok {
			t.Errorf("%s: runs %q, which is not a binary these tests know the flags of", where, bin)
			return
		}
		for _, e := range env {
			if strings.HasPrefix(e, "APPORTION_") {
				if _, ok := flags[flagOfEnv(e)]; !ok {
					t.Errorf("%s: %s names no flag of %s (--%s)", where, e, bin, flagOfEnv(e))
				}
			}
		}
		for _, f := range cliFlags(args) {
			if _, ok := flags[f]; !ok {
				t.Errorf("%s: %s has no flag --%s", where, bin, f)
			}
		}
	}
	n := 0
	for name, s := range loadCompose(t).Services {
		var args []string
		if cmd := s.command(); len(cmd) > 1 {
			args = cmd[1:]
		}
		env := s.env()
		check("docker-compose.yml service "+name, s.binary(), keys(env), args)
		n += len(env)
	}
	for _, c := range workloadContainers(k8sObjects(t, "k8s")) {
		var args []string
		if cmd := strs(c.spec["command"]); len(cmd) > 1 {
			args = cmd[1:]
		}
		args = append(args, strs(c.spec["args"])...)
		env := c.env()
		check(c.where(), c.binary(), keys(env), args)
		n += len(env)
	}
	if n < 20 {
		t.Errorf("checked only %d environment variables", n)
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
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

// flagenvName maps a flag name to its environment variable.
func flagenvName(flag string) string {
	return "APPORTION_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
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
	const invalid = "apportion_rule_invalid_documents_total"
	src, err := os.ReadFile(filepath.Join("..", "regional", "enforcerd", "source.go"))
	if err != nil || !bytes.Contains(src, []byte(`"`+invalid+`"`)) {
		t.Fatalf("regional/enforcerd/source.go no longer registers %s (%v): update this test", invalid, err)
	}
	out[invalid] = []string{"region"}
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

// ---------------------------------------------------------------------------
// NATS, image names, Dockerfile.

// natsKeys runs "syncagent keys" for every region into dir/keys, as the
// compose one-shot keys-init does, and returns each region's public key.
func natsKeys(t testing.TB, dir string) map[string]string {
	t.Helper()
	var out bytes.Buffer
	if err := agentd.RunCommand(context.Background(), append([]string{"keys", filepath.Join(dir, "keys")}, regions...), &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	pubs := map[string]string{}
	for _, line := range strings.Fields(out.String()) {
		r, pub, _ := strings.Cut(line, "=")
		pubs[r] = pub
	}
	return pubs
}

// regionNATSConfig parses deploy/nats/<region>.conf as the compose stack
// runs it: next to the keys directory that keys-init fills.
func regionNATSConfig(t testing.TB, dir, region string) (*natsserver.Options, error) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("nats", region+".conf"))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, region+".conf")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return natsserver.ProcessConfigFile(path)
}

func TestNATSConfigs(t *testing.T) {
	dir := t.TempDir()
	natsKeys(t, dir)
	check := func(path, region string) {
		var o *natsserver.Options
		var err error
		if strings.HasPrefix(path, "nats") {
			o, err = regionNATSConfig(t, dir, region)
		} else {
			o, err = natsserver.ProcessConfigFile(path)
		}
		if err != nil {
			t.Errorf("%s: %v", path, err)
			return
		}
		if o.Port != 4222 || o.Cluster.Port != 6222 || o.Gateway.Port != 7222 || o.HTTPPort != 8222 {
			t.Errorf("%s: ports client %d cluster %d gateway %d monitoring %d, want 4222 6222 7222 8222",
				path, o.Port, o.Cluster.Port, o.Gateway.Port, o.HTTPPort)
		}
		if o.Cluster.Name != region || o.Gateway.Name != region {
			t.Errorf("%s: cluster %q gateway %q, want both %q", path, o.Cluster.Name, o.Gateway.Name, region)
		}
		var gws []string
		for _, g := range o.Gateway.Gateways {
			gws = append(gws, g.Name)
			if len(g.URLs) == 0 {
				t.Errorf("%s: gateway %s has no URL", path, g.Name)
			}
		}
		for _, r := range regions {
			if !slices.Contains(gws, r) {
				t.Errorf("%s: no gateway to %s (gateways %v)", path, r, gws)
			}
		}
	}
	for _, r := range regions {
		check(filepath.Join("nats", r+".conf"), r)
	}
	t.Setenv("POD_NAME", "nats-0")
	t.Setenv("NATS_GATEWAY_NAME", "eu-west")
	check(filepath.Join("k8s", "base", "nats.conf"), "eu-west")
}

// subjectMatches reports whether NATS subject pattern p (with * and >)
// matches subject x.
func subjectMatches(p, x string) bool {
	pt, xt := strings.Split(p, "."), strings.Split(x, ".")
	for i, tok := range pt {
		if tok == ">" {
			return len(xt) > i
		}
		if i >= len(xt) || tok != "*" && tok != xt[i] {
			return false
		}
	}
	return len(pt) == len(xt)
}

// TestNATSPermissions: in every region's NATS configuration only that
// region's sync agent (its NKey, made by keys-init) may publish the
// region's reports, nobody may publish another region's, and clients
// without credentials are the enforcers, who may publish usage only. Then
// the same configuration runs (on free ports, without gateways) and a
// client of each kind tries.
func TestNATSPermissions(t *testing.T) {
	dir := t.TempDir()
	pubs := natsKeys(t, dir)
	for _, r := range regions {
		o, err := regionNATSConfig(t, dir, r)
		if err != nil {
			t.Fatalf("%s: %v", r, err)
		}
		type who struct {
			name  string
			perms *natsserver.Permissions
		}
		var all []who
		for _, u := range o.Users {
			all = append(all, who{"user " + u.Username, u.Permissions})
		}
		for _, u := range o.Nkeys {
			all = append(all, who{"nkey " + u.Nkey, u.Permissions})
		}
		if o.NoAuthUser != "ratelimitd" || len(o.Nkeys) != 1 || o.Nkeys[0].Nkey != pubs[r] {
			t.Errorf("%s: no_auth_user %q, nkeys %d (want ratelimitd, and one: the agent's %s)", r, o.NoAuthUser, len(o.Nkeys), pubs[r])
		}
		for _, w := range all {
			if w.perms == nil || w.perms.Publish == nil || len(w.perms.Publish.Allow) == 0 {
				t.Errorf("%s: %s may publish anything", r, w.name)
				continue
			}
			for _, other := range append(slices.Clone(regions), "zz") {
				for _, p := range w.perms.Publish.Allow {
					may := subjectMatches(p, agent.ReportSubject(other))
					if may && (other != r || w.name != "nkey "+pubs[r]) {
						t.Errorf("%s: %s may publish %s (%q)", r, w.name, agent.ReportSubject(other), p)
					}
				}
			}
		}

		// Live: the same options on free ports, alone.
		o.Port, o.HTTPPort, o.Cluster.Port, o.Gateway.Port, o.Gateway.Gateways, o.Gateway.Name = -1, 0, 0, 0, nil, ""
		o.Cluster.Name, o.NoLog, o.NoSigs = "", true, true
		ns, err := natsserver.NewServer(o)
		if err != nil {
			t.Fatalf("%s: %v", r, err)
		}
		go ns.Start()
		if !ns.ReadyForConnections(10 * time.Second) {
			t.Fatalf("%s: NATS not ready", r)
		}
		errs := make(chan error, 16)
		connect := func(opts ...nats.Option) (*nats.Conn, error) {
			return nats.Connect(ns.ClientURL(), append(opts, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { errs <- err }))...)
		}
		nkey := func(region string) nats.Option {
			opt, err := nats.NkeyOptionFromSeed(filepath.Join(dir, "keys", region+".nk"))
			if err != nil {
				t.Fatal(err)
			}
			return opt
		}
		agentNC, err := connect(nkey(r))
		if err != nil {
			t.Fatalf("%s: the agent's NKey is refused: %v", r, err)
		}
		anon, err := connect()
		if err != nil {
			t.Fatalf("%s: a client without credentials is refused: %v", r, err)
		}
		other := regions[0]
		if other == r {
			other = regions[1]
		}
		if nc, err := connect(nkey(other)); err == nil {
			nc.Close()
			t.Errorf("%s: %s's agent key is accepted", r, other)
		}
		got := make(chan string, 16)
		for _, subj := range []string{agent.ReportPrefix + "*", usage.Subject(r)} {
			if _, err := agentNC.Subscribe(subj, func(m *nats.Msg) { got <- m.Subject }); err != nil {
				t.Fatal(err)
			}
		}
		agentNC.Flush()
		// Refused publications: each gets a permissions error, no delivery.
		for _, tc := range []struct {
			nc   *nats.Conn
			subj string
		}{{anon, agent.ReportSubject(r)}, {anon, agent.ReportSubject(other)}, {agentNC, agent.ReportSubject(other)}} {
			tc.nc.Publish(tc.subj, []byte("x"))
			tc.nc.Flush()
			select {
			case err := <-errs:
				if !strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
					t.Errorf("%s: publish %s: %v", r, tc.subj, err)
				}
			case <-time.After(5 * time.Second):
				t.Errorf("%s: publish on %s was not refused", r, tc.subj)
			}
		}
		// Allowed ones arrive, and nothing refused arrived before them.
		anon.Publish(usage.Subject(r), []byte("x"))
		anon.Flush()
		agentNC.Publish(agent.ReportSubject(r), []byte("x"))
		agentNC.Flush()
		want := map[string]bool{usage.Subject(r): true, agent.ReportSubject(r): true} // two connections: any order
		for range 2 {
			select {
			case s := <-got:
				if !want[s] {
					t.Errorf("%s: got a message on %s, want one of %v", r, s, want)
				}
				delete(want, s)
			case <-time.After(5 * time.Second):
				t.Errorf("%s: nothing arrived on %v", r, want)
			}
		}
		anon.Close()
		agentNC.Close()
		ns.Shutdown()
	}
}

func TestImageNames(t *testing.T) {
	var images []string
	for name, s := range loadCompose(t).Services {
		if s.binary() != "" || s.Build != nil {
			images = append(images, "docker-compose.yml "+name+"\x00"+s.Image)
		}
	}
	for _, c := range workloadContainers(k8sObjects(t, "k8s")) {
		if strings.Contains(toString(c.spec["image"]), "apportion") {
			images = append(images, c.where()+"\x00"+toString(c.spec["image"]))
		}
	}
	if len(images) < 8 {
		t.Errorf("found only %d apportion images", len(images))
	}
	for _, wi := range images {
		where, img, _ := strings.Cut(wi, "\x00")
		repo := img // up to the tag, which may hold ${VAR:-default}
		if i := strings.Index(img[strings.LastIndex(img, "/")+1:], ":"); i >= 0 {
			repo = img[:strings.LastIndex(img, "/")+1+i]
		}
		if repo != image {
			t.Errorf("%s: image %q, want %s[:tag]", where, img, image)
		}
	}
	// No file names another apportion image.
	other := regexp.MustCompile(`(?:^|[^/\w.-])(apportion/[a-z0-9._-]+)`) // not in a path such as /etc/apportion/tls
	for _, f := range deployFiles(t, ".yml", ".yaml", ".json", ".md", "") {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, sm := range other.FindAllStringSubmatch(string(data), -1) {
			if m := sm[1]; m != image {
				t.Errorf("%s: mentions image %s, want %s", f, m, image)
			}
		}
	}
}

func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df := string(data)
	for _, want := range []string{"FROM golang:1.26 AS build", "CGO_ENABLED=0", "./cmd/...", "/usr/local/bin/", image} {
		if !strings.Contains(df, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	if strings.Count(df, "\nFROM ") < 2 {
		t.Error("Dockerfile is not multi-stage")
	}
	// Every binary a deploy file runs is built from cmd/ (or is still being written).
	bins := map[string]bool{"ratelimitd": true, "syncagent": true, "rlctl": true, "rlstack": true, "rlsim": true}
	for _, s := range loadCompose(t).Services {
		if b := s.binary(); b != "" {
			bins[b] = true
		}
	}
	for _, c := range workloadContainers(k8sObjects(t, "k8s")) {
		if b := c.binary(); b != "" {
			bins[b] = true
		}
	}
	for _, b := range keys(bins) {
		if _, err := os.Stat(filepath.Join("..", "cmd", b, "main.go")); err != nil {
			if slices.Contains(pendingBinaries, b) {
				t.Logf("cmd/%s does not exist yet: the image will have %s once it does", b, b)
				continue
			}
			t.Errorf("deploy files run %s, but there is no cmd/%s/main.go", b, b)
		}
	}
}
