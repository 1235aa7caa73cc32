package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/apportion/apportion/internal/version"
)

func TestVersion(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"--version"}, &out); err != nil || out.String() != version.Line("rlload")+"\n" {
		t.Errorf("--version: %v, %q", err, out.String())
	}
}
