// Package docs holds the project's documentation; its test keeps the
// documentation standing alone: every relative link of every Markdown file
// in the repository reaches a file of the repository (and a heading, when it
// names one), every repository path a source comment or document names
// exists, and nothing cites a design or style file that is not part of the
// repository.
package docs

import (
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

const root = ".."

// repoFiles returns the repository's text files (relative to root),
// skipping .git and binary-looking files.
func repoFiles(t *testing.T) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if d.Name() == ".git" || d.Name() == "bin" || d.Name() == "node_modules" {
				return filepath.SkipDir
			}
			return nil
		}
		switch filepath.Ext(p) {
		case ".go", ".md", ".proto", ".yml", ".yaml", ".json", ".tpl", ".txt", ".lua", ".conf", "":
			if filepath.Ext(p) == "" && isBinary(p) {
				return nil // a binary built in the tree (go build ./cmd/rlctl), not a document
			}
			rel, err := filepath.Rel(root, p)
			if err != nil {
				return err
			}
			out = append(out, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// isBinary reports whether the file's first 8 KB hold a NUL byte.
func isBinary(p string) bool {
	f, err := os.Open(p)
	if err != nil {
		return false
	}
	defer f.Close()
	b := make([]byte, 8192)
	n, _ := f.Read(b)
	return bytes.IndexByte(b[:n], 0) >= 0
}

func read(t *testing.T, rel string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// anchor is GitHub's anchor of a Markdown heading's text.
func anchor(heading string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '-', r == '_':
			return r
		case r == ' ':
			return '-'
		}
		return -1
	}, strings.ToLower(heading))
}

var headingRE = regexp.MustCompile(`(?m)^#{1,6} +(.+?) *$`)

func anchors(text string) map[string]bool {
	out := map[string]bool{}
	for _, m := range headingRE.FindAllStringSubmatch(stripFences(text), -1) {
		out[anchor(m[1])] = true
	}
	return out
}

var fenceRE = regexp.MustCompile("(?ms)^```.*?^```")

// stripFences removes fenced code blocks (shell comments are no headings).
func stripFences(text string) string { return fenceRE.ReplaceAllString(text, "") }

var linkRE = regexp.MustCompile(`\]\(([^)\s]+)\)`)

func TestMarkdownLinks(t *testing.T) {
	n := 0
	for _, f := range repoFiles(t) {
		if filepath.Ext(f) != ".md" {
			continue
		}
		text := read(t, f)
		for _, m := range linkRE.FindAllStringSubmatch(stripFences(text), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			n++
			path, frag, _ := strings.Cut(target, "#")
			dest := f
			if path != "" {
				dest = filepath.Clean(filepath.Join(filepath.Dir(f), path))
				if _, err := os.Stat(filepath.Join(root, dest)); err != nil {
					t.Errorf("%s: link %s: %s is not in the repository", f, target, dest)
					continue
				}
			}
			if frag != "" && strings.HasSuffix(dest, ".md") && !anchors(read(t, dest))[frag] {
				t.Errorf("%s: link %s: %s has no heading #%s", f, target, dest, frag)
			}
		}
	}
	if n < 30 {
		t.Errorf("only %d relative links found", n)
	}
}

// repoPathRE matches a repository path named in prose or a comment: a
// top-level directory of the repository, then a path ending in a file
// extension.
var repoPathRE = regexp.MustCompile(`\b((?:docs|deploy|proto|regional|rules|sync|allocation|simulations|internal|cmd)/[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.(?:md|go|proto|yml|yaml|json|lua|conf))\b`)

func TestNamedPathsExist(t *testing.T) {
	n := 0
	for _, f := range repoFiles(t) {
		for _, m := range repoPathRE.FindAllStringSubmatch(read(t, f), -1) {
			p := m[1]
			if strings.Contains(p, "*") || strings.Contains(p, "<") {
				continue
			}
			n++
			// Paths are written from the repository root, or relative to the file.
			if _, err := os.Stat(filepath.Join(root, p)); err == nil {
				continue
			}
			if _, err := os.Stat(filepath.Join(root, filepath.Dir(f), p)); err == nil {
				continue
			}
			t.Errorf("%s names %s, which is not in the repository", f, p)
		}
	}
	if n < 30 {
		t.Errorf("only %d repository paths named", n)
	}
}

