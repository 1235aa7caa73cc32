package deploy

// These tests keep the deployment files honest: every file parses, every
// APPORTION_* variable and command-line flag names a real flag of the binary
// it configures, ports agree with the flags, every metric that an alert or a
// dashboard panel uses is exported, and one image name is used everywhere.
// They run without Docker or Kubernetes; where docker compose or kubectl is
// on PATH they also run its own validation. promtool is required
// (prometheus_test.go).

import (
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// image is the one image name of every apportion container.
const image = "apportion/apportion"

var regions = []string{"us-east", "eu-west", "ap-south"}

// pendingBinaries are named by the command-line contract but may not be in cmd/
// yet (other work in progress); deploy files may reference them.
var pendingBinaries = []string{"rlsim"}

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

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// ---------------------------------------------------------------------------
// Image names, Dockerfile.

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
