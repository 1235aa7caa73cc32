package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/spf13/cobra"
)

// rulesCmd is the rules group: put, get, list, delete, validate, shadow.
func (c *cli) rulesCmd() *cobra.Command {
	cmd := c.group(&cobra.Command{
		Use:     "rules",
		Aliases: []string{"rule"},
		Short:   "Store, show, delete and validate rules",
		Long: `Rules live in etcd under --etcd-prefix, one JSON document per rule, and
every enforcer watches them. A rule file holds one rule or a list, as JSON
or YAML; "rules get ID -o yaml" prints a document "rules put -f" takes back.`,
	})
	cmd.AddCommand(c.rulesPutCmd(), c.rulesGetCmd(), c.rulesListCmd(), c.rulesDeleteCmd(),
		c.rulesValidateCmd(), c.rulesShadowCmd())
	return cmd
}

// fileFlag defines -f/--file, completed with rule files.
func fileFlag(cmd *cobra.Command, file *string) {
	cmd.Flags().StringVarP(file, "file", "f", "", "rule file: one rule or a list, JSON or YAML")
	cmd.MarkFlagFilename("file", "json", "yaml", "yml")
}

func (c *cli) rulesPutCmd() *cobra.Command {
	var (
		file    string
		ifMatch int64
		create  bool
	)
	cmd := &cobra.Command{
		Use:   "put -f FILE",
		Short: "Store one rule or a list (JSON or YAML)",
		Long: `Store the rules of FILE. Every rule of FILE is checked first, offline and as
rules validate checks it: if one is refused (named with its field), nothing
is stored. With --create a rule is stored only if it does not exist yet;
with --if-match REV (above 0) only if it is still at that revision (a file
of one rule). Without either, a rule that another writer changes while it
is being checked and stored is read, checked and stored again. A rule the
store refuses (a global rule whose regions, weights or min_share differ
from those stored or registered by the sync agents for its id) is named
with its field; the rules before it in the file stay stored.`,
		Example: `  rlctl rules put -f deploy/rules.yaml
  rlctl rules get orders-free -o yaml > r.yaml && $EDITOR r.yaml && rlctl rules put -f r.yaml`,
		Args: exactArgs(0, "no arguments (the rules come from -f FILE)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.rulesPut(cmd, file, ifMatch, create)
		},
	}
	fileFlag(cmd, &file)
	cmd.Flags().Int64Var(&ifMatch, "if-match", 0, "store only if the rule is still at this revision, above 0 (single rule)")
	cmd.Flags().BoolVar(&create, "create", false, "store only if the rule does not exist yet")
	return cmd
}

// ifMatchFlag refuses an --if-match (or APPORTION_IF_MATCH) that is not a
// revision: revisions start at 1, and 0 would read as "not given".
// without says what leaving the flag out does.
func (c *cli) ifMatchFlag(cmd *cobra.Command, rev int64, without string) error {
	if !cmd.Flags().Changed("if-match") || rev > 0 {
		return nil
	}
	return usagef("%s %d: a revision is above 0 (as rules get prints it); leave --if-match out to %s", c.flagSource("if-match"), rev, without)
}

func (c *cli) rulesPut(cmd *cobra.Command, file string, ifMatch int64, create bool) error {
	if err := c.ifMatchFlag(cmd, ifMatch, "store the rules whatever revision they are at"); err != nil {
		return err
	}
	if ifMatch != 0 && create {
		return usagef("--if-match and --create are exclusive")
	}
	rs, err := loadRuleFile(file)
	if err != nil {
		return err
	}
	if ifMatch != 0 && len(rs) != 1 {
		return usagef("--if-match needs a file with exactly one rule, %s holds %d", file, len(rs))
	}
	if create {
		ifMatch = etcdstore.MustNotExist
	}
	st, closeStore, err := c.store()
	if err != nil {
		return err
	}
	defer closeStore()
	type stored struct {
		ID       string `json:"id"`
		Revision int64  `json:"revision"`
	}
	out := []stored{}
	var putErr error
	ranOut := false // --timeout ran out after etcd had answered
	start := time.Now()
	for _, r := range rs {
		rev, err := st.Put(cmd.Context(), r, ifMatch)
		if err != nil && len(out) > 0 && errors.Is(cmd.Context().Err(), context.DeadlineExceeded) {
			// --timeout bounds the whole command: etcd answered the
			// rules before this one, so the file, not etcd, took too long
			per := time.Since(start) / time.Duration(len(out))
			putErr = fmt.Errorf("%w: %d of %d rules stored when %s (%s) ran out, at %q (stored or not: its answer was cut off): etcd answered every one before it (%v a rule), the file needs longer: raise --timeout to at least %v",
				context.DeadlineExceeded, len(out), len(rs), c.flagSource("timeout"), c.g.timeout, r.ID, per.Round(time.Microsecond), (per * time.Duration(len(rs)) * 2).Round(time.Second))
			ranOut = true
			break
		}
		if err != nil {
			putErr = nameRule(r.ID, err)
			break
		}
		out = append(out, stored{r.ID, rev})
	}
	if c.structured() {
		if err := c.emit(out); err != nil {
			return err
		}
	} else if len(out) > 0 || putErr == nil {
		tw := c.table()
		fmt.Fprintln(tw, "ID\tREVISION\tSTATUS")
		for _, s := range out {
			fmt.Fprintf(tw, "%s\t%d\tstored\n", s.ID, s.Revision)
		}
		tw.Flush()
	}
	if putErr != nil && len(rs) > 1 && !ranOut {
		return fmt.Errorf("%w (stored %d of %d rules before this one)", putErr, len(out), len(rs))
	}
	return putErr
}

