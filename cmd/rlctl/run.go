package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/admin"
	"github.com/apportion/apportion/rules/etcdstore"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Exit codes.
const (
	exitOK       = 0
	exitFailure  = 1 // failure, or an invalid rule
	exitUsage    = 2
	exitNotFound = 3
	exitConflict = 4
)

const usageText = `usage: rlctl [global flags] COMMAND [flags] [args]

Commands:
  rules put -f FILE [--if-match REV | --create]   store one rule or a list (JSON or YAML)
  rules get ID                                     show a rule and its revision
  rules list                                       list all rules
  rules delete ID [--if-match REV]                 delete a rule
  rules validate -f FILE                           validate a rule file offline (no etcd)
  rules shadow ID on|off                           flip shadow mode (compare-and-swap)
  limits show ID [--agents URLS] [--top N]         global limit, static share per region and, with
                                                   --agents, each region's live share from its sync agent
  limits set ID [--rate N] [--burst N] [--if-match REV]
                                                   set a token-bucket rule's refill_per_second/capacity
  check --addr GRPC_ADDR --client-key K --resource R [--cost N] [--attr k=v ...]
        [--tls] [--tls-ca FILE]                    call RateLimiter/CheckLimit on an enforcer

Global flags (also accepted after the command):
  --etcd-endpoints URLS   comma-separated etcd client URLs (talk to etcd directly)
  --prefix PREFIX         etcd key prefix of the rules (default /ratelimit/rules/)
  --etcd-username NAME    etcd user (secured etcd; with --etcd-password)
  --etcd-password PASS    etcd password (prefer APPORTION_ETCD_PASSWORD)
  --etcd-ca FILE          PEM CA bundle that signs etcd's server certificate
                          (default: the system roots; https:// endpoints use TLS)
  --etcd-cert FILE        PEM client certificate for etcd (with --etcd-key)
  --etcd-key FILE         PEM private key of --etcd-cert
  --admin-url URL         admin API base URL (talk through the admin API)
  --token TOKEN           admin API bearer token
  -o, --output FORMAT     table (default) or json
  --timeout DURATION      per-command timeout (default 10s)

limits show flags:
  --agents URLS           comma-separated sync agent HTTP addresses, one per region:
                          [REGION=]URL (http://host:9091, or host:9091); the region
                          named is checked against the agent's answer, and names an
                          agent that does not answer
  --top N                 also list each region's N keys with the largest live share

check flags:
  --tls                   connect to the enforcer over TLS (system roots)
  --tls-ca FILE           PEM CA bundle that signs the enforcer's certificate (implies --tls)

Every flag also reads the environment variable APPORTION_<FLAG> in upper
snake case (--etcd-endpoints: APPORTION_ETCD_ENDPOINTS, -o: APPORTION_OUTPUT,
--agents: APPORTION_AGENTS); a flag on the command line wins.

Exit codes: 0 ok, 1 failure or invalid rule, 2 usage error, 3 not found,
4 conflict (the rule changed since it was read, or already exists).
limits show --agents exits 0 when at least one agent answers (the others
are shown as unreachable, unavailable or not-coordinated), 1 when none does.
`

// usageError is a command-line mistake (exit code 2).
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

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
	}
	return exitFailure
}

// globals holds the flags every command accepts.
type globals struct {
	etcdEndpoints string
	prefix        string
	adminURL      string
	token         string
	etcdUsername  string
	etcdPassword  string
	etcdCA        string
	etcdCert      string
	etcdKey       string
	output        string
	timeout       time.Duration
}

// register adds the global flags to fs, with the current values as defaults.
func (g *globals) register(fs *flag.FlagSet) {
	fs.StringVar(&g.etcdEndpoints, "etcd-endpoints", g.etcdEndpoints, "comma-separated etcd client URLs")
	fs.StringVar(&g.prefix, "prefix", g.prefix, "etcd key prefix of the rules")
	fs.StringVar(&g.etcdUsername, "etcd-username", g.etcdUsername, "etcd user name (secured etcd)")
	fs.StringVar(&g.etcdPassword, "etcd-password", g.etcdPassword, "etcd password (prefer APPORTION_ETCD_PASSWORD)")
	fs.StringVar(&g.etcdCA, "etcd-ca", g.etcdCA, "PEM CA bundle for etcd's server certificate (default: system roots)")
	fs.StringVar(&g.etcdCert, "etcd-cert", g.etcdCert, "PEM client certificate for etcd (with --etcd-key)")
	fs.StringVar(&g.etcdKey, "etcd-key", g.etcdKey, "PEM private key of --etcd-cert")
	fs.StringVar(&g.adminURL, "admin-url", g.adminURL, "admin API base URL")
	fs.StringVar(&g.token, "token", g.token, "admin API bearer token")
	fs.StringVar(&g.output, "output", g.output, "output format: table or json (short: -o)")
	fs.DurationVar(&g.timeout, "timeout", g.timeout, "per-command timeout")
}

