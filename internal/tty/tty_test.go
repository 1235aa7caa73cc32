package tty

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/creack/pty"
)

func TestIs(t *testing.T) {
	if Is(&bytes.Buffer{}) {
		t.Error("a buffer is not a terminal")
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if Is(f) {
		t.Error("a file is not a terminal")
	}
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	if Is(null) {
		t.Error("/dev/null is a character device, not a terminal")
	}
	ptmx, tt, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer ptmx.Close()
	defer tt.Close()
	t.Setenv("TERM", "xterm")
	if !Is(tt) {
		t.Error("a pseudo-terminal is a terminal")
	}
	t.Setenv("TERM", "dumb")
	if Is(tt) {
		t.Error("TERM=dumb: no terminal")
	}
}