// TestNoOutsideDesignDocs: the design is docs/design.md; no file cites a
// design or style document kept outside the repository.
func TestNoOutsideDesignDocs(t *testing.T) {
	outside := regexp.MustCompile(`\b(DESIGN|STYLE)` + `\.md\b|/work/` + `shared`)
	for _, f := range repoFiles(t) {
		for i, line := range strings.Split(read(t, f), "\n") {
			if outside.MatchString(line) {
				t.Errorf("%s:%d cites a file outside the repository: %s", f, i+1, strings.TrimSpace(line))
			}
		}
	}
	if _, err := os.Stat(filepath.Join(root, "docs", "design.md")); err != nil {
		t.Fatal(err)
	}
}

// layers ranks the repository's packages as docs/design.md ("Layers")
// describes them: a package may import packages of its own rank or lower,
// never higher. A package missing here fails the test, so a new package
// gets a place in the design.
var layers = []struct {
	rank     int
	prefixes []string
}{
	// internal/ is plumbing for all. The composition roots (the local stack
	// and live runs, cmd/internal/stack and cmd/internal/live) sit in cmd/
	// with the mains. regional/ is below
	// sync/: the enforcer knows nothing of the agent; the usage deltas it
	// emits are its own package, which the agent imports.
	{0, []string{"internal/"}},
	{1, []string{"allocation", "rules", "proto/", "deploy"}},
	{2, []string{"regional/redisstore", "regional/usage", "rules/etcdstore", "rules/admin"}},
	{3, []string{"regional"}},
	{4, []string{"regional/envoy", "regional/middleware", "regional/client"}},
	{5, []string{"regional/enforcerd"}},
	{6, []string{"sync/ledger", "sync/wire"}},
	{7, []string{"sync/driver"}},
	{8, []string{"sync/agent"}},
	{9, []string{"sync/agentd"}},
	{10, []string{"simulations"}},
	{11, []string{"cmd/"}},
}

// pure packages import nothing that does I/O, reads the clock's wall
// time source, or draws random numbers.
var pure = map[string][]string{
	"allocation":  {"net", "os", "io", "math/rand", "math/rand/v2", "sync", "time"},
	"sync/ledger": {"net", "os", "io", "math/rand", "math/rand/v2", "sync"},
	"sync/driver": {"net", "os", "io", "math/rand", "math/rand/v2", "sync"},
}

func rankOf(pkg string) (int, bool) {
	best, rank := "", -1
	for _, l := range layers {
		for _, p := range l.prefixes {
			match := pkg == strings.TrimSuffix(p, "/") || strings.HasPrefix(pkg, strings.TrimSuffix(p, "/")+"/")
			if match && len(p) > len(best) {
				best, rank = p, l.rank
			}
		}
	}
	return rank, rank >= 0
}

func TestLayers(t *testing.T) {
	const module = "github.com/apportion/apportion/"
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}} {{join .Imports \" \"}}", module+"...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	n := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		pkg := strings.TrimPrefix(fields[0], module)
		if pkg == "docs" {
			continue
		}
		n++
		rank, ok := rankOf(pkg)
		if !ok {
			t.Errorf("package %s has no layer: add it to docs/design.md's Layers and to this test", pkg)
			continue
		}
		for _, imp := range fields[1:] {
			if banned := pure[pkg]; slices.Contains(banned, imp) {
				t.Errorf("%s is pure but imports %s", pkg, imp)
			}
			dep, ok := strings.CutPrefix(imp, module)
			if !ok {
				continue
			}
			if r, _ := rankOf(dep); r > rank {
				t.Errorf("%s (layer %d) imports %s (layer %d): arrows point down only", pkg, rank, dep, r)
			}
		}
	}
	if n < 30 {
		t.Errorf("only %d packages listed", n)
	}
}
