// Package wire is the binary encoding of the sync agents' report messages:
// one NATS message per region per sync interval carrying the ledger Report
// of every global rule the region coordinates, and (sign.go) the signed
// envelope every message travels in: Signer.Seal and Verifier.Open.
//
// Invariants:
//   - Deterministic and canonical. Encode of a Message always yields the same
//     bytes, and Decode accepts only canonical encodings (minimal uvarints,
//     a sorted region table whose every entry is used, flags 0 or 1, nothing
//     after the last rule), so Decode(data) succeeding implies
//     Encode(decoded) == data (FuzzDecode checks it).
//   - Malformed input never panics and never yields a partial Message:
//     Decode returns a complete Message or an error wrapping ErrMalformed.
//     Decode allocates at most a constant factor of its input, which is
//     itself bounded by MaxMessageSize; every count is checked against the
//     bytes left before anything is allocated.
//   - The wire carries the ledger's fields faithfully; it does not judge
//     them (a zero incarnation or an unsorted key list decodes fine and is
//     rejected by ledger.Receive, which changes nothing on rejection).
//
// # Format (version 2)
//
//	magic    byte 0xB2 (format version 2; other values are rejected)
//	from     string                the sending region
//	nregions uvarint               region table: sorted, unique, each used
//	nregions x region string       acks and counters name regions by index
//	nrules   uvarint
//	nrules x rule report:
//	  rule   string
//	  inc    uvarint
//	  seq    uvarint
//	  base   varint
//	  nacks  uvarint
//	  nacks x: region uvarint (index), inc uvarint, seq uvarint, frozen byte (0|1)
//	  ncloses uvarint
//	  ncloses x: key string, region uvarint (index), inc uvarint, retire uvarint
//	  nkeys  uvarint
//	  nkeys x:
//	    key      string
//	    demand   varint
//	    position varint
//	    ngave    uvarint, ngave x counter
//	    napplied uvarint, napplied x counter
//	    retire   uvarint
//	counter: region uvarint (index), inc uvarint, units varint
//
// string is a uvarint length (at most MaxStringLen) and the bytes; varint is
// a zig-zag signed varint (encoding/binary.AppendVarint), uvarint
// encoding/binary.AppendUvarint, both minimal. The sender of every rule
// report is the message's from; Decode sets Report.From to it.
//
// Size: a key named like "rl:{user:000042}:orders" (22 bytes) with a gift
// counter and an applied counter and units below 2^20 costs 42 bytes
// (BenchmarkEncode); the agent's apportion_sync_report_bytes_total gives
// bytes per active key per second in a live system.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"github.com/apportion/apportion/internal/bincode"
	"iter"
	"slices"
	"unsafe"

	"github.com/apportion/apportion/sync/ledger"
)

// Message is one region's report message: the reports of its ledgers.
type Message struct {
	From  string
	Rules []RuleReport
}

// RuleReport is the ledger Report of one global rule. Report.From must equal
// the message's From.
type RuleReport struct {
	Rule   string
	Report ledger.Report
}

const (
	// magicV2 opens every version-2 message. A new format gets a new byte
	// (version 1, 0xB1, had no retirement fields).
	magicV2 = 0xB2
	// MaxStringLen bounds a region, rule or key.
	MaxStringLen = 4096
	// MaxMessageSize bounds an encoded message (the NATS hard payload limit).
	MaxMessageSize = 64 << 20
)

var (
	// ErrMalformed is wrapped by every Decode error.
	ErrMalformed = errors.New("wire: malformed message")
	// ErrInvalid is wrapped by Encode errors about a message that cannot be
	// represented (a rule report from another region, a string too long).
	ErrInvalid = errors.New("wire: invalid message")
	// ErrTooLarge is returned when a message (or, for EncodeSplit, one key
	// of it with its rule header) does not fit the size limit.
	ErrTooLarge = errors.New("wire: message too large")
)

// Minimal encoded sizes, used to bound counts before allocating.
const (
	minRegion  = 1 // empty string
	minRule    = 7 // rule, inc, seq, base, nacks, ncloses, nkeys
	minAck     = 4
	minClose   = 4 // key, region, inc, retire
	minKey     = 6 // key, demand, position, ngave, napplied, retire
	minCounter = 3
)

