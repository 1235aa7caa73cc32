package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"
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
	for _, r := range rs {
		rev, err := st.Put(cmd.Context(), r, ifMatch)
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
	if putErr != nil && len(rs) > 1 {
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
keep the last valid version they had; fix it with rules put -f, or delete
it). -o json and -o yaml print the list of rule documents, ready for
rules put -f, and name each invalid document on stderr. The exit code is 0
either way.`,
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
			fmt.Fprintf(c.stderr, "rlctl: stored document %q (revision %d) is not a valid rule, and the enforcers skip it: %s\n", d.ID, d.Revision, oneLine(d.Error))
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
	fmt.Fprintf(c.stdout, "\n%d stored document(s) are not valid rules: the enforcers skip them and keep the last valid version they had (fix with rules put -f, or delete):\n", len(bad))
	tw = c.table()
	fmt.Fprintln(tw, "ID\tREVISION\tSTATUS\tERROR")
	for _, d := range bad {
		fmt.Fprintf(tw, "%s\t%d\tinvalid\t%s\n", d.ID, d.Revision, oneLine(d.Error))
	}
	return tw.Flush()
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
names the first wrong field. rules put -f runs the same check before it
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
		// YAML: a single mapping is one rule; convert it to JSON for ParseRule.
		if j, err := yaml.YAMLToJSON(doc); err == nil && len(j) > 0 && j[0] == '{' {
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
