// Package bincode reads and writes the pieces of the canonical binary
// encodings of regional/usage and sync/wire. Reading: minimal uvarints, counts bounded by the bytes left, and
// length-prefixed strings that share the input's memory. The first error
// sticks (it wraps the codec's own ErrMalformed and names the byte offset);
// every later read returns a zero value, so a decoder can read a whole
// message and check Err once. Nothing here panics on any input. Writing:
// AppendString and the sizes (UvarintLen, StringLen) that let an encoder
// split a message before it writes it.
package bincode

import (
	"encoding/binary"
	"fmt"
	"math"
)

// Reader reads from one message.
type Reader struct {
	s         string
	off       int
	err       error
	malformed error
	maxString uint64
}

// New returns a Reader over data starting at off. Errors wrap malformed;
// strings longer than maxString bytes are malformed.
func New(data string, off int, malformed error, maxString int) *Reader {
	return &Reader{s: data, off: off, malformed: malformed, maxString: uint64(maxString)}
}

// Err is the first error, or nil.
func (r *Reader) Err() error { return r.err }

// Rest is the number of bytes not read yet.
func (r *Reader) Rest() int { return len(r.s) - r.off }

// Fail records an error at the current offset unless one is recorded.
func (r *Reader) Fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: at byte %d: %s", r.malformed, r.off, fmt.Sprintf(format, args...))
	}
}

// Byte reads one byte.
func (r *Reader) Byte() byte {
	if r.err != nil {
		return 0
	}
	if r.off >= len(r.s) {
		r.Fail("truncated")
		return 0
	}
	r.off++
	return r.s[r.off-1]
}

// Uvarint reads a minimally encoded uvarint.
func (r *Reader) Uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	var v uint64
	var shift uint
	for i := 0; ; i++ {
		if r.off >= len(r.s) {
			r.Fail("truncated uvarint")
			return 0
		}
		c := r.s[r.off]
		r.off++
		if i == binary.MaxVarintLen64-1 && c > 1 {
			r.Fail("uvarint overflows 64 bits")
			return 0
		}
		if c < 0x80 {
			if i > 0 && c == 0 {
				r.Fail("non-minimal uvarint")
				return 0
			}
			return v | uint64(c)<<shift
		}
		v |= uint64(c&0x7f) << shift
		shift += 7
	}
}

// Varint reads a zig-zag encoded signed integer.
func (r *Reader) Varint() int64 {
	u := r.Uvarint()
	x := int64(u >> 1)
	if u&1 != 0 {
		x = ^x
	}
	return x
}

// Int63 reads a uvarint that must fit an int64.
func (r *Reader) Int63() int64 {
	v := r.Uvarint()
	if v > math.MaxInt64 {
		r.Fail("count %d overflows int64", v)
		return 0
	}
	return int64(v)
}

// Count reads a count of items of at least minSize bytes each, rejecting
// counts the rest of the input cannot hold (so a caller may allocate it).
func (r *Reader) Count(minSize int) int {
	v := r.Uvarint()
	if r.err == nil && v > uint64(r.Rest()/minSize) {
		r.Fail("count %d exceeds remaining %d bytes", v, r.Rest())
		return 0
	}
	if v > math.MaxInt32 {
		return 0
	}
	return int(v)
}

// Str reads a length-prefixed string; it shares the input's memory.
func (r *Reader) Str() string {
	n := r.Uvarint()
	if r.err != nil {
		return ""
	}
	if n > r.maxString {
		r.Fail("string of %d bytes, limit %d", n, r.maxString)
		return ""
	}
	if n > uint64(r.Rest()) {
		r.Fail("truncated string: %d bytes, %d left", n, r.Rest())
		return ""
	}
	s := r.s[r.off : r.off+int(n)]
	r.off += int(n)
	return s
}