// Encode returns the version-1 encoding of m.
func Encode(m Message) ([]byte, error) {
	if err := validate(m); err != nil {
		return nil, err
	}
	tab := regionTable(m)
	buf := appendMessage(nil, m.From, tab, m.Rules)
	if len(buf) > MaxMessageSize {
		return nil, fmt.Errorf("%w: %d bytes encoded, limit %d", ErrTooLarge, len(buf), MaxMessageSize)
	}
	return buf, nil
}

// EncodeSplit encodes m into messages of at most maxSize bytes. Rule reports
// are kept whole when they fit; a rule report too large for one message is
// split by keys, every part repeating its header and acks (the ledger takes
// several reports with one sequence number as one: see ledger.Receive). It
// returns ErrTooLarge if a rule header with one key does not fit.
func EncodeSplit(m Message, maxSize int) ([][]byte, error) {
	parts, err := EncodeParts(m, maxSize)
	if err != nil {
		return nil, err
	}
	return slices.Collect(parts), nil
}

// EncodeParts is EncodeSplit yielding one message at a time, each encoded
// when it is asked for, so that a sender of a large report (every key,
// every FullEvery-th tick) holds one part, not all of them. Every error is
// returned before the first part: a message either encodes whole or not
// at all.
//
// Parts are cut by the sizes of their keys, computed without encoding
// (sizer): one pass over the keys, then one encoding of each part. A part's
// size is counted with the whole message's region table, an upper bound of
// its own (a part's table is a subset, so its indices are no larger), so a
// part may end a few bytes short of maxSize but never exceeds it; a key
// whose bound alone exceeds maxSize but whose exact encoding fits travels
// alone.
func EncodeParts(m Message, maxSize int) (iter.Seq[[]byte], error) {
	if err := validate(m); err != nil {
		return nil, err
	}
	maxSize = min(maxSize, MaxMessageSize)
	z := newSizer(m)
	body := make([]int, len(m.Rules)) // each rule report's size, header and keys
	total := z.header(len(m.Rules))
	for i, rr := range m.Rules {
		body[i] = z.ruleHeader(rr.Rule, rr.Report, len(rr.Report.Keys)) + z.keys(rr.Report.Keys)
		total += body[i]
	}
	if total <= maxSize { // exact: the whole message's own table
		return func(yield func([]byte) bool) { yield(appendMessage(make([]byte, 0, total), m.From, z.tab, m.Rules)) }, nil
	}
	// Cut the reports into pieces that fit alone, then pack them greedily.
	type piece struct {
		rr   RuleReport
		size int // its rule report's part of a message (bound)
	}
	var pieces []piece
	one := z.header(1)
	for i, rr := range m.Rules {
		if one+body[i] <= maxSize {
			pieces = append(pieces, piece{rr, body[i]})
			continue
		}
		keys := rr.Report.Keys
		if len(keys) == 0 { // a header (acks, closures) alone too large
			return nil, fmt.Errorf("%w: rule %q header does not fit in %d bytes", ErrTooLarge, rr.Rule, maxSize)
		}
		for len(keys) > 0 {
			// The most keys whose part fits (sizes grow with the keys).
			n, sum := 0, 0
			for n < len(keys) {
				ks := z.key(keys[n])
				if one+z.ruleHeader(rr.Rule, rr.Report, n+1)+sum+ks > maxSize {
					break
				}
				n, sum = n+1, sum+ks
			}
			part := rr
			if n == 0 {
				part.Report.Keys = keys[:1]
				if size(m.From, []RuleReport{part}) > maxSize {
					return nil, fmt.Errorf("%w: rule %q key %q does not fit in %d bytes", ErrTooLarge, rr.Rule, keys[0].Key, maxSize)
				}
				n, sum = 1, maxSize // fits alone, exactly: travels alone
			}
			part.Report.Keys = keys[:n]
			pieces = append(pieces, piece{part, z.ruleHeader(rr.Rule, rr.Report, n) + sum})
			keys = keys[n:]
		}
	}
	return func(yield func([]byte) bool) {
		var cur []RuleReport
		sum := 0
		flush := func() bool {
			if len(cur) == 0 {
				return true
			}
			sub := Message{From: m.From, Rules: cur}
			buf := make([]byte, 0, min(z.header(len(cur))+sum, maxSize)) // the bound: no growth
			cur, sum = nil, 0
			return yield(appendMessage(buf, m.From, regionTable(sub), sub.Rules))
		}
		for _, p := range pieces {
			if len(cur) > 0 && z.header(len(cur)+1)+sum+p.size > maxSize && !flush() {
				return
			}
			cur = append(cur, p.rr)
			sum += p.size
		}
		flush()
	}, nil
}

