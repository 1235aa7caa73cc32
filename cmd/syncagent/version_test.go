package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/apportion/apportion/internal/version"
)

// TestVersionAndHelp: --version prints the one version line and needs no
// configuration; -h exits 0 and lists -version.
func TestVersionAndHelp(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"-version"}, {"--region", "x", "--version"}} {
		var out, errb bytes.Buffer
		if err := run(context.Background(), args, &out, &errb); err != nil || out.String() != version.Line("syncagent")+"\n" {
			t.Errorf("%v: %v, stdout %q, stderr %q", args, err, out.String(), errb.String())
		}
	}
	var out, errb bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &out, &errb); err != nil {
		t.Fatalf("-h: %v", err)
	}
	if !strings.Contains(errb.String(), "-version") || !strings.Contains(errb.String(), "print the version") {
		t.Errorf("-h does not list -version:\n%s", errb.String())
	}
}
