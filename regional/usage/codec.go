package usage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"github.com/apportion/apportion/internal/bincode"
)

// Batch is one flushed message.
type Batch struct {
	Region, Enforcer string
	// Seq numbers the messages of one Publisher: 1, 2, 3, ... A gap means
	// lost messages; a Publisher that restarts starts again at 1.
	Seq    uint64
	Deltas []Delta
}

const (
	// magicV1 opens every version-1 message. A new format gets a new byte.
	magicV1 = 0xA1

	// MaxStringLen bounds the length of a region, enforcer, rule or key.
	MaxStringLen = 4096
	// MaxMessageSize bounds an encoded batch (the NATS hard payload limit).
	MaxMessageSize = 64 << 20
)

var (
	// ErrMalformed is wrapped by every Decode error.
	ErrMalformed = errors.New("usage: malformed batch")
	// ErrInvalid is wrapped by Encode errors about a batch that cannot be
	// represented (negative counts, strings longer than MaxStringLen).
	ErrInvalid = errors.New("usage: invalid batch")
	// ErrTooLarge is returned when one delta alone does not fit in a message.
	ErrTooLarge = errors.New("usage: batch too large")
)

// minDeltaSize is the smallest encoding of a delta: empty key, zero counts.
const minDeltaSize = 3

// Encode returns the version-1 encoding of b (see the package doc). Deltas
// are grouped by rule, so a rule id is written once; Decode returns them in
// that grouped order.
func Encode(b Batch) ([]byte, error) {
	if err := validate(b); err != nil {
		return nil, err
	}
	groups := groupByRule(b.Deltas)
	size := headerSize(b.Region, b.Enforcer, b.Seq, len(b.Deltas), len(groups))
	for _, g := range groups {
		size += groupHeaderSize(g[0].Rule, len(g))
		for _, d := range g {
			size += deltaSize(d)
		}
	}
	if size > MaxMessageSize {
		return nil, fmt.Errorf("%w: %d bytes encoded, limit %d", ErrTooLarge, size, MaxMessageSize)
	}
	buf := make([]byte, 0, size)
	buf = appendHeader(buf, b.Region, b.Enforcer, b.Seq, len(b.Deltas), len(groups))
	for _, g := range groups {
		buf = appendGroup(buf, g)
	}
	return buf, nil
}

// EncodeSplit encodes b into as few messages as possible, none bigger than
// maxSize bytes, numbered b.Seq, b.Seq+1, ... Every delta appears in exactly
// one message. It returns ErrTooLarge if a single delta does not fit.
func EncodeSplit(b Batch, maxSize int) ([][]byte, error) {
	if err := validate(b); err != nil {
		return nil, err
	}
	maxSize = min(maxSize, MaxMessageSize)
	var out [][]byte
	seq := b.Seq
	rest := groupByRule(b.Deltas)
	for len(rest) > 0 || len(out) == 0 {
		// Take as many deltas as fit, counting with the worst-case header
		// (uvarint counts of the whole remaining batch are an upper bound).
		remaining := 0
		for _, g := range rest {
			remaining += len(g)
		}
		size := headerSize(b.Region, b.Enforcer, seq, remaining, len(rest))
		var take [][]Delta
		n := 0
	fill:
		for len(rest) > 0 {
			g := rest[0]
			gsize := groupHeaderSize(g[0].Rule, len(g))
			if size+gsize+deltaSize(g[0]) > maxSize {
				break
			}
			size += gsize
			k := 0
			for k < len(g) && size+deltaSize(g[k]) <= maxSize {
				size += deltaSize(g[k])
				k++
			}
			take = append(take, g[:k])
			n += k
			if k < len(g) {
				rest[0] = g[k:]
				break fill
			}
			rest = rest[1:]
		}
		if n == 0 && len(rest) > 0 {
			return nil, fmt.Errorf("%w: delta for rule %q key %q does not fit in %d bytes", ErrTooLarge, rest[0][0].Rule, rest[0][0].Key, maxSize)
		}
		buf := appendHeader(make([]byte, 0, size), b.Region, b.Enforcer, seq, n, len(take))
		for _, g := range take {
			buf = appendGroup(buf, g)
		}
		out = append(out, buf)
		seq++
	}
	return out, nil
}

func validate(b Batch) error {
	for _, s := range []string{b.Region, b.Enforcer} {
		if len(s) > MaxStringLen {
			return fmt.Errorf("%w: string of %d bytes, limit %d", ErrInvalid, len(s), MaxStringLen)
		}
	}
	for _, d := range b.Deltas {
		if len(d.Rule) > MaxStringLen || len(d.Key) > MaxStringLen {
			return fmt.Errorf("%w: rule %.32q key %.32q longer than %d bytes", ErrInvalid, d.Rule, d.Key, MaxStringLen)
		}
		if d.Admitted < 0 || d.Rejected < 0 {
			return fmt.Errorf("%w: negative count for rule %q key %q", ErrInvalid, d.Rule, d.Key)
		}
	}
	return nil
}

