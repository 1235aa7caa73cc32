// Command rlctl is the operator CLI for apportion rules and limits: it reads
// and writes rules in etcd directly (--etcd-endpoints) or through the admin
// API (--admin-url, --token), validates rule files offline, flips shadow
// mode, sets global limits, shows each region's live share of a global
// limit from its sync agent (limits show --agents), and sends a CheckLimit
// to an enforcer (optionally over TLS).
//
// Every write is a compare-and-swap on the rule's revision when rlctl read
// the rule first (shadow, limits set), so two operators never silently
// overwrite each other: the loser gets exit code 4. A check the enforcer
// rejects exits 5, so scripts can tell it from a failure (1).
//
// The commands are built with cobra: one file per command group (rules.go,
// limits.go, check.go), added to the root in root.go. Help (rlctl help,
// --help on every command), shell completion (rlctl completion bash|zsh|fish)
// and "did you mean" suggestions come with it.
package main

import (
	"github.com/apportion/apportion/internal/command"
)

func main() { command.Main("rlctl", run, exitCode) }
