package ledger

import (
	"testing"
	"unsafe"
)

// TestKeySize keeps the per-key structs in the size classes the README's
// heap figures assume: the key in 192 bytes, a pair in 56.
func TestKeySize(t *testing.T) {
	if s := unsafe.Sizeof(key{}); s > 192 {
		t.Errorf("key is %d bytes, want <= 192 (see keyRare)", s)
	}
	if s := unsafe.Sizeof(pair{}); s > 56 {
		t.Errorf("pair is %d bytes, want <= 56", s)
	}
}
