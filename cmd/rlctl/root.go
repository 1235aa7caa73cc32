package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/apportion/apportion/internal/backend"
	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/internal/tlsconfig"
	"github.com/apportion/apportion/internal/version"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Exit codes.
const (
	exitOK       = 0
	exitFailure  = 1 // failure, or an invalid rule
	exitUsage    = 2
	exitNotFound = 3
	exitConflict = 4
	exitRejected = 5 // check: the enforcer answered and did not allow the request
)

// exitCodesText ends every command's help.
const exitCodesText = `Exit codes: 0 ok, 1 failure or invalid rule, 2 usage error, 3 not found,
4 conflict (the rule changed since it was read, or already exists),
5 rejected (check: the enforcer answered and did not allow the request).
`

// envText is in every command's help.
const envText = `Every flag also reads the environment variable APPORTION_<FLAG> in upper
snake case (--etcd-endpoints: APPORTION_ETCD_ENDPOINTS, -o: APPORTION_OUTPUT,
--agents: APPORTION_AGENTS); a flag on the command line wins.
`

// usageError is a command-line mistake (exit code 2).
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

// errRejected: check got an answer, and it did not allow the request.
var errRejected = errors.New("rejected")

func exitCode(err error) int {
	var ue *usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue):
		return exitUsage
	case errors.Is(err, etcdstore.ErrNotFound):
		return exitNotFound
	case errors.Is(err, etcdstore.ErrConflict):
		return exitConflict
	case errors.Is(err, errRejected):
		return exitRejected
	}
	return exitFailure
}

// globals holds the flags every command accepts.
type globals struct {
	etcd     backend.Etcd // --etcd-endpoints, --etcd-prefix, credentials and TLS
	adminURL string
	token    string
	output   string
	timeout  time.Duration
	// registryPrefix is the sync agents' --registry-prefix: with
	// --etcd-endpoints, a global rule's put is checked against the split
	// registered there (etcdstore.WithRegistryPrefix).
	registryPrefix string
	// Client TLS for the admin API (https://) and check's gRPC (--tls):
	// the CA that signs the server's certificate, and this client's own
	// certificate and key for servers that require mutual TLS.
	tlsCA, tlsCert, tlsKey string
}

// clientTLS is the TLS configuration of --tls-ca, --tls-cert and --tls-key.
func (g *globals) clientTLS() (*tls.Config, error) {
	tc, err := tlsconfig.Client(g.tlsCA, g.tlsCert, g.tlsKey)
	if err != nil {
		return nil, fmt.Errorf("--tls-ca/--tls-cert/--tls-key: %w", err)
	}
	return tc, nil
}

// cli is the state of one invocation.
type cli struct {
	g      globals
	stdout io.Writer
	stderr io.Writer
	cancel context.CancelFunc // of the --timeout context, set by prepare
	// fromEnv holds the flags prepare set from their APPORTION_* variable.
	fromEnv map[string]bool
}

// flagSource says where flag name's value came from, for messages:
// "--name" (the command line) or "--name (from APPORTION_NAME in the
// environment)".
func (c *cli) flagSource(name string) string {
	if c.fromEnv[name] {
		return fmt.Sprintf("--%s (from %s in the environment)", name, flagenv.Name(name))
	}
	return "--" + name
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := &cli{stdout: stdout, stderr: stderr}
	root := c.rootCmd()
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if c.cancel != nil {
		c.cancel()
	}
	return err
}

