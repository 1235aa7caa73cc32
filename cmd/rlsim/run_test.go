package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apportion/apportion/cmd/internal/live"
	"github.com/creack/pty"
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
		{[]string{"run", scenarios + "shift.yaml", "--duration", "-5s"}, "--duration -5s: must not be negative (0 or absent: the scenario's duration)"},
		{[]string{"sweep", scenarios + "flash-crowd.yaml", "--duration", "-1s", "--param", "rtt", "--values", "1"}, "--duration -1s: must not be negative"},
		{[]string{"live", scenarios + "shift.yaml", "--speed", "0", "--quiet"}, "--speed 0: must be a number above 0"},
		{[]string{"live", scenarios + "shift.yaml", "--speed", "-2", "--quiet"}, "--speed -2: must be a number above 0"},
		{[]string{"sweep", scenarios + "flash-crowd.yaml", "--duration", "1s", "--param", "rtt", "--values", "1e300"},
			"rtt=1e300: scenario: network.delay_ms.eu-west.ap-south: 6e+301 ms is above the maximum of 3600000 ms (an hour)"},
		{[]string{"sweep", scenarios + "flash-crowd.yaml", "--duration", "1s", "--param", "rtt", "--values", "inf"}, `rtt value "inf": want a finite factor`},
		{[]string{"sweep", scenarios + "flash-crowd.yaml", "--duration", "1s", "--param", "rtt", "--values", "200h"}, "rtt=200h: scenario: network.delay_ms"},
		{[]string{"live", scenarios + "shift.yaml", "--max-load", "-5", "--quiet"}, "--max-load -5: must be a number of requests/s above 0 (default 1500)"},
		{[]string{"live", scenarios + "shift.yaml", "--max-load", "0", "--quiet"}, "--max-load 0: must be a number of requests/s above 0"},
		{[]string{"sweep", scenarios + "flash-crowd.yaml", "--duration", "1s", "--param", "interval", "--values", "0s"}, `interval value "0s": must be above 0`},
		{[]string{"sweep", scenarios + "flash-crowd.yaml", "--duration", "1s", "--param", "lease", "--values", "-1s"}, `lease value "-1s": must be above 0`},
		{[]string{"sweep", scenarios + "flash-crowd.yaml", "--duration", "1s", "--param", "half-life", "--values", "-1s"}, `half-life value "-1s": must not be negative`},
		{[]string{"sweep", scenarios + "flash-crowd.yaml", "--duration", "1s", "--param", "interval", "--values", "fast"}, `interval value "fast": want a duration such as 250ms`},
	}
	for _, c := range cases {
		var out, errb bytes.Buffer
		err := run(context.Background(), c.args, &out, &errb)
		if err == nil || !strings.Contains(err.Error()+errb.String(), c.want) {
			t.Errorf("%v: error %v, want %q", c.args, err, c.want)
		}
	}
}

// TestLiveRefusesEvents: a partition of two regions at once cannot be
// played live (an event concerns one region there): refused at once,
// naming the event, before anything starts.
func TestLiveRefusesEvents(t *testing.T) {
	src, err := os.ReadFile(scenarios + "partition.yaml")
	if err != nil {
		t.Fatal(err)
	}
	group := strings.Replace(string(src), "regions: [ap-south], at: 120s", "regions: [ap-south, eu-west], at: 120s", 1)
	if group == string(src) {
		t.Fatal("partition.yaml has no ap-south partition at 120s to widen")
	}
	file := filepath.Join(t.TempDir(), "group.yaml")
	if err := os.WriteFile(file, []byte(group), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	err = run(context.Background(), []string{"live", file, "--quiet"}, &out, &errb)
	if !errors.Is(err, live.ErrUnsupported) || !strings.Contains(err.Error(), "events[0] is a partition of a group (ap-south, eu-west)") {
		t.Fatalf("live: %v", err)
	}
}

func TestHelpAndVersion(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"-h"}, {"help"}, {"run", "--help"}, {"sweep", "-h"}, {"live", "--help"}} {
		var out, errb bytes.Buffer
		if err := run(context.Background(), args, &out, &errb); err != nil {
			t.Errorf("%v: %v", args, err)
		}
		if !strings.Contains(out.String()+errb.String(), "rlsim run SCENARIO.yaml") {
			t.Errorf("%v: no usage in\n%s%s", args, out.String(), errb.String())
		}
	}
	// sweep's -param names every parameter it takes.
	var help bytes.Buffer
	if err := run(context.Background(), []string{"sweep", "--help"}, &help, &help); err != nil || !strings.Contains(help.String(), "interval, lease or half-life") {
		t.Errorf("sweep --help: %v\n%s", err, help.String())
	}
	var out bytes.Buffer
	if err := run(context.Background(), []string{"--version"}, &out, &out); err != nil || !strings.HasPrefix(out.String(), "rlsim ") {
		t.Errorf("--version: %v %q", err, out.String())
	}
}

// TestProgressOnlyOnTerminal: the progress bar of a long run is drawn on a
// terminal (a pseudo-terminal here) and never into a file or pipe.
func TestProgressOnlyOnTerminal(t *testing.T) {
	args := []string{"run", scenarios + "shift.yaml", "--duration", "10m"}
	var out, errb bytes.Buffer
	if err := run(context.Background(), args, &out, &errb); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(errb.String(), "\r") || strings.Contains(errb.String(), "[#") {
		t.Errorf("progress bar written to a non-terminal:\n%q", errb.String())
	}
	if !strings.Contains(errb.String(), "simulated 10m0s") {
		t.Errorf("no timing line:\n%s", errb.String())
	}

	ptmx, term, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer ptmx.Close()
	t.Setenv("TERM", "xterm")
	read := make(chan string)
	go func() {
		b, _ := io.ReadAll(ptmx) // until the terminal side is closed (EIO)
		read <- string(b)
	}()
	out.Reset()
	err = run(context.Background(), args, &out, term)
	term.Close()
	if err != nil {
		t.Fatal(err)
	}
	drawn := <-read
	if !strings.Contains(drawn, "100%") || !strings.Contains(drawn, "\r[") {
		t.Errorf("no progress bar on the terminal:\n%q", drawn)
	}
}
