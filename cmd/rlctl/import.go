package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/envoyconfig"
	"github.com/spf13/cobra"
	"go.yaml.in/yaml/v3"
)

// importEnvoy converts envoyproxy/ratelimit configuration files (one domain
// each) into one rule list and writes it to out: YAML, or JSON when asJSON.
// A file that does not convert, or two files with the same rule ids (the
// same domain twice), is an error naming the file; nothing is written then.
func importEnvoy(files []string, asJSON bool, out io.Writer, opts ...envoyconfig.Option) error {
	if len(files) == 0 {
		return usagef("give one or more envoyproxy/ratelimit configuration files")
	}
	var all []rules.Rule
	from := map[string]string{} // rule id -> file
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		rs, err := envoyconfig.Convert(data, opts...)
		if err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		for _, r := range rs {
			if prev, dup := from[r.ID]; dup {
				return fmt.Errorf("%s: rule %q also comes from %s: a domain may be in one file only", f, r.ID, prev)
			}
			from[r.ID] = f
		}
		all = append(all, rs...)
	}
	if _, err := rules.NewIndex(all); err != nil {
		return err
	}
	docs := make([]json.RawMessage, len(all))
	for i, r := range all {
		b, err := rules.MarshalRule(r)
		if err != nil {
			return err
		}
		docs[i] = b
	}
	if asJSON {
		b, err := json.MarshalIndent(docs, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(out, "%s\n", b)
		return err
	}
	list := &yaml.Node{Kind: yaml.SequenceNode}
	for _, d := range docs {
		n, err := orderedYAML(d)
		if err != nil {
			return err
		}
		list.Content = append(list.Content, n)
	}
	var buf bytes.Buffer
	fmt.Fprintf(&buf, "# %d rules imported by rlctl import envoy from %s\n", len(all), strings.Join(files, ", "))
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(list); err != nil {
		return err
	}
	enc.Close()
	_, err := out.Write(buf.Bytes())
	return err
}

// importEnvoyTo runs importEnvoy into the file path (written only when the
// import succeeds), or to stdout when path is "".
func importEnvoyTo(files []string, asJSON bool, path string, stdout io.Writer, opts ...envoyconfig.Option) error {
	if path == "" {
		return importEnvoy(files, asJSON, stdout, opts...)
	}
	var buf bytes.Buffer
	if err := importEnvoy(files, asJSON, &buf, opts...); err != nil {
		return err
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		return err
	}
	_, err := fmt.Fprintf(stdout, "wrote %s\n", path)
	return err
}

// orderedYAML turns a JSON object into a YAML node keeping the fields'
// order (a rule's canonical order: id, match, key, algorithm, ...).
func orderedYAML(js []byte) (*yaml.Node, error) {
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber()
	return yamlValue(dec)
}

func yamlValue(dec *json.Decoder) (*yaml.Node, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch v := tok.(type) {
	case json.Delim:
		n := &yaml.Node{Kind: yaml.MappingNode}
		end := json.Delim('}')
		if v == '[' {
			n.Kind, end = yaml.SequenceNode, ']'
			n.Style = yaml.FlowStyle
		}
		for dec.More() {
			if n.Kind == yaml.MappingNode {
				k, err := dec.Token()
				if err != nil {
					return nil, err
				}
				n.Content = append(n.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: k.(string)})
			}
			c, err := yamlValue(dec)
			if err != nil {
				return nil, err
			}
			n.Content = append(n.Content, c)
		}
		if t, err := dec.Token(); err != nil || t != end {
			return nil, fmt.Errorf("rlctl: malformed JSON")
		}
		return n, nil
	case string:
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: v}, nil
	case json.Number:
		tag := "!!int"
		if strings.ContainsAny(v.String(), ".eE") {
			tag = "!!float"
		}
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: tag, Value: v.String()}, nil
	case bool:
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!bool", Value: fmt.Sprint(v)}, nil
	}
	return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!null", Value: "null"}, nil
}

// importCmd is the import group: envoy.
func (c *cli) importCmd() *cobra.Command {
	cmd := c.group(&cobra.Command{
		Use:   "import",
		Short: "Convert another rate limiter's configuration into rules",
		Long: `Convert the configuration of another rate limiter into apportion rules, to
review and then store with "rules put -f" (or load with ratelimitd --rules).`,
	})
	cmd.AddCommand(c.importEnvoyCmd())
	return cmd
}

// importEnvoyCmd is "rlctl import envoy FILE...": it prints the rules as
// YAML (-o json: JSON), or writes them to --write.
func (c *cli) importEnvoyCmd() *cobra.Command {
	var (
		write          string
		ignoreMetadata bool
	)
	cmd := &cobra.Command{
		Use:   "envoy FILE...",
		Short: "Convert envoyproxy/ratelimit configuration files into rules",
		Long: `Convert envoyproxy/ratelimit configuration files (one domain each: domain,
nested descriptors, rate_limit units, unlimited, replaces, shadow_mode,
quota_mode, share_threshold) into rules that the enforcer's Envoy service
applies the way envoyproxy/ratelimit would. Prints YAML (-o json: JSON), or
writes -w FILE. A file envoyproxy/ratelimit refuses is refused, naming the
field and its line; nothing is written then. Offline: no etcd needed.
See docs/migrating-from-envoy-ratelimit.md.`,
		Example: `  rlctl import envoy config/ratelimit/*.yaml > rules.yaml && rlctl rules put -f rules.yaml
  rlctl import envoy --ignore-metadata -w rules.json -o json examples/ratelimit/config/example.yaml`,
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var opts []envoyconfig.Option
			if ignoreMetadata {
				opts = append(opts, envoyconfig.IgnoreMetadata())
			}
			return importEnvoyTo(args, c.g.output == "json", write, c.stdout, opts...)
		},
	}
	cmd.Flags().StringVarP(&write, "write", "w", "", "write the rules to this file instead of stdout")
	cmd.MarkFlagFilename("write", "yaml", "yml", "json")
	cmd.Flags().BoolVar(&ignoreMetadata, "ignore-metadata", false, "import descriptors that carry metadata, without it (apportion sends no dynamic metadata)")
	return cmd
}