// nameRule prefixes err with the rule's id, unless its message already
// names the rule (the store's field and conflict errors do).
func nameRule(id string, err error) error {
	if strings.Contains(err.Error(), strconv.Quote(id)) {
		return err
	}
	return fmt.Errorf("rule %q: %w", id, err)
}

func (c *cli) rulesGetCmd() *cobra.Command {
	return &cobra.Command{
		Use:               "get ID",
		Short:             "Show a rule and its revision",
		Long:              "Show a rule. -o json and -o yaml print the rule document alone, ready for rules put -f.",
		Args:              exactArgs(1, "ID"),
		ValidArgsFunction: c.completeRuleIDs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkRuleID(args[0]); err != nil {
				return err
			}
			st, closeStore, err := c.store()
			if err != nil {
				return err
			}
			defer closeStore()
			r, rev, err := st.Get(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if c.structured() {
				return c.emit(r)
			}
			return c.ruleTable(r, rev)
		},
	}
}

// ruleTable prints one rule as field/value rows.
func (c *cli) ruleTable(r rules.Rule, rev int64) error {
	tw := c.table()
	row := func(k string, v any) { fmt.Fprintf(tw, "%s\t%v\n", k, v) }
	row("id", r.ID)
	row("revision", rev)
	row("match", formatMap(r.Match))
	row("key", strings.Join(r.Key, ","))
	row("algorithm", r.Algorithm)
	row("limit", limitText(r))
	row("scope", r.Scope)
	if r.Scope == rules.Global {
		row("regions", formatWeights(r.Regions))
		row("min_share", r.MinShare)
	}
	row("failure_mode", r.FailureMode)
	row("shadow", r.Shadow)
	if r.LocalBatch != 0 {
		row("local_batch", r.LocalBatch)
	}
	if r.Split > 1 {
		row("split", r.Split)
	}
	return tw.Flush()
}

func (c *cli) rulesListCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List all rules, and the stored documents that are not valid rules",
		Long: `List all rules, then every document stored under --etcd-prefix that is not
a valid rule (status invalid, with what is wrong: the enforcers skip it and
keep the last valid version they had), each with how to fix or remove it:
rules put -f or rules delete ID when its key names a valid rule id; rules
delete ID (put cannot write it) when its id is not a valid rule id but
rlctl can name it; else (an empty id, an id with "/") the etcdctl del
command that removes it. -o json and -o yaml print the list of rule
documents, ready for rules put -f, and name each invalid document, with
the same remedy, on stderr. The exit code is 0 either way.`,
		Args: exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			st, closeStore, err := c.store()
			if err != nil {
				return err
			}
			defer closeStore()
			rs, bad, _, err := st.ListAll(cmd.Context())
			if err != nil {
				return err
			}
			return c.printList(rs, bad)
		},
	}
}

