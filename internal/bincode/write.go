package bincode

import "encoding/binary"

// AppendString appends s as a uvarint length and its bytes.
func AppendString(buf []byte, s string) []byte {
	buf = binary.AppendUvarint(buf, uint64(len(s)))
	return append(buf, s...)
}

// UvarintLen is the length of v as a uvarint.
func UvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// StringLen is the length of AppendString(nil, s).
func StringLen(s string) int { return UvarintLen(uint64(len(s))) + len(s) }