// ruleStore is what rlctl needs from a rule backend: *etcdstore.Store (etcd
// directly) and *admin.Client (the admin API) both provide it, with the same
// errors.
type ruleStore interface {
	Get(ctx context.Context, id string) (rules.Rule, int64, error)
	List(ctx context.Context) ([]rules.Rule, int64, error)
	Put(ctx context.Context, r rules.Rule, ifMatch int64) (int64, error)
	Delete(ctx context.Context, id string, ifMatch int64) error
}

// store opens the backend chosen by the global flags; close releases it.
func (g *globals) store() (st ruleStore, close func(), err error) {
	switch {
	case g.etcdEndpoints != "" && g.adminURL != "":
		return nil, nil, usagef("give --etcd-endpoints or --admin-url, not both")
	case g.adminURL != "":
		c, err := admin.NewClient(g.adminURL, g.token, nil)
		if err != nil {
			return nil, nil, usagef("%v", err)
		}
		return c, func() {}, nil
	case g.etcdEndpoints != "":
		cfg, err := g.etcdConfig()
		if err != nil {
			return nil, nil, err
		}
		c, err := clientv3.New(cfg)
		if err != nil {
			return nil, nil, fmt.Errorf("etcd: %w", err)
		}
		s, err := etcdstore.New(c, etcdstore.WithPrefix(g.prefix))
		if err != nil {
			c.Close()
			return nil, nil, usagef("%v", err)
		}
		return s, func() { c.Close() }, nil
	}
	return nil, nil, usagef("no rule store: give --etcd-endpoints URLS or --admin-url URL (or APPORTION_ETCD_ENDPOINTS / APPORTION_ADMIN_URL)")
}

// etcdConfig returns the etcd client configuration of the global flags:
// endpoints, credentials and TLS.
func (g *globals) etcdConfig() (clientv3.Config, error) {
	cfg := clientv3.Config{
		Username:    g.etcdUsername,
		Password:    g.etcdPassword,
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	}
	for _, ep := range strings.Split(g.etcdEndpoints, ",") {
		if ep = strings.TrimSpace(ep); ep != "" {
			cfg.Endpoints = append(cfg.Endpoints, ep)
		}
	}
	if g.etcdPassword != "" && g.etcdUsername == "" {
		return cfg, usagef("--etcd-password needs --etcd-username")
	}
	if g.etcdCA == "" && g.etcdCert == "" && g.etcdKey == "" {
		return cfg, nil // https:// endpoints still use TLS, with the system roots
	}
	for _, ep := range cfg.Endpoints {
		if strings.HasPrefix(ep, "http://") {
			return cfg, usagef("--etcd-ca, --etcd-cert and --etcd-key need https:// endpoints, got %s", ep)
		}
	}
	tc, err := tlsConfig(g.etcdCA, g.etcdCert, g.etcdKey, "--etcd-")
	if err != nil {
		return cfg, err
	}
	cfg.TLS = tc
	return cfg, nil
}

// tlsConfig returns a client TLS configuration that trusts the PEM CA
// bundle in ca (the system roots when empty) and presents the certificate
// in cert and key (none when both are empty). flagPrefix names the flags
// in errors.
func tlsConfig(ca, cert, key, flagPrefix string) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if ca != "" {
		pem, err := os.ReadFile(ca)
		if err != nil {
			return nil, fmt.Errorf("%sca: %w", flagPrefix, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%sca: no PEM certificate in %s", flagPrefix, ca)
		}
		tc.RootCAs = pool
	}
	if (cert == "") != (key == "") {
		return nil, usagef("give %scert and %skey together", flagPrefix, flagPrefix)
	}
	if cert != "" {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			return nil, fmt.Errorf("%scert/%skey: %w", flagPrefix, flagPrefix, err)
		}
		tc.Certificates = []tls.Certificate{pair}
	}
	return tc, nil
}

