package rules

// Index finds the rules that match a request. It is immutable once built, so
// an enforcer swaps whole indexes atomically and a check never sees half a change.
// STUB: replaced by the full implementation.
type Index struct {
	rules []Rule
}

// NewIndex builds an index over rs (normalized and validated rules).
func NewIndex(rs []Rule) (*Index, error) {
	return &Index{rules: rs}, nil
}

// Match returns the rules matching the request, in id order.
func (ix *Index) Match(resource string, attrs map[string]string) []*Rule {
	return nil
}

// Rules returns all rules in id order.
func (ix *Index) Rules() []Rule { return ix.rules }

// Len is the number of rules.
func (ix *Index) Len() int { return len(ix.rules) }
