package client

import "github.com/apportion/apportion/internal/hashform"

// FitKey is s made a client key the enforcer accepts, for a key a client
// controls (a header, a metadata entry): s itself when it is valid UTF-8 of
// at most 256 bytes and not of the hashed form, else its hashed form,
// "sha256:" and the hex SHA-256 of s (71 bytes). That is injective, so a
// client sending an over-long or invalid key is limited under a key of its
// own, as the Envoy service maps descriptors: an enforcer refusing such a
// key was answered by the failure policy, and with FailOpen never limited
// that client at all.
func FitKey(s string) string { return hashform.Fit(s, maxClientKeyBytes) }

// FitField is FitKey for a resource or an attribute name or value (at most
// 1,024 bytes).
func FitField(s string) string { return hashform.Fit(s, maxFieldBytes) }

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
