package stack

import "fmt"

// resolveRegions fills in cfg.RegionNames and cfg.Regions from each other
// and checks the delay matrix names only those regions.
func resolveRegions(cfg *Config) error {
	if len(cfg.RegionNames) == 0 {
		if cfg.Regions == 0 {
			cfg.Regions = 3
		}
		if cfg.Regions < 1 || cfg.Regions > len(DefaultRegions) {
			return fmt.Errorf("stack: regions must be 1..%d, got %d", len(DefaultRegions), cfg.Regions)
		}
		cfg.RegionNames = DefaultRegions[:cfg.Regions]
	} else {
		if cfg.Regions != 0 && cfg.Regions != len(cfg.RegionNames) {
			return fmt.Errorf("stack: Regions is %d but RegionNames has %d names", cfg.Regions, len(cfg.RegionNames))
		}
		cfg.Regions = len(cfg.RegionNames)
		seen := map[string]bool{}
		for _, n := range cfg.RegionNames {
			if n == "" || seen[n] {
				return fmt.Errorf("stack: region names must be distinct and not empty, got %q", cfg.RegionNames)
			}
			seen[n] = true
		}
	}
	known := map[string]bool{}
	for _, n := range cfg.RegionNames {
		known[n] = true
	}
	for a, row := range cfg.Delay {
		for b, d := range row {
			if !known[a] || !known[b] {
				return fmt.Errorf("stack: delay %s -> %s names a region that is not in the stack", a, b)
			}
			if d < 0 {
				return fmt.Errorf("stack: delay %s -> %s is negative (%v)", a, b, d)
			}
		}
	}
	return nil
}
