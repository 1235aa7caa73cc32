package deploy

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/regional/enforcerd"
	"github.com/apportion/apportion/sync/agentd"
)

// rlctl is a main package too: its flags (global and per command), read from
// cmd/rlctl (root.go and one file per command group); --prefix is the
// deprecated name of --etcd-prefix. Switch to the real flag set the same way
// when rlctl's run moves into an importable package.
var rlctlFlags = map[string]string{
	"etcd-endpoints": "", "etcd-prefix": "/ratelimit/rules/", "prefix": "/ratelimit/rules/", "admin-url": "", "token": "",
	"output": "table", "timeout": "10s", "file": "", "if-match": "0", "create": "false",
	"rate": "0", "burst": "0", "addr": "", "client-key": "", "resource": "", "cost": "1", "attr": "",
	"registry-prefix": "/ratelimit/registry/",
}

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

// flagenvName maps a flag name to its environment variable.
func flagenvName(flag string) string {
	return "APPORTION_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}
