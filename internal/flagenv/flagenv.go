// Package flagenv lets every command-line flag also be set from the
// environment: flag "redis-addr" reads APPORTION_REDIS_ADDR. A flag given on
// the command line wins over the environment.
package flagenv

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

// Prefix is put before every variable name.
const Prefix = "APPORTION_"

// Name returns the environment variable for a flag name.
func Name(flagName string) string {
	return Prefix + strings.ToUpper(strings.NewReplacer("-", "_", ".", "_").Replace(flagName))
}

// Parse parses args into fs, then sets every flag that args did not set
// from its environment variable, if present. lookup is os.LookupEnv when nil.
func Parse(fs *flag.FlagSet, args []string, lookup func(string) (string, bool)) error {
	if lookup == nil {
		lookup = os.LookupEnv
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if err != nil || set[f.Name] {
			return
		}
		if v, ok := lookup(Name(f.Name)); ok {
			if e := fs.Set(f.Name, v); e != nil {
				err = fmt.Errorf("invalid value %q for %s (flag --%s): %v", v, Name(f.Name), f.Name, e)
			}
		}
	})
	return err
}