// sizer computes encoded sizes without encoding, with the region table of
// one message (indices into it).
type sizer struct {
	from string
	tab  []string
	head int // header's size but for its count of rule reports (computed once)
}

func newSizer(m Message) sizer {
	z := sizer{from: m.From, tab: regionTable(m)}
	z.head = 1 + bincode.StringLen(z.from) + bincode.UvarintLen(uint64(len(z.tab)))
	for _, r := range z.tab {
		z.head += bincode.StringLen(r)
	}
	return z
}

func (z sizer) idx(name string) int {
	i, _ := slices.BinarySearch(z.tab, name)
	return bincode.UvarintLen(uint64(i))
}

// header is the size of a message's header with nrules rule reports.
func (z sizer) header(nrules int) int { return z.head + bincode.UvarintLen(uint64(nrules)) }

// ruleHeader is the size of a rule report's header with nkeys keys (the
// keys not included).
func (z sizer) ruleHeader(rule string, r ledger.Report, nkeys int) int {
	n := bincode.StringLen(rule) + bincode.UvarintLen(r.Inc) + bincode.UvarintLen(r.Seq) + varintLen(r.Base)
	n += bincode.UvarintLen(uint64(len(r.Acks)))
	for _, a := range r.Acks {
		n += z.idx(a.Region) + bincode.UvarintLen(a.Inc) + bincode.UvarintLen(a.Seq) + 1
	}
	n += bincode.UvarintLen(uint64(len(r.Closes)))
	for _, c := range r.Closes {
		n += bincode.StringLen(c.Key) + z.idx(c.Region) + bincode.UvarintLen(c.Inc) + bincode.UvarintLen(c.Retire)
	}
	return n + bincode.UvarintLen(uint64(nkeys))
}

func (z sizer) keys(ks []ledger.KeyReport) int {
	n := 0
	for _, k := range ks {
		n += z.key(k)
	}
	return n
}

func (z sizer) key(k ledger.KeyReport) int {
	n := bincode.StringLen(k.Key) + varintLen(k.Demand) + varintLen(k.Position) + bincode.UvarintLen(k.Retire)
	for _, cs := range [2][]ledger.Counter{k.Gave, k.Applied} {
		n += bincode.UvarintLen(uint64(len(cs)))
		for _, c := range cs {
			n += z.idx(c.Region) + bincode.UvarintLen(c.Inc) + varintLen(c.Units)
		}
	}
	return n
}

// varintLen is the length of binary.AppendVarint(nil, v).
func varintLen(v int64) int { return bincode.UvarintLen(uint64(v)<<1 ^ uint64(v>>63)) }

// size is the exact encoded size of a message of rs.
func size(from string, rs []RuleReport) int {
	return len(appendMessage(nil, from, regionTable(Message{From: from, Rules: rs}), rs))
}

