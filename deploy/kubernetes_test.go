package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

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
