package scenario

import (
	"fmt"
	"os"
	"regexp"
	"testing"
)

// yamlBlockRE matches a fenced yaml block of a Markdown file.
var yamlBlockRE = regexp.MustCompile("(?ms)^```yaml\n(.*?)^```")

// TestReadmeScenarios: every yaml block of simulations/README.md is a
// scenario (the schema's example among them) that Parse accepts and that
// is small enough to run (CheckSize).
func TestReadmeScenarios(t *testing.T) {
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := yamlBlockRE.FindAllSubmatch(b, -1)
	if len(blocks) == 0 {
		t.Fatal("no yaml block in simulations/README.md")
	}
	for i, m := range blocks {
		name := fmt.Sprintf("README.md yaml block %d", i+1)
		sc, err := Parse(name, m[1])
		if err != nil {
			t.Errorf("%v", err)
			continue
		}
		if err := sc.CheckSize(sc.Duration.D()); err != nil {
			t.Errorf("%v", err)
		}
	}
}
