// Package hashform fits a string a client controls into a field of an
// enforcer request: kept when it is valid UTF-8 within the field's limit,
// else replaced by its hashed form, "sha256:" and the hex SHA-256 of it (71
// bytes). A value already of the hashed form is hashed again, so the
// mapping is injective: distinct inputs never share a bucket. The Envoy
// service maps descriptors with it, the Go client, middleware and gRPC
// interceptor keys, resources and attributes.
package hashform

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"unicode/utf8"
)

// Prefix begins every hashed form.
const Prefix = "sha256:"

// Hash is the hashed form of s.
func Hash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return Prefix + hex.EncodeToString(sum[:])
}

// Is reports whether s is of the form Hash returns.
func Is(s string) bool {
	if len(s) != len(Prefix)+2*sha256.Size || !strings.HasPrefix(s, Prefix) {
		return false
	}
	for i := len(Prefix); i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Fit is s kept when it is valid UTF-8 of at most max bytes and not of the
// hashed form, else Hash(s).
func Fit(s string, max int) string {
	if len(s) <= max && utf8.ValidString(s) && !Is(s) {
		return s
	}
	return Hash(s)
}