// printList prints the rules and the invalid documents: in a table, or
// with -o json|yaml the list of rules on stdout (its shape unchanged, ready
// for rules put -f) and one line per invalid document on stderr.
func (c *cli) printList(rs []rules.Rule, bad []etcdstore.InvalidDocument) error {
	if c.structured() {
		if rs == nil {
			rs = []rules.Rule{}
		}
		for _, d := range bad {
			fmt.Fprintf(c.stderr, "rlctl: stored document %q (revision %d) is not a valid rule, and the enforcers skip it: %s; %s\n", d.ID, d.Revision, oneLine(d.Error), c.remedy(d.ID))
		}
		return c.emit(rs)
	}
	tw := c.table()
	fmt.Fprintln(tw, "ID\tALGORITHM\tLIMIT\tSCOPE\tSHADOW\tMATCH")
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\t%s\n", r.ID, r.Algorithm, limitText(r), r.Scope, r.Shadow, formatMap(r.Match))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(bad) == 0 {
		return nil
	}
	fmt.Fprintf(c.stdout, "\n%d stored document(s) are not valid rules: the enforcers skip them and keep the last valid version they had (FIX says how to fix or remove each):\n", len(bad))
	tw = c.table()
	fmt.Fprintln(tw, "ID\tREVISION\tSTATUS\tERROR\tFIX")
	for _, d := range bad {
		id := d.ID
		if id == "" || strings.IndexFunc(id, func(r rune) bool { return unicode.IsSpace(r) || !unicode.IsGraphic(r) }) >= 0 {
			id = strconv.Quote(id) // an empty id, blanks and control characters visible
		}
		fmt.Fprintf(tw, "%s\t%d\tinvalid\t%s\t%s\n", id, d.Revision, oneLine(d.Error), c.remedy(d.ID))
	}
	return tw.Flush()
}

// remedy says how to fix or remove the invalid document stored under id
// (its key without the prefix): with rlctl when rlctl can name it, else
// with etcdctl and its full key. The store refuses an id that is empty or
// holds "/" (or NUL) in every command; put also one that is not a valid
// rule id, which delete still takes.
func (c *cli) remedy(id string) string {
	switch {
	case checkRuleID(id) == nil:
		return "fix it with rules put -f, or remove it with rules delete " + id
	case id != "" && !strings.ContainsAny(id, "/\x00"):
		return "not a valid rule id, so rules put cannot fix it: remove it with rules delete " + shellQuote(id)
	}
	key := c.g.etcd.Prefix + id
	msg := "rlctl cannot name this key (an empty id, or one with \"/\"): remove it with etcdctl del " + shellQuote(key)
	if c.g.etcd.Endpoints == "" {
		msg += fmt.Sprintf(" (the key under %s; through --admin-url, use the enforcer's --etcd-prefix if it is another)", c.flagSource("etcd-prefix"))
	}
	return msg
}

// shellQuote quotes s for a POSIX shell: in single quotes, or when it
// holds control characters in bash's $'...' with escapes.
func shellQuote(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f }) < 0 {
		return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
	}
	var b strings.Builder
	b.WriteString("$'")
	for i := 0; i < len(s); i++ {
		switch ch := s[i]; {
		case ch == '\'' || ch == '\\':
			b.WriteByte('\\')
			b.WriteByte(ch)
		case ch < 0x20 || ch == 0x7f:
			fmt.Fprintf(&b, "\\x%02x", ch)
		default:
			b.WriteByte(ch)
		}
	}
	b.WriteByte('\'')
	return b.String()
}

// checkRuleID refuses, as a usage error naming it and what is wrong, an id
// that no rule can have: the rule of a rule's id that the store applies on
// every put (rules.Rule.Validate: 1 to 128 of the ASCII letters, digits,
// '_', '.' and '-', not dots alone).
func checkRuleID(id string) error {
	r := rules.Rule{ID: id}
	var fe *rules.FieldError
	if err := r.Validate(); !errors.As(err, &fe) || fe.Field != "id" {
		return nil // the id is fine (the empty rule is wrong elsewhere)
	}
	msg := fe.Msg
	if !strings.Contains(msg, "use only") {
		msg += fmt.Sprintf("; a rule id is 1 to %d of the ASCII letters, digits, '_', '.' and '-'", rules.MaxIDLen)
	}
	if strings.HasPrefix(msg, strconv.Quote(id)) {
		return usagef("invalid rule id: %s", msg) // the message names it
	}
	return usagef("invalid rule id %q: %s", id, msg)
}

// oneLine keeps a message on one table row.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

func (c *cli) rulesDeleteCmd() *cobra.Command {
	var ifMatch int64
	cmd := &cobra.Command{
		Use:               "delete ID",
		Aliases:           []string{"rm"},
		Short:             "Delete a rule",
		Args:              exactArgs(1, "ID"),
		ValidArgsFunction: c.completeRuleIDs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := c.ifMatchFlag(cmd, ifMatch, "delete the rule whatever revision it is at"); err != nil {
				return err
			}
			st, closeStore, err := c.store()
			if err != nil {
				return err
			}
			defer closeStore()
			if err := st.Delete(cmd.Context(), args[0], ifMatch); err != nil {
				if idErr := checkRuleID(args[0]); idErr != nil && errors.Is(err, etcdstore.ErrNotFound) {
					// Nothing stored under an id no rule can have: say why.
					return usagef("%v (and nothing is stored under it)", idErr)
				}
				return err
			}
			if c.structured() {
				return c.emit(map[string]any{"id": args[0], "deleted": true})
			}
			_, err = fmt.Fprintf(c.stdout, "deleted %s\n", args[0])
			return err
		},
	}
	cmd.Flags().Int64Var(&ifMatch, "if-match", 0, "delete only if the rule is still at this revision (above 0)")
	return cmd
}