func validate(m Message) error {
	long := func(s string) bool { return len(s) > MaxStringLen }
	if long(m.From) {
		return fmt.Errorf("%w: from longer than %d bytes", ErrInvalid, MaxStringLen)
	}
	for _, rr := range m.Rules {
		r := rr.Report
		if r.From != m.From {
			return fmt.Errorf("%w: rule %q: report from %q in a message from %q", ErrInvalid, rr.Rule, r.From, m.From)
		}
		if long(rr.Rule) {
			return fmt.Errorf("%w: rule id longer than %d bytes", ErrInvalid, MaxStringLen)
		}
		for _, a := range r.Acks {
			if long(a.Region) {
				return fmt.Errorf("%w: region longer than %d bytes", ErrInvalid, MaxStringLen)
			}
		}
		for _, c := range r.Closes {
			if long(c.Region) || long(c.Key) {
				return fmt.Errorf("%w: closure key or region longer than %d bytes", ErrInvalid, MaxStringLen)
			}
		}
		for _, k := range r.Keys {
			if long(k.Key) {
				return fmt.Errorf("%w: rule %q: key longer than %d bytes", ErrInvalid, rr.Rule, MaxStringLen)
			}
			for _, cs := range [2][]ledger.Counter{k.Gave, k.Applied} {
				for _, c := range cs {
					if long(c.Region) {
						return fmt.Errorf("%w: region longer than %d bytes", ErrInvalid, MaxStringLen)
					}
				}
			}
		}
	}
	return nil
}

// regionTable returns the sorted, unique regions the acks and counters
// name. It allocates the table only: a region is looked up in it (a few
// entries) before it is added, not collected once per counter.
func regionTable(m Message) []string {
	var tab []string
	add := func(name string) {
		if i, found := slices.BinarySearch(tab, name); !found {
			tab = slices.Insert(tab, i, name)
		}
	}
	for _, rr := range m.Rules {
		for _, a := range rr.Report.Acks {
			add(a.Region)
		}
		for _, c := range rr.Report.Closes {
			add(c.Region)
		}
		for _, k := range rr.Report.Keys {
			for _, c := range k.Gave {
				add(c.Region)
			}
			for _, c := range k.Applied {
				add(c.Region)
			}
		}
	}
	return tab
}

func appendMessage(buf []byte, from string, tab []string, rs []RuleReport) []byte {
	idx := func(name string) uint64 {
		i, _ := slices.BinarySearch(tab, name)
		return uint64(i)
	}
	counters := func(buf []byte, cs []ledger.Counter) []byte {
		buf = binary.AppendUvarint(buf, uint64(len(cs)))
		for _, c := range cs {
			buf = binary.AppendUvarint(buf, idx(c.Region))
			buf = binary.AppendUvarint(buf, c.Inc)
			buf = binary.AppendVarint(buf, c.Units)
		}
		return buf
	}
	buf = append(buf, magicV2)
	buf = bincode.AppendString(buf, from)
	buf = binary.AppendUvarint(buf, uint64(len(tab)))
	for _, r := range tab {
		buf = bincode.AppendString(buf, r)
	}
	buf = binary.AppendUvarint(buf, uint64(len(rs)))
	for _, rr := range rs {
		r := rr.Report
		buf = bincode.AppendString(buf, rr.Rule)
		buf = binary.AppendUvarint(buf, r.Inc)
		buf = binary.AppendUvarint(buf, r.Seq)
		buf = binary.AppendVarint(buf, r.Base)
		buf = binary.AppendUvarint(buf, uint64(len(r.Acks)))
		for _, a := range r.Acks {
			buf = binary.AppendUvarint(buf, idx(a.Region))
			buf = binary.AppendUvarint(buf, a.Inc)
			buf = binary.AppendUvarint(buf, a.Seq)
			var f byte
			if a.Frozen {
				f = 1
			}
			buf = append(buf, f)
		}
		buf = binary.AppendUvarint(buf, uint64(len(r.Closes)))
		for _, c := range r.Closes {
			buf = bincode.AppendString(buf, c.Key)
			buf = binary.AppendUvarint(buf, idx(c.Region))
			buf = binary.AppendUvarint(buf, c.Inc)
			buf = binary.AppendUvarint(buf, c.Retire)
		}
		buf = binary.AppendUvarint(buf, uint64(len(r.Keys)))
		for _, k := range r.Keys {
			buf = bincode.AppendString(buf, k.Key)
			buf = binary.AppendVarint(buf, k.Demand)
			buf = binary.AppendVarint(buf, k.Position)
			buf = counters(buf, k.Gave)
			buf = counters(buf, k.Applied)
			buf = binary.AppendUvarint(buf, k.Retire)
		}
	}
	return buf
}

