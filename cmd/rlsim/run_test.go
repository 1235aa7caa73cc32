package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apportion/apportion/simulations/live"
)

const scenarios = "../../simulations/scenarios/"

func TestRun(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"run", scenarios + "shift.yaml", "--out", dir, "--duration", "90s", "--quiet"}, &out, &errb)
	if err != nil {
		t.Fatal(err, errb.String())
	}
	for _, want := range []string{"scenario shift", "ideal", "static", "independent", "async", "ledger", "convergence"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
	for _, f := range []string{"summary.txt", "summary.csv", "series.csv", "result.json", "admitted.svg", "admitted.png", "shares.svg", "shares.png"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", f, err)
		}
	}
	// Same seed, same table; flags before the file work too.
	var again bytes.Buffer
	if err := run(context.Background(), []string{"run", "--duration=90s", "--quiet", scenarios + "shift.yaml"}, &again, &errb); err != nil {
		t.Fatal(err)
	}
	if again.String() != out.String() {
		t.Errorf("same seed, different table")
	}
}

func TestSweepCommand(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"sweep", scenarios + "flash-crowd.yaml", "--param", "interval", "--values", "100ms,500ms", "--duration", "20s", "--out", dir}, &out, &errb)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "500ms") {
		t.Errorf("sweep table:\n%s", out.String())
	}
	if _, err := os.Stat(filepath.Join(dir, "sweep-utilization.png")); err != nil {
		t.Error(err)
	}
}

func TestErrors(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(bad, []byte("name: x\nduration: 1m\nregions:\n  - name: a\n  - name: a\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		args []string
		want string
	}{
		{nil, "usage"},
		{[]string{"fly"}, "unknown command"},
		{[]string{"run"}, "exactly one scenario"},
		{[]string{"run", "a.yaml", "b.yaml"}, "exactly one scenario"},
		{[]string{"run", "missing.yaml"}, "no such file"},
		{[]string{"run", bad}, "line 5"},
		{[]string{"sweep", scenarios + "shift.yaml"}, "--param"},
		{[]string{"sweep", scenarios + "shift.yaml", "--param", "colour", "--values", "1"}, "unknown parameter"},
		{[]string{"run", scenarios + "shift.yaml", "--bogus"}, "flag provided but not defined"},
	}
	for _, c := range cases {
		var out, errb bytes.Buffer
		err := run(context.Background(), c.args, &out, &errb)
		if err == nil || !strings.Contains(err.Error()+errb.String(), c.want) {
			t.Errorf("%v: error %v, want %q", c.args, err, c.want)
		}
	}
}

func TestLiveRefusesEvents(t *testing.T) {
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"live", scenarios + "region-loss.yaml", "--quiet"}, &out, &errb)
	if !errors.Is(err, live.ErrUnsupported) {
		t.Fatalf("live: %v", err)
	}
}