func (c *cli) rulesValidateCmd() *cobra.Command {
	var file string
	cmd := &cobra.Command{
		Use:   "validate -f FILE",
		Short: "Validate a rule file offline (no etcd)",
		Long: `Check every rule of FILE as the store would, without talking to etcd: exit 1
names the first wrong field. A YAML file is one document (a second one
after "---" is refused, not dropped) and no key may be given twice, as in
JSON. rules put -f runs the same check before it
stores anything. What needs the store is not checked here: a global rule's
split against the one stored or registered for its id.`,
		Args: exactArgs(0, "no arguments (the rules come from -f FILE)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			rs, err := loadRuleFile(file)
			if err != nil {
				return err
			}
			ids := make([]string, len(rs))
			for i, r := range rs {
				ids[i] = r.ID
			}
			if c.structured() {
				return c.emit(map[string]any{"valid": true, "rules": ids})
			}
			_, err = fmt.Fprintf(c.stdout, "ok: %d valid rule(s): %s\n", len(rs), strings.Join(ids, ", "))
			return err
		},
	}
	fileFlag(cmd, &file)
	return cmd
}

func (c *cli) rulesShadowCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "shadow ID on|off",
		Short: "Flip shadow mode (compare-and-swap)",
		Long: `Turn shadow mode on (the rule is evaluated and counted, never rejects) or
off. The rule is read and written back at its revision: a concurrent
change makes this fail with exit code 4, nothing overwritten.`,
		Args: exactArgs(2, "ID on|off"),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
			if len(args) == 1 {
				return []string{"on", "off"}, cobra.ShellCompDirectiveNoFileComp
			}
			return c.completeRuleIDs(cmd, args, toComplete)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			var on bool
			switch args[1] {
			case "on":
				on = true
			case "off":
			default:
				return usagef("shadow mode is on or off, got %q", args[1])
			}
			if err := checkRuleID(args[0]); err != nil {
				return err
			}
			st, closeStore, err := c.store()
			if err != nil {
				return err
			}
			defer closeStore()
			r, rev, err := st.Get(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			changed := r.Shadow != on
			if changed {
				r.Shadow = on
				if rev, err = st.Put(cmd.Context(), r, rev); err != nil {
					return err
				}
			}
			if c.structured() {
				return c.emit(map[string]any{"id": r.ID, "shadow": on, "revision": rev, "changed": changed})
			}
			state := "set"
			if !changed {
				state = "already"
			}
			_, err = fmt.Fprintf(c.stdout, "rule %s: shadow %s %s (revision %d)\n", r.ID, state, args[1], rev)
			return err
		},
	}
}

// loadRuleFile reads FILE and checks every rule of it offline as the store
// checks a put (each rule parsed strictly and validated, and
// rules.Rule.CheckFloors): rules validate is this check, and rules put runs
// it on the whole file before it stores anything.
func loadRuleFile(path string) ([]rules.Rule, error) {
	rs, err := parseRuleFile(path)
	if err != nil {
		return nil, err
	}
	for i, r := range rs {
		if err := r.CheckFloors(); err != nil {
			var fe *rules.FieldError
			if len(rs) > 1 && errors.As(err, &fe) {
				fe.Item = i + 1
			}
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	return rs, nil
}

// parseRuleFile reads one rule document or a list (JSON, or YAML).
func parseRuleFile(path string) ([]rules.Rule, error) {
	if path == "" {
		return nil, usagef("-f FILE is required")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	doc := bytes.TrimSpace(data)
	if len(doc) > 0 && doc[0] != '{' && doc[0] != '[' {
		// YAML: converted with the checks rules.ParseRules makes of a list
		// (one document only, no repeated key), then a single mapping is one
		// rule for ParseRule, as JSON.
		j, err := rules.YAMLToJSON(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if j = bytes.TrimSpace(j); len(j) > 0 && j[0] == '{' {
			doc = j
		}
	}
	if len(doc) > 0 && doc[0] == '{' && !hasKey(doc, "rules") {
		r, err := rules.ParseRule(doc)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return []rules.Rule{r}, nil
	}
	rs, err := rules.ParseRules(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return rs, nil
}

func hasKey(doc []byte, key string) bool {
	var m map[string]json.RawMessage
	if json.Unmarshal(doc, &m) != nil {
		return false
	}
	_, ok := m[key]
	return ok
}