// rootCmd builds the command tree. A command group lives in its own file
// as a method returning its *cobra.Command, and is added here.
func (c *cli) rootCmd() *cobra.Command {
	root := c.group(&cobra.Command{
		Use:   "rlctl",
		Short: "Operate apportion rules and global limits",
		Long: `rlctl reads and writes apportion's rate-limit rules, in etcd directly
(--etcd-endpoints) or through an enforcer's admin API (--admin-url, --token),
shows and sets global limits with each region's live share, and sends a
CheckLimit to an enforcer.`,
		Example: `  rlctl --etcd-endpoints http://127.0.0.1:2379 rules put -f rule.json
  rlctl --admin-url http://127.0.0.1:9090 --token "$TOKEN" rules list -o yaml
  rlctl limits show user-global --agents http://127.0.0.1:9091 --top 5
  rlctl check --addr 127.0.0.1:8081 --client-key user:42 --resource "POST /orders"
  source <(rlctl completion bash)`,
		Version:           version.String(),
		SilenceErrors:     true,
		SilenceUsage:      true,
		PersistentPreRunE: c.prepare,
	})
	root.SetVersionTemplate(version.Line("rlctl") + "\n")
	// A group runs only to report a missing or unknown command: its usage
	// shows "rlctl rules [command]", not a bare "rlctl rules".
	tmpl := strings.Replace(root.UsageTemplate(), "Usage:{{if .Runnable}}", "Usage:{{if and .Runnable (not .HasAvailableSubCommands)}}", 1)
	root.SetUsageTemplate(tmpl + "\n" + envText + "\n" + exitCodesText)
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		return usagef("%v\nRun '%s --help' for usage.", err, cmd.CommandPath())
	})
	c.registerGlobals(root.PersistentFlags())
	root.RegisterFlagCompletionFunc("output", cobra.FixedCompletions([]string{"table", "json", "yaml"}, cobra.ShellCompDirectiveNoFileComp))
	root.SetOut(c.stdout) // help and completion scripts
	root.SetErr(c.stderr)
	root.AddCommand(c.rulesCmd(), c.limitsCmd(), c.checkCmd(), c.importCmd(), c.versionCmd())
	c.strictBuiltins(root)
	return root
}

// strictBuiltins makes cobra's own help and completion commands fail like
// the others on an unknown topic or shell (exit 2, with suggestions),
// where cobra would print the usage and exit 0. The completion scripts go
// to the output set on root before.
func (c *cli) strictBuiltins(root *cobra.Command) {
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	for _, sub := range root.Commands() {
		switch sub.Name() {
		case "help":
			show := sub.Run
			sub.Run = nil
			sub.RunE = func(cmd *cobra.Command, args []string) error {
				if target, rest, err := cmd.Root().Find(args); err == nil && len(rest) > 0 {
					return unknownCommand(target, rest[0])
				}
				show(cmd, args)
				return nil
			}
		case "completion":
			c.group(sub)
		}
	}
}

// registerGlobals defines the flags every command accepts. The etcd flags
// are internal/backend's, the same as ratelimitd's and syncagent's.
func (c *cli) registerGlobals(pfs *pflag.FlagSet) {
	g := &c.g
	gfs := flag.NewFlagSet("rlctl", flag.ContinueOnError)
	g.etcd.Register(gfs, "comma-separated etcd client URLs (talk to etcd directly); https:// uses TLS")
	pfs.AddGoFlagSet(gfs)
	// --prefix was rlctl's name of --etcd-prefix: still accepted, same value.
	pfs.StringVar(&g.etcd.Prefix, "prefix", g.etcd.Prefix, "deprecated: use --etcd-prefix")
	pfs.MarkHidden("prefix")
	pfs.StringVar(&g.adminURL, "admin-url", "", "admin API base URL (talk through the admin API)")
	pfs.StringVar(&g.token, "token", "", "admin API bearer token (prefer APPORTION_TOKEN)")
	pfs.StringVar(&g.registryPrefix, "registry-prefix", etcdstore.DefaultRegistryPrefix, "with --etcd-endpoints: etcd key prefix of the sync agents' registry (their --registry-prefix), against which a global rule's split is checked")
	pfs.StringVar(&g.tlsCA, "tls-ca", "", "PEM CA bundle that signs the admin API's or enforcer's certificate")
	pfs.StringVar(&g.tlsCert, "tls-cert", "", "client certificate for servers that require mutual TLS (with --tls-key)")
	pfs.StringVar(&g.tlsKey, "tls-key", "", "client key for --tls-cert")
	pfs.StringVarP(&g.output, "output", "o", "table", "output format: table, json or yaml")
	pfs.DurationVar(&g.timeout, "timeout", 10*time.Second, "per-command timeout")
}

