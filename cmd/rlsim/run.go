package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"time"

	"github.com/apportion/apportion/cmd/internal/live"
	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/internal/tty"
	"github.com/apportion/apportion/internal/version"
	"github.com/apportion/apportion/simulations"
	"github.com/apportion/apportion/simulations/report"
	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
)

const usage = `usage:
  rlsim run SCENARIO.yaml [--out DIR] [--seed N] [--duration D] [--quiet]
  rlsim sweep SCENARIO.yaml --param rtt|interval|lease|half-life --values a,b,c [--out DIR] [--seed N] [--duration D]
  rlsim live SCENARIO.yaml [--out DIR] [--seed N] [--duration D] [--speed F] [--max-load N] [--quiet]
  rlsim help | --help | COMMAND --help
  rlsim --version

run draws a progress bar on stderr for runs of 10 minutes of virtual time
or more, only when stderr is a terminal. Every flag also reads
APPORTION_<FLAG> from the environment (--max-load: APPORTION_MAX_LOAD).`

type common struct {
	out      string
	seed     uint64
	duration time.Duration
	quiet    bool
	param    string
	values   string
	speed    float64
	maxLoad  float64
}

// parse parses flags that may come before or after the one positional
// argument (the scenario file).
func parse(fs *flag.FlagSet, args []string) (string, error) {
	var pos []string
	for {
		if err := flagenv.Parse(fs, args, os.LookupEnv); err != nil {
			return "", err
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	if len(pos) != 1 {
		return "", fmt.Errorf("want exactly one scenario file, got %d arguments\n%s", len(pos), usage)
	}
	return pos[0], nil
}

// run runs one rlsim command. Help returns nil: rlsim help, -h and --help
// print the usage to stdout, a command's -h its flags to stderr.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return errors.New(usage)
	}
	cmd, args := args[0], args[1:]
	if cmd == "--version" || cmd == "-version" || cmd == "version" {
		return version.Print(stdout, "rlsim")
	}
	var c common
	fs := flag.NewFlagSet("rlsim "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "%s\n\nflags of rlsim %s:\n", usage, cmd)
		fs.PrintDefaults()
	}
	fs.StringVar(&c.out, "out", "", "directory for the CSV, JSON, SVG and PNG outputs (default: none, table only)")
	fs.Uint64Var(&c.seed, "seed", 0, "seed (default: the scenario's)")
	fs.DurationVar(&c.duration, "duration", 0, "override the scenario's duration (default and 0: the scenario's)")
	switch cmd {
	case "run":
		fs.BoolVar(&c.quiet, "quiet", false, "no progress bar and no timing line on stderr")
	case "sweep":
		fs.StringVar(&c.param, "param", "", "setting to sweep: rtt (factor of the delay matrix, or a round trip such as 100ms), interval, lease or half-life (of the ledger's demand estimate)")
		fs.StringVar(&c.values, "values", "", "comma-separated values, e.g. 0.5,1,2 or 100ms,250ms,1s")
	case "live":
		fs.Float64Var(&c.speed, "speed", 1, "play the scenario's timeline (demand changes, duration) this many times faster; rates, delays and sync settings stay (> 0)")
		fs.Float64Var(&c.maxLoad, "max-load", live.DefaultMaxLoad, "cap on the total offered load, requests/s (> 0); above it rate, burst and demand are scaled down by the same factor")
		fs.BoolVar(&c.quiet, "quiet", false, "no progress lines on stderr")
	case "help", "-h", "--help":
		fmt.Fprintln(stdout, usage)
		return nil
	default:
		return fmt.Errorf("unknown command %q\n%s", cmd, usage)
	}
	path, err := parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	if c.duration < 0 {
		return fmt.Errorf("--duration %v: must not be negative (0 or absent: the scenario's duration)", c.duration)
	}
	if cmd == "live" && !(c.speed > 0 && c.speed <= math.MaxFloat64) {
		return fmt.Errorf("--speed %v: must be a number above 0 (1: real time)", c.speed)
	}
	if cmd == "live" && !(c.maxLoad > 0 && c.maxLoad <= math.MaxFloat64) {
		return fmt.Errorf("--max-load %v: must be a number of requests/s above 0 (default %d)", c.maxLoad, live.DefaultMaxLoad)
	}
	sc, err := scenario.Load(path)
	if err != nil {
		return err
	}
	opt := sim.Options{Seed: c.seed, Duration: c.duration}
	switch cmd {
	case "live":
		return runLive(ctx, sc, c, stdout, stderr)
	case "run":
		return runOne(ctx, sc, c, opt, stdout, stderr)
	default:
		return sweep(ctx, sc, c, opt, stdout)
	}
}

func progress(w io.Writer) func(float64) {
	last := -1
	return func(done float64) {
		p := int(done * 100)
		if p == last {
			return
		}
		last = p
		n := p / 2
		fmt.Fprintf(w, "\r[%s%s] %3d%%", strings.Repeat("#", n), strings.Repeat(".", 50-n), p)
		if p >= 100 {
			fmt.Fprintln(w)
		}
	}
}

func runOne(ctx context.Context, sc *scenario.Scenario, c common, opt sim.Options, stdout, stderr io.Writer) error {
	dur := sc.Duration.D()
	if opt.Duration > 0 {
		dur = opt.Duration
	}
	if !c.quiet && dur >= 10*time.Minute && tty.Is(stderr) {
		opt.Progress = progress(stderr)
	}
	start := time.Now()
	res, err := simulations.Run(ctx, sc, opt)
	if err != nil {
		return err
	}
	if opt.Progress != nil {
		opt.Progress(1)
	}
	if !c.quiet {
		fmt.Fprintf(stderr, "simulated %v in %v (%d events)\n", dur, time.Since(start).Round(time.Millisecond), res.Events)
	}
	fmt.Fprint(stdout, report.Table(res))
	if c.out == "" {
		return nil
	}
	files, err := report.RunFiles(res)
	if err != nil {
		return err
	}
	return report.Write(c.out, files)
}

func sweep(ctx context.Context, sc *scenario.Scenario, c common, opt sim.Options, stdout io.Writer) error {
	if c.param == "" || c.values == "" {
		return fmt.Errorf("sweep needs --param and --values\n%s", usage)
	}
	pts, err := simulations.Sweep(ctx, sc, c.param, strings.Split(c.values, ","), opt)
	if err != nil {
		return err
	}
	fmt.Fprint(stdout, report.SweepTable(pts))
	if c.out == "" {
		return nil
	}
	files, err := report.SweepFiles(pts)
	if err != nil {
		return err
	}
	return report.Write(c.out, files)
}

func runLive(ctx context.Context, sc *scenario.Scenario, c common, stdout, stderr io.Writer) error {
	opt := live.Options{Seed: c.seed, Duration: c.duration, Speed: c.speed, MaxLoad: c.maxLoad}
	if !c.quiet {
		opt.Progress = stderr
		fmt.Fprintf(stderr, "live: starting the stack (%d regions) and playing %s\n", len(sc.Regions), sc.Name)
	}
	res, err := live.Run(ctx, sc, opt)
	if err != nil {
		return err
	}
	fmt.Fprint(stdout, res.Table())
	if c.out == "" {
		return nil
	}
	files, err := res.Files()
	if err != nil {
		return err
	}
	return report.Write(c.out, files)
}