// groupByRule returns the deltas grouped by rule: rules in order of first
// appearance, deltas in their original order within a rule. Deltas already
// grouped (as Drain returns them) are not copied.
func groupByRule(ds []Delta) [][]Delta {
	var groups [][]Delta
	grouped := true
	seen := map[string]bool{}
	start := 0
	for i := 1; i <= len(ds); i++ {
		if i < len(ds) && ds[i].Rule == ds[start].Rule {
			continue
		}
		if seen[ds[start].Rule] {
			grouped = false
			break
		}
		seen[ds[start].Rule] = true
		groups = append(groups, ds[start:i])
		start = i
	}
	if grouped {
		return groups
	}
	// Slow path: a rule appears in several runs. Regroup into a copy.
	order := []string{}
	byRule := map[string][]Delta{}
	for _, d := range ds {
		if _, ok := byRule[d.Rule]; !ok {
			order = append(order, d.Rule)
		}
		byRule[d.Rule] = append(byRule[d.Rule], d)
	}
	groups = groups[:0]
	for _, r := range order {
		groups = append(groups, byRule[r])
	}
	return groups
}

func headerSize(region, enforcer string, seq uint64, ndeltas, ngroups int) int {
	return 1 + bincode.StringLen(region) + bincode.StringLen(enforcer) + bincode.UvarintLen(seq) +
		bincode.UvarintLen(uint64(ndeltas)) + bincode.UvarintLen(uint64(ngroups))
}

func groupHeaderSize(rule string, nkeys int) int {
	return bincode.StringLen(rule) + bincode.UvarintLen(uint64(nkeys))
}

func deltaSize(d Delta) int {
	return bincode.StringLen(d.Key) + bincode.UvarintLen(uint64(d.Admitted)) + bincode.UvarintLen(uint64(d.Rejected))
}

func appendHeader(buf []byte, region, enforcer string, seq uint64, ndeltas, ngroups int) []byte {
	buf = append(buf, magicV1)
	buf = bincode.AppendString(buf, region)
	buf = bincode.AppendString(buf, enforcer)
	buf = binary.AppendUvarint(buf, seq)
	buf = binary.AppendUvarint(buf, uint64(ndeltas))
	return binary.AppendUvarint(buf, uint64(ngroups))
}

func appendGroup(buf []byte, g []Delta) []byte {
	buf = bincode.AppendString(buf, g[0].Rule)
	buf = binary.AppendUvarint(buf, uint64(len(g)))
	for _, d := range g {
		buf = bincode.AppendString(buf, d.Key)
		buf = binary.AppendUvarint(buf, uint64(d.Admitted))
		buf = binary.AppendUvarint(buf, uint64(d.Rejected))
	}
	return buf
}

// Decode parses a version-1 batch. Any malformed, truncated or oversized
// input yields an error wrapping ErrMalformed; Decode never panics. The
// encoding is canonical: Decode rejects non-minimal uvarints and a rule in
// two groups, so Encode(Decode(data)) == data for every accepted data. The
// returned strings share one copy of data, so data may be reused afterwards.
func Decode(data []byte) (Batch, error) {
	if len(data) > MaxMessageSize {
		return Batch{}, fmt.Errorf("%w: %d bytes, limit %d", ErrMalformed, len(data), MaxMessageSize)
	}
	if len(data) == 0 {
		return Batch{}, fmt.Errorf("%w: empty", ErrMalformed)
	}
	if data[0] != magicV1 {
		return Batch{}, fmt.Errorf("%w: unknown format byte 0x%02x", ErrMalformed, data[0])
	}
	d := bincode.New(string(data), 1, ErrMalformed, MaxStringLen)
	var b Batch
	b.Region = d.Str()
	b.Enforcer = d.Str()
	b.Seq = d.Uvarint()
	ndeltas := d.Count(minDeltaSize)
	ngroups := d.Count(1 + 1 + minDeltaSize)
	if d.Err() != nil {
		return Batch{}, d.Err()
	}
	if ngroups > ndeltas || (ndeltas > 0 && ngroups == 0) {
		return Batch{}, fmt.Errorf("%w: %d groups for %d deltas", ErrMalformed, ngroups, ndeltas)
	}
	if ndeltas > 0 {
		b.Deltas = make([]Delta, 0, ndeltas)
	}
	var rules map[string]struct{} // a rule is written once per batch
	if ngroups > 1 {
		rules = make(map[string]struct{}, ngroups)
	}
	for g := 0; g < ngroups && d.Err() == nil; g++ {
		rule := d.Str()
		if rules != nil && d.Err() == nil {
			if _, dup := rules[rule]; dup {
				d.Fail("rule %q in two groups", rule)
			}
			rules[rule] = struct{}{}
		}
		nkeys := d.Count(minDeltaSize)
		if d.Err() == nil && (nkeys == 0 || nkeys > ndeltas-len(b.Deltas)) {
			d.Fail("group %d has %d keys, %d deltas left", g, nkeys, ndeltas-len(b.Deltas))
		}
		for k := 0; k < nkeys && d.Err() == nil; k++ {
			key := d.Str()
			adm := d.Int63()
			rej := d.Int63()
			b.Deltas = append(b.Deltas, Delta{Rule: rule, Key: key, Admitted: adm, Rejected: rej})
		}
	}
	if d.Err() != nil {
		return Batch{}, d.Err()
	}
	if len(b.Deltas) != ndeltas {
		return Batch{}, fmt.Errorf("%w: %d deltas announced, %d found", ErrMalformed, ndeltas, len(b.Deltas))
	}
	if d.Rest() != 0 {
		return Batch{}, fmt.Errorf("%w: %d trailing bytes", ErrMalformed, d.Rest())
	}
	return b, nil
}
