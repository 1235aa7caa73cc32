// Command rlsim runs the simulations of simulations/: a scenario in virtual
// time against every strategy (run), one setting swept over values (sweep),
// and the scenario against the real binaries on this machine (live).
//
//	rlsim run SCENARIO.yaml [--out DIR] [--seed N] [--duration D] [--quiet]
//	rlsim sweep SCENARIO.yaml --param rtt|interval|lease|half-life --values a,b,c [--out DIR] [--seed N] [--duration D]
//	rlsim live SCENARIO.yaml [--out DIR] [--seed N] [--duration D] [--speed F] [--max-load N] [--quiet]
//	rlsim --help | rlsim --version
//
// Every flag also reads APPORTION_<FLAG> from the environment. The progress
// bar of long runs is drawn only when stderr is a terminal.
package main

import (
	"github.com/apportion/apportion/internal/command"
)

func main() { command.Main("rlsim", run, nil) }