// deprecated maps a deprecated flag to the flag it stands for; the two
// share one value.
var deprecated = map[string]string{"prefix": "etcd-prefix"}

// prepare runs before every command: it reads the flags the command line
// did not set from the environment, checks -o, and starts --timeout.
func (c *cli) prepare(cmd *cobra.Command, args []string) error {
	set, err := applyEnv(cmd.Flags(), os.LookupEnv)
	if err != nil {
		return err
	}
	c.fromEnv = set
	for old, cur := range deprecated {
		if f := cmd.Flags().Lookup(old); f != nil && f.Changed {
			fmt.Fprintf(c.stderr, "rlctl: --%s (%s) is deprecated, use --%s (%s)\n", old, flagenv.Name(old), cur, flagenv.Name(cur))
		}
	}
	switch c.g.output {
	case "table", "json", "yaml":
	default:
		return usagef("-o must be table, json or yaml, got %q", c.g.output)
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), c.g.timeout)
	c.cancel = cancel
	cmd.SetContext(ctx)
	return nil
}

// applyEnv sets every flag of fs that the command line did not set from
// its APPORTION_* variable, and returns the names of those it set. A
// deprecated flag and the flag it stands for count as one: once either is
// set, the other's variable is not read.
func applyEnv(fs *pflag.FlagSet, lookup func(string) (string, bool)) (map[string]bool, error) {
	partner := map[string]string{}
	for old, cur := range deprecated {
		partner[old], partner[cur] = cur, old
	}
	set := map[string]bool{}
	var err error
	fs.VisitAll(func(f *pflag.Flag) {
		if err != nil || f.Changed || f.Name == "help" || f.Name == "version" {
			return
		}
		if p := fs.Lookup(partner[f.Name]); p != nil && p.Changed {
			return
		}
		v, ok := lookup(flagenv.Name(f.Name))
		if !ok {
			return
		}
		if e := fs.Set(f.Name, v); e != nil {
			err = usagef("invalid value %q for %s (flag --%s): %v", v, flagenv.Name(f.Name), f.Name, e)
			return
		}
		set[f.Name] = true
	})
	return set, err
}

// group makes cmd a holder of subcommands: without one it prints its usage
// and fails (exit 2); an unknown one fails with suggestions.
func (c *cli) group(cmd *cobra.Command) *cobra.Command {
	cmd.Args = cobra.ArbitraryArgs
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			fmt.Fprint(c.stderr, cmd.UsageString())
			return usagef("no command given: %s needs one of its commands", cmd.CommandPath())
		}
		return unknownCommand(cmd, args[0])
	}
	return cmd
}

// unknownCommand is the usage error for "cmd name" when cmd has no
// subcommand name, with the names it might mean.
func unknownCommand(cmd *cobra.Command, name string) error {
	if cmd.SuggestionsMinimumDistance <= 0 {
		cmd.SuggestionsMinimumDistance = 2
	}
	msg := fmt.Sprintf("unknown command %q for %q", name, cmd.CommandPath())
	if s := cmd.SuggestionsFor(name); len(s) > 0 {
		msg += "\n\nDid you mean this?\n\t" + strings.Join(s, "\n\t") + "\n"
	}
	return usagef("%s\nRun '%s --help' for usage.", msg, cmd.CommandPath())
}

// exactArgs accepts exactly n positional arguments, described by what in
// the error.
func exactArgs(n int, what string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return usagef("want %s, got %d argument(s): %q", what, len(args), args)
		}
		return nil
	}
}

func (c *cli) versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print rlctl's version (same as --version)",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return version.Print(c.stdout, "rlctl")
		},
	}
}
