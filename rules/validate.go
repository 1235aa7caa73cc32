package rules

import "fmt"

// FieldError is a validation error that names the offending field.
type FieldError struct {
	RuleID string
	Field  string // JSON name, e.g. "capacity" or "match.tier"
	Msg    string
}

func (e *FieldError) Error() string {
	if e.RuleID != "" {
		return fmt.Sprintf("rules: rule %q: %s: %s", e.RuleID, e.Field, e.Msg)
	}
	return fmt.Sprintf("rules: %s: %s", e.Field, e.Msg)
}

// Unwrap makes errors.Is(err, ErrInvalid) true.
func (e *FieldError) Unwrap() error { return ErrInvalid }

// Normalize fills defaults: key ["client_key"], scope regional, failure_mode open.
// STUB: replaced by the full implementation.
func (r *Rule) Normalize() {
	if len(r.Key) == 0 {
		r.Key = []string{"client_key"}
	}
	if r.Scope == "" {
		r.Scope = Regional
	}
	if r.FailureMode == "" {
		r.FailureMode = FailOpen
	}
}

// Validate checks a normalized rule; the error is a *FieldError.
// STUB: replaced by the full implementation.
func (r *Rule) Validate() error {
	if r.ID == "" {
		return &FieldError{Field: "id", Msg: "required"}
	}
	return nil
}

// ParseRule decodes one JSON rule document strictly (unknown fields are
// refused and named), normalizes and validates it.
// STUB: replaced by the full implementation.
func ParseRule(data []byte) (Rule, error) {
	return Rule{}, fmt.Errorf("not implemented")
}

// ParseRules decodes a JSON or YAML list of rule documents, normalizes and
// validates every rule, and refuses duplicate ids.
// STUB: replaced by the full implementation.
func ParseRules(data []byte) ([]Rule, error) {
	return nil, fmt.Errorf("not implemented")
}
