package main

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/apportion/apportion/rules"
	"sigs.k8s.io/yaml"
)

// structured reports whether -o asks for json or yaml rather than a table.
func (c *cli) structured() bool { return c.g.output == "json" || c.g.output == "yaml" }

// emit writes v as -o asks: indented JSON, or YAML with the same field
// names (a rule emitted as YAML can be put back with rules put -f).
func (c *cli) emit(v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return c.emitJSON(b)
}

// emitJSON writes an encoded JSON document as -o asks.
func (c *cli) emitJSON(b []byte) error {
	if c.g.output == "yaml" {
		y, err := yaml.JSONToYAML(b)
		if err != nil {
			return err
		}
		_, err = c.stdout.Write(y)
		return err
	}
	_, err := fmt.Fprintf(c.stdout, "%s\n", b)
	return err
}

func (c *cli) table() *tabwriter.Writer {
	return tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
}

// limitText is a short human form of a rule's limit.
func limitText(r rules.Rule) string {
	switch r.Algorithm {
	case rules.TokenBucket, rules.LeakyBucket:
		return fmt.Sprintf("%s/s burst %d", num(r.RefillPerSecond), r.Capacity)
	default:
		return fmt.Sprintf("%d per %s", r.Limit, r.Window)
	}
}

func num(f float64) string { return strconv.FormatFloat(f, 'g', 6, 64) }

func formatMap(m map[string]string) string {
	if len(m) == 0 {
		return "*"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, k+"="+m[k])
	}
	return strings.Join(parts, ",")
}

func formatWeights(m map[string]float64) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, k+"="+num(m[k]))
	}
	return strings.Join(parts, ",")
}
