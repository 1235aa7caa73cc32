// Package version is the one place every apportion binary reads its version
// from, so `ratelimitd --version` and `rlctl --version` always agree.
//
// A release build sets Version with the linker:
//
//	go build -ldflags "-X github.com/apportion/apportion/internal/version.Version=v1.2.3" ./cmd/...
//
// Without it, the version comes from the build information the Go toolchain
// records: the module version for `go install ...@v1.2.3` (in a checkout,
// Go 1.24 and later record a pseudo-version of its commit,
// v0.0.0-20261206071612-8ac35ce332b0, "+dirty" when modified), else the VCS
// revision ("devel+abc1234") where only that is recorded, else "devel".
package version

import (
	"fmt"
	"io"
	"runtime/debug"
	"strings"
)

// Version is set at link time (-X); empty means "derive it from the build
// information".
var Version string

// String returns the version of this binary, never empty.
func String() string {
	bi, _ := debug.ReadBuildInfo()
	return derive(Version, bi)
}

// derive is String for a link-time version and build information (nil when
// the binary has none).
func derive(linked string, bi *debug.BuildInfo) string {
	if linked != "" {
		return linked
	}
	if bi == nil {
		return "devel"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var rev string
	var dirty bool
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev == "" {
		return "devel"
	}
	v := "devel+" + rev[:min(len(rev), 12)]
	if dirty {
		v += "+dirty"
	}
	return v
}

// Line is the one line `NAME --version` prints: "rlctl v1.2.3 (go1.26.8)".
func Line(name string) string {
	goVersion := "go?"
	if bi, ok := debug.ReadBuildInfo(); ok {
		goVersion = bi.GoVersion
	}
	return fmt.Sprintf("%s %s (%s)", name, String(), goVersion)
}

// Requested reports whether args ask for the version: "--version" or
// "-version" (or "--version=true") before a "--". The daemons check it
// before parsing their flags, so the answer never needs a valid
// configuration.
func Requested(args []string) bool {
	for _, a := range args {
		if a == "--" {
			return false
		}
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && name == "version" && (!hasVal || val == "true") {
			return true
		}
	}
	return false
}

// Print writes Line(name) and a newline to w.
func Print(w io.Writer, name string) error {
	_, err := fmt.Fprintln(w, Line(name))
	return err
}

// FlagHelp is the -version entry in the format of the flag package's
// usage text, for binaries that check Requested before their flag set.
const FlagHelp = "  -version\n    \tprint the version and exit\n"
