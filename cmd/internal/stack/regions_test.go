package stack

import (
	"slices"
	"strings"
	"testing"
)

// TestResolveRegionsUpToTen: a stack runs 1 to 10 of the default regions,
// the first N in order, each name distinct and fitting the view's column;
// 0 means 3, and 11 is refused naming the bound.
func TestResolveRegionsUpToTen(t *testing.T) {
	if len(DefaultRegions) != 10 {
		t.Fatalf("%d default regions, want 10", len(DefaultRegions))
	}
	for n := 1; n <= 10; n++ {
		cfg := Config{Regions: n}
		if err := resolveRegions(&cfg); err != nil {
			t.Fatalf("%d regions: %v", n, err)
		}
		if !slices.Equal(cfg.RegionNames, DefaultRegions[:n]) {
			t.Errorf("%d regions: %v", n, cfg.RegionNames)
		}
	}
	seen := map[string]bool{}
	for _, n := range DefaultRegions {
		if seen[n] || n == "" || len(n) > 10 {
			t.Errorf("default region %q: repeated, empty or wider than the view's 10 columns", n)
		}
		seen[n] = true
	}
	cfg := Config{}
	if err := resolveRegions(&cfg); err != nil || cfg.Regions != 3 {
		t.Errorf("default: %d regions, %v; want 3", cfg.Regions, err)
	}
	for _, n := range []int{-1, 11} {
		cfg := Config{Regions: n}
		if err := resolveRegions(&cfg); err == nil || !strings.Contains(err.Error(), "regions must be 1..10") {
			t.Errorf("%d regions: %v, want refused (1..10)", n, err)
		}
	}
}
