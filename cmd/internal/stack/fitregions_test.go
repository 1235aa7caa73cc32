package stack

import (
	"maps"
	"slices"
	"testing"

	"github.com/apportion/apportion/deploy"
	"github.com/apportion/apportion/rules"
)

// TestFitRegions: for every stack size, the example global rules list
// exactly the stack's regions (the example's weights kept, 1 for the
// others) and still pass the store's checks: a global rule admits nothing
// in a region it does not list, so `rlstack --regions 6` without this
// rejected every check of user-global in sa-east, af-south and me-central.
func TestFitRegions(t *testing.T) {
	for n := 1; n <= len(DefaultRegions); n++ {
		rs, err := rules.ParseRules(deploy.ExampleRules)
		if err != nil {
			t.Fatal(err)
		}
		names := DefaultRegions[:n]
		fitRegions(rs, names)
		globals := 0
		for _, r := range rs {
			if r.Scope != rules.Global {
				continue
			}
			globals++
			if got := slices.Sorted(maps.Keys(r.Regions)); !slices.Equal(got, slices.Sorted(slices.Values(names))) {
				t.Errorf("%d regions: rule %s lists %v, want %v", n, r.ID, got, names)
			}
			if n >= 3 && r.Regions["us-east"] != 2 {
				t.Errorf("%d regions: rule %s weighs us-east %v, want the example's 2", n, r.ID, r.Regions["us-east"])
			}
			if err := r.Validate(); err != nil {
				t.Errorf("%d regions: rule %s: %v", n, r.ID, err)
			}
			if err := r.CheckFloors(); err != nil {
				t.Errorf("%d regions: rule %s: %v", n, r.ID, err)
			}
		}
		if globals == 0 {
			t.Fatal("the example rules hold no global rule")
		}
	}
}