// command is one leaf command: it registers its flags, then runs with the
// remaining positional arguments.
type command struct {
	args  string // positional arguments, for the usage line
	flags func(fs *flag.FlagSet)
	run   func(c *cli, ctx context.Context, args []string) error
}

// cli is the state of one invocation.
type cli struct {
	g      globals
	stdout io.Writer
	stderr io.Writer
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := &cli{stdout: stdout, stderr: stderr,
		g: globals{prefix: etcdstore.DefaultPrefix, output: "table", timeout: 10 * time.Second}}

	gfs := flag.NewFlagSet("rlctl", flag.ContinueOnError)
	gfs.SetOutput(stderr)
	gfs.Usage = func() { fmt.Fprint(stderr, usageText) }
	c.g.register(gfs)
	args = canonicalFlags(args)
	if err := flagenv.Parse(gfs, args, nil); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return usagef("%v", err)
	}
	rest := gfs.Args()
	if len(rest) == 0 {
		fmt.Fprint(stderr, usageText)
		return usagef("no command given")
	}

	cmds := commands()
	name := rest[0]
	rest = rest[1:]
	if _, ok := cmds[name]; !ok {
		if len(rest) == 0 {
			fmt.Fprint(stderr, usageText)
			return usagef("unknown command %q", name)
		}
		name += " " + rest[0]
		rest = rest[1:]
	}
	cmd, ok := cmds[name]
	if !ok {
		fmt.Fprint(stderr, usageText)
		return usagef("unknown command %q", name)
	}

	fs := flag.NewFlagSet("rlctl "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: rlctl %s [flags] %s\n\nFlags:\n", name, cmd.args)
		fs.PrintDefaults()
		fmt.Fprint(stderr, "\nExit codes: 0 ok, 1 failure or invalid rule, 2 usage error, 3 not found, 4 conflict.\n")
	}
	global := map[string]bool{}
	c.g.register(fs)
	fs.VisitAll(func(f *flag.Flag) { global[flagenv.Name(f.Name)] = true })
	if cmd.flags != nil {
		cmd.flags(fs)
	}
	// The global flags already read the environment; only command flags do here.
	lookup := func(k string) (string, bool) {
		if global[k] {
			return "", false
		}
		return os.LookupEnv(k)
	}
	if err := flagenv.Parse(fs, interspersed(fs, rest), lookup); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return usagef("%v", err)
	}
	if c.g.output != "table" && c.g.output != "json" {
		return usagef("-o must be table or json, got %q", c.g.output)
	}
	ctx, cancel := context.WithTimeout(ctx, c.g.timeout)
	defer cancel()
	return cmd.run(c, ctx, fs.Args())
}

// shortFlags maps short flag names to the one flag they stand for, so each
// flag has a single name (and a single environment variable).
var shortFlags = map[string]string{"o": "output", "f": "file"}

// canonicalFlags rewrites short flags (-o json, -f=x) to their long names.
func canonicalFlags(args []string) []string {
	out := make([]string, 0, len(args))
	for i, a := range args {
		if a == "--" {
			return append(out, args[i:]...)
		}
		if len(a) > 1 && a[0] == '-' {
			name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
			if long, ok := shortFlags[name]; ok {
				a = "--" + long
				if hasVal {
					a += "=" + val
				}
			}
		}
		out = append(out, a)
	}
	return out
}

// interspersed moves flags before positional arguments, so that
// "rules get ID -o json" parses like "rules get -o json ID".
func interspersed(fs *flag.FlagSet, args []string) []string {
	var flags, pos []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			pos = append(pos, args[i+1:]...)
			break
		}
		if len(a) < 2 || a[0] != '-' {
			pos = append(pos, a)
			continue
		}
		flags = append(flags, a)
		name := strings.TrimLeft(a, "-")
		if strings.Contains(name, "=") {
			continue
		}
		f := fs.Lookup(name)
		if f == nil {
			continue // let Parse report it
		}
		if bf, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && bf.IsBoolFlag() {
			continue
		}
		if i+1 < len(args) {
			i++
			flags = append(flags, args[i])
		}
	}
	return append(append(flags, "--"), pos...)
}

func wantArgs(args []string, n int, what string) error {
	if len(args) != n {
		return usagef("want %s, got %d argument(s): %q", what, len(args), args)
	}
	return nil
}
