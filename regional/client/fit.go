package client

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"unicode/utf8"
)

// hashPrefix begins every hashed form: "sha256:" and 64 lowercase hex digits.
const hashPrefix = "sha256:"

// FitKey is s made a client key the enforcer accepts, for a key a client
// controls (a header, a metadata entry): s itself when it is valid UTF-8 of
// at most 256 bytes and not of the hashed form, else its hashed form,
// "sha256:" and the hex SHA-256 of s (71 bytes). That is injective, so a
// client sending an over-long or invalid key is limited under a key of its
// own, as the Envoy service maps descriptors: an enforcer refusing such a
// key was answered by the failure policy, and with FailOpen never limited
// that client at all.
func FitKey(s string) string { return fit(s, maxClientKeyBytes) }

// FitField is FitKey for a resource or an attribute name or value (at most
// 1,024 bytes).
func FitField(s string) string { return fit(s, maxFieldBytes) }

func fit(s string, max int) string {
	if len(s) <= max && utf8.ValidString(s) && !isHashedForm(s) {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return hashPrefix + hex.EncodeToString(sum[:])
}

func isHashedForm(s string) bool {
	if len(s) != len(hashPrefix)+2*sha256.Size || !strings.HasPrefix(s, hashPrefix) {
		return false
	}
	for i := len(hashPrefix); i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// FitAttributes is attrs with every name and value fitted (FitField): attrs
// itself when none changes, else a new map.
func FitAttributes(attrs map[string]string) map[string]string {
	changed := false
	for k, v := range attrs {
		if FitField(k) != k || FitField(v) != v {
			changed = true
			break
		}
	}
	if !changed {
		return attrs
	}
	out := make(map[string]string, len(attrs))
	for k, v := range attrs {
		out[FitField(k)] = FitField(v)
	}
	return out
}
