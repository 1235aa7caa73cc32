package enforcerd

import (
	"io"
	"strings"
	"testing"

	"github.com/apportion/apportion/regional/usage"
)

// TestMaxUsageKeysFlag: --max-usage-keys sets the usage recorder's key
// bound (the default is the recorder's), and a bound below 1 is refused
// with an error that names the flag.
func TestMaxUsageKeysFlag(t *testing.T) {
	base := []string{"--region", "r", "--rules", "x.yaml"}
	o, err := parseFlags(base, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.maxUsageKeys != usage.DefaultMaxKeys {
		t.Errorf("default %d, want %d", o.maxUsageKeys, usage.DefaultMaxKeys)
	}
	if o, err = parseFlags(append(base, "--max-usage-keys", "2000000"), io.Discard); err != nil || o.maxUsageKeys != 2_000_000 {
		t.Errorf("--max-usage-keys 2000000: %v, %v", o, err)
	}
	for _, bad := range []string{"0", "-5"} {
		_, err := parseFlags(append(base, "--max-usage-keys", bad), io.Discard)
		if err == nil || !strings.Contains(err.Error(), "--max-usage-keys") {
			t.Errorf("--max-usage-keys %s: %v, want an error naming the flag", bad, err)
		}
	}
}
