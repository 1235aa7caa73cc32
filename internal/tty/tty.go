// Package tty tells whether output goes to a terminal, so that the tools
// draw progress bars and redraw screens only for a person watching, and
// write plain lines to files, pipes and CI logs.
package tty

import (
	"io"
	"os"

	"golang.org/x/term"
)

// fder is what *os.File provides; a pseudo-terminal in tests is one too.
type fder interface{ Fd() uintptr }

// Is reports whether w is a terminal. Anything that is not a file (a
// buffer, a pipe writer) is not; TERM=dumb counts as no terminal.
func Is(w io.Writer) bool {
	f, ok := w.(fder)
	if !ok || os.Getenv("TERM") == "dumb" {
		return false
	}
	return term.IsTerminal(int(f.Fd()))
}