// Decode parses a version-2 message. Every error wraps ErrMalformed. The
// message's strings are in a copy of data, which the caller may reuse.
func Decode(data []byte) (Message, error) {
	if err := precheck(data); err != nil {
		return Message{}, err
	}
	return decode(string(data))
}

// DecodeOwned is Decode without the copy: the message's strings (keys,
// rules, regions) point into data itself, so the caller must not modify
// data afterwards, and a string of the message kept keeps all of data
// alive. For a buffer read once and then dropped (a message as it arrived:
// the agent's receive); one copy of every message less.
func DecodeOwned(data []byte) (Message, error) {
	if err := precheck(data); err != nil {
		return Message{}, err
	}
	return decode(unsafe.String(unsafe.SliceData(data), len(data)))
}

// precheck is Decode's checks before parsing.
func precheck(data []byte) error {
	if len(data) > MaxMessageSize {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrMalformed, len(data), MaxMessageSize)
	}
	if len(data) == 0 {
		return fmt.Errorf("%w: empty", ErrMalformed)
	}
	if data[0] != magicV2 {
		return fmt.Errorf("%w: unknown format byte 0x%02x", ErrMalformed, data[0])
	}
	return nil
}

// decode parses data, a message that passed precheck.
func decode(data string) (Message, error) {
	d := bincode.New(data, 1, ErrMalformed, MaxStringLen)
	var m Message
	m.From = d.Str()
	n := d.Count(minRegion)
	tab := make([]string, n)
	for i := range tab {
		tab[i] = d.Str()
		if d.Err() == nil && i > 0 && tab[i-1] >= tab[i] {
			d.Fail("region table not sorted and unique")
		}
	}
	used := make([]bool, n)
	region := func() string {
		i := d.Uvarint()
		if d.Err() != nil {
			return ""
		}
		if i >= uint64(n) {
			d.Fail("region index %d of %d", i, n)
			return ""
		}
		used[i] = true
		return tab[i]
	}
	counters := func() []ledger.Counter {
		c := d.Count(minCounter)
		if c == 0 {
			return nil
		}
		out := make([]ledger.Counter, c)
		for j := range out {
			out[j] = ledger.Counter{Region: region(), Inc: d.Uvarint(), Units: d.Varint()}
		}
		return out
	}
	nr := d.Count(minRule)
	if nr > 0 {
		m.Rules = make([]RuleReport, nr)
	}
	for i := range m.Rules {
		rr := &m.Rules[i]
		rr.Rule = d.Str()
		r := &rr.Report
		r.From, r.Inc, r.Seq, r.Base = m.From, d.Uvarint(), d.Uvarint(), d.Varint()
		if na := d.Count(minAck); na > 0 {
			r.Acks = make([]ledger.Ack, na)
			for j := range r.Acks {
				a := &r.Acks[j]
				a.Region, a.Inc, a.Seq = region(), d.Uvarint(), d.Uvarint()
				switch d.Byte() {
				case 0:
				case 1:
					a.Frozen = true
				default:
					d.Fail("frozen flag not 0 or 1")
				}
			}
		}
		if nc := d.Count(minClose); nc > 0 {
			r.Closes = make([]ledger.Closure, nc)
			for j := range r.Closes {
				c := &r.Closes[j]
				c.Key = d.Str()
				c.Region, c.Inc, c.Retire = region(), d.Uvarint(), d.Uvarint()
			}
		}
		if nk := d.Count(minKey); nk > 0 {
			r.Keys = make([]ledger.KeyReport, nk)
			for j := range r.Keys {
				k := &r.Keys[j]
				k.Key, k.Demand, k.Position = d.Str(), d.Varint(), d.Varint()
				k.Gave = counters()
				k.Applied = counters()
				k.Retire = d.Uvarint()
			}
		}
		if d.Err() != nil {
			break
		}
	}
	if d.Err() == nil && d.Rest() != 0 {
		d.Fail("%d bytes after the last rule", d.Rest())
	}
	if d.Err() == nil {
		for i, u := range used {
			if !u {
				d.Fail("region %q in the table is not used", tab[i])
				break
			}
		}
	}
	if d.Err() != nil {
		return Message{}, d.Err()
	}
	return m, nil
}
