package ledger

import (
	"testing"
	"unsafe"
)

// TestKeySize keeps the per-key structs in the size classes the README's
// heap figures assume: the key in 144 bytes, a pair in 56, one pair per
// peer region (none for the region itself), and a write in 56.
func TestKeySize(t *testing.T) {
	if s := unsafe.Sizeof(key{}); s > 144 {
		t.Errorf("key is %d bytes, want <= 144 (see keyRare, key.pend, key.pairs)", s)
	}
	if s := unsafe.Sizeof(pair{}); s > 56 {
		t.Errorf("pair is %d bytes, want <= 56", s)
	}
	// A flush that writes every key holds a Write per key until the store
	// answers (the marker's fields are behind Write.Marker).
	if s := unsafe.Sizeof(Write{}); s > 56 {
		t.Errorf("Write is %d bytes, want <= 56", s)
	}
	regions := []RegionSpec{{"a", 1}, {"b", 1}, {"c", 1}}
	l, err := New(DefaultConfig(), "b", regions, Start{Inc: 1, RunID: "run"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	l.Usage(0, "k", 100, 1, 0)
	if n := len(l.pairsOf(l.keys["k"])); n != len(regions)-1 {
		t.Errorf("a key of 3 regions holds %d pairs, want 2", n)
	}
}
