// Package wire is the binary encoding of the sync agents' report messages:
// one NATS message per region per sync interval carrying the ledger Report
// of every global rule the region coordinates, and (sign.go) the signed
// envelope every message travels in: Signer.Seal and Verifier.Open.
//
// Invariants:
//   - Deterministic and canonical. Encode of a Message always yields the same
//     bytes, and Decode accepts only canonical encodings (minimal uvarints,
//     region indices within the rule's region list, flags 0 or 1, nothing
//     after the last rule; in version 2 a sorted region table whose every
//     entry is used), so Decode(data) succeeding with every rule report
//     resolved, against lists without a reader (Regions.ReadBy), implies
//     Encode(decoded) == data (FuzzDecode checks it).
//   - Malformed input never panics and never yields a partial Message:
//     Decode returns a complete Message or an error wrapping ErrMalformed.
//     Decode allocates at most a constant factor of its input, which is
//     itself bounded by MaxMessageSize; every count is checked against the
//     bytes left before anything is allocated. DecodeWindowsFromOwned
//     checks the whole message the same way, keeping no key, before it
//     yields any window of keys (FuzzDecode: the windows make the message
//     Decode reads, and it refuses what Decode refuses).
//   - A region index is read against the receiver's own region list of the
//     rule, and only if that list's digest equals the one the sender wrote:
//     a rule report whose sender lists the rule's regions otherwise (a rule
//     being changed, a rule the receiver does not coordinate) decodes with
//     RuleReport.Err set and an empty report, and never names a region the
//     sender did not mean. The other rule reports of the message are not
//     affected.
//   - The wire carries the ledger's fields faithfully; it does not judge
//     them (a zero incarnation or an unsorted key list decodes fine and is
//     rejected by ledger.Receive, which changes nothing on rejection). The
//     one exception is a receiver's list (Regions.ReadBy): the counters a
//     receiver would not read are left out, after the checks the ledger
//     would have made of them.
//
// # Format (version 3)
//
//	magic    byte 0xB3 (format version 3)
//	from     string                the sending region
//	nrules   uvarint
//	nrules x rule report:
//	  rule    string
//	  regions 8 bytes              digest of the rule's region list (Regions)
//	  inc    uvarint
//	  seq    uvarint
//	  base   varint
//	  nacks  uvarint
//	  nacks x: region*2+frozen uvarint, inc uvarint, seq uvarint
//	  ncloses uvarint
//	  ncloses x: key string, region uvarint, inc uvarint, retire uvarint
//	  nkeys  uvarint
//	  nkeys x:
//	    key      string
//	    demand   varint
//	    position varint
//	    ngave    uvarint, ngave x counter
//	    napplied uvarint, napplied x counter
//	    retire   uvarint
//	counter: region uvarint, inc uvarint, units varint
//
// A region is its index in the rule's regions sorted by name, which every
// region of the rule knows from the rule itself: the names do not travel.
// The digest is the first 8 bytes of SHA-256 over the sorted names, each
// preceded by its length as a uvarint.
//
// Version 2 (magic 0xB2), which Decode still reads and Encode writes for a
// Message with Version 2 (an agent of a deployment some of whose agents
// read only version 2: syncagent --wire-version), has no digest and names
// regions by index in a table after from, nregions uvarint and nregions
// strings, sorted, unique and each used; its acks are region uvarint, inc,
// seq and a frozen byte (0 or 1). Its table was a quarter of a ten-region
// message (97 of about 380 bytes with the signature and framing).
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
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"iter"
	"slices"
	"unsafe"

	"github.com/apportion/apportion/internal/bincode"
	"github.com/apportion/apportion/sync/ledger"
)

// Message is one region's report message: the reports of its ledgers.
type Message struct {
	From  string
	Rules []RuleReport
	// Version is the format the message is encoded in: 0 or 3 for version
	// 3, 2 for version 2. Decode sets it to the version it read.
	Version int
}

// RuleReport is the ledger Report of one global rule. Report.From must equal
// the message's From.
type RuleReport struct {
	Rule string
	// Regions is the rule's region list, which names the regions of the
	// report in version 3: Encode requires it (every region the report
	// names must be in it); Decode sets it to the receiver's list it
	// resolved the report with (nil in version 2).
	Regions *Regions
	Report  ledger.Report
	// Err is set by Decode, with an empty Report, when the report could not
	// be read against the receiver's region list of the rule: it wraps
	// ErrUnknownRule (no list) or ErrRegions (a list of other regions).
	Err error
}

const (
	// magicV2 and magicV3 open every message of their version. A new format
	// gets a new byte (version 1, 0xB1, had no retirement fields).
	magicV2 = 0xB2
	magicV3 = 0xB3
	// MaxStringLen bounds a region, rule or key.
	MaxStringLen = 4096
	// MaxMessageSize bounds an encoded message (the NATS hard payload limit).
	MaxMessageSize = 64 << 20
	// digestLen is the size of a region list's digest in version 3.
	digestLen = 8
)

var (
	// ErrMalformed is wrapped by every Decode error.
	ErrMalformed = errors.New("wire: malformed message")
	// ErrInvalid is wrapped by Encode errors about a message that cannot be
	// represented (a rule report from another region, a string too long, a
	// region not in the rule's list).
	ErrInvalid = errors.New("wire: invalid message")
	// ErrTooLarge is returned when a message (or, for EncodeSplit, one key
	// of it with its rule header) does not fit the size limit.
	ErrTooLarge = errors.New("wire: message too large")
	// ErrUnknownRule is a RuleReport.Err: the receiver has no region list
	// of the rule (it does not coordinate it, or is starting it).
	ErrUnknownRule = errors.New("wire: no region list for the rule")
	// ErrRegions is a RuleReport.Err: the sender's region list of the rule
	// is not the receiver's (its digest differs).
	ErrRegions = errors.New("wire: the sender's region list of the rule differs")
)

// Regions is a rule's region list as version 3 names regions: sorted by
// name, with its digest. It is immutable; share one per rule.
type Regions struct {
	names  []string
	digest [digestLen]byte
	// reader is 1 + the index of the region that reads reports with this
	// list (ReadBy), 0 for none.
	reader int
}

// NewRegions returns the list of names (in any order). Names must be
// non-empty, unique and at most MaxStringLen bytes.
func NewRegions(names []string) (*Regions, error) {
	s := slices.Clone(names)
	slices.Sort(s)
	if len(s) == 0 {
		return nil, fmt.Errorf("%w: empty region list", ErrInvalid)
	}
	for i, n := range s {
		switch {
		case n == "" || len(n) > MaxStringLen:
			return nil, fmt.Errorf("%w: region name of %d bytes", ErrInvalid, len(n))
		case i > 0 && s[i-1] == n:
			return nil, fmt.Errorf("%w: region %q listed twice", ErrInvalid, n)
		}
	}
	h := sha256.New()
	var buf []byte
	for _, n := range s {
		buf = bincode.AppendString(buf[:0], n)
		h.Write(buf)
	}
	g := &Regions{names: s}
	copy(g.digest[:], h.Sum(nil))
	return g, nil
}

// ReadBy returns the list as region reader reads reports with it: a report
// decoded against it keeps, of each key's counters (Gave and Applied),
// only those that name reader, the only ones a ledger of reader looks at
// (ledger.Receive, its checks included). At ten regions a key report
// carries up to 18 counters, and a receiver keeps at most 2.
//
// The counters left out are checked first as ledger.Receive checks them
// all (regions sorted and unique, a nonzero incarnation, units not
// negative): a rule report with one that fails decodes with Err wrapping
// ledger.ErrMalformed and an empty report, as the ledger would reject it
// whole, and the message's other rule reports are read as usual. The
// list encodes as the list it came from. It fails if reader is not in
// the list.
func (g *Regions) ReadBy(reader string) (*Regions, error) {
	i := g.index(reader)
	if i < 0 {
		return nil, fmt.Errorf("%w: reader %q not in the region list", ErrInvalid, reader)
	}
	c := *g
	c.reader = i + 1
	return &c, nil
}

// Names returns the sorted names (the caller must not modify them).
func (g *Regions) Names() []string { return g.names }

// index is the index of name, or -1.
func (g *Regions) index(name string) int {
	i, ok := slices.BinarySearch(g.names, name)
	if !ok {
		return -1
	}
	return i
}

// Lists gives a receiver's region list of a rule, nil if it has none.
type Lists func(rule string) *Regions

// Minimal encoded sizes, used to bound counts before allocating.
const (
	minRegion  = 1 // empty string
	minRule    = 7 // rule, inc, seq, base, nacks, ncloses, nkeys
	minAck     = 3 // version 3; version 2's is 4
	minClose   = 4 // key, region, inc, retire
	minKey     = 6 // key, demand, position, ngave, napplied, retire
	minCounter = 3
)

// Encode returns the encoding of m in its Version.
func Encode(m Message) ([]byte, error) {
	if err := validate(m); err != nil {
		return nil, err
	}
	z := newSizer(m)
	buf := z.appendMessage(nil, m.Rules)
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
// (sizer): one pass over the keys, then one encoding of each part. In
// version 2 a part's size is counted with the whole message's region
// table, an upper bound of its own (a part's table is a subset, so its
// indices are no larger), so a part may end a few bytes short of maxSize
// but never exceeds it; a key whose bound alone exceeds maxSize but whose
// exact encoding fits travels alone. In version 3 the sizes are exact.
func EncodeParts(m Message, maxSize int) (iter.Seq[[]byte], error) {
	if err := validate(m); err != nil {
		return nil, err
	}
	maxSize = min(maxSize, MaxMessageSize)
	z := newSizer(m)
	body := make([]int, len(m.Rules)) // each rule report's size, header and keys
	total := z.header(len(m.Rules))
	for i, rr := range m.Rules {
		body[i] = z.ruleHeader(rr, len(rr.Report.Keys)) + z.keys(rr, rr.Report.Keys)
		total += body[i]
	}
	if total <= maxSize { // exact: the whole message's own table
		return func(yield func([]byte) bool) { yield(z.appendMessage(make([]byte, 0, total), m.Rules)) }, nil
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
				ks := z.key(rr, keys[n])
				if one+z.ruleHeader(rr, n+1)+sum+ks > maxSize {
					break
				}
				n, sum = n+1, sum+ks
			}
			part := rr
			if n == 0 {
				part.Report.Keys = keys[:1]
				if size(m, []RuleReport{part}) > maxSize {
					return nil, fmt.Errorf("%w: rule %q key %q does not fit in %d bytes", ErrTooLarge, rr.Rule, keys[0].Key, maxSize)
				}
				n, sum = 1, maxSize // fits alone, exactly: travels alone
			}
			part.Report.Keys = keys[:n]
			pieces = append(pieces, piece{part, z.ruleHeader(rr, n) + sum})
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
			sub := Message{From: m.From, Rules: cur, Version: m.Version}
			buf := make([]byte, 0, min(z.header(len(cur))+sum, maxSize)) // the bound: no growth
			cur, sum = nil, 0
			return yield(newSizer(sub).appendMessage(buf, sub.Rules))
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

// sizer computes encoded sizes without encoding, and encodes: the names of
// regions are indices into the message's table (version 2) or into each
// rule report's Regions (version 3).
type sizer struct {
	from string
	v2   bool
	tab  []string // version 2's table
	head int      // header's size but for its count of rule reports (computed once)
}

func newSizer(m Message) sizer {
	z := sizer{from: m.From, v2: m.Version == 2}
	z.head = 1 + bincode.StringLen(z.from)
	if z.v2 {
		z.tab = regionTable(m)
		z.head += bincode.UvarintLen(uint64(len(z.tab)))
		for _, r := range z.tab {
			z.head += bincode.StringLen(r)
		}
	}
	return z
}

// index is the index of a region of rr (validate checked it is there).
func (z sizer) index(rr RuleReport, name string) uint64 {
	if z.v2 {
		i, _ := slices.BinarySearch(z.tab, name)
		return uint64(i)
	}
	return uint64(rr.Regions.index(name))
}

func (z sizer) idx(rr RuleReport, name string) int { return bincode.UvarintLen(z.index(rr, name)) }

// header is the size of a message's header with nrules rule reports.
func (z sizer) header(nrules int) int { return z.head + bincode.UvarintLen(uint64(nrules)) }

// ruleHeader is the size of a rule report's header with nkeys keys (the
// keys not included).
func (z sizer) ruleHeader(rr RuleReport, nkeys int) int {
	r := rr.Report
	n := bincode.StringLen(rr.Rule) + bincode.UvarintLen(r.Inc) + bincode.UvarintLen(r.Seq) + varintLen(r.Base)
	if !z.v2 {
		n += digestLen
	}
	n += bincode.UvarintLen(uint64(len(r.Acks)))
	for _, a := range r.Acks {
		if z.v2 {
			n += z.idx(rr, a.Region) + 1
		} else {
			n += bincode.UvarintLen(z.index(rr, a.Region)<<1 | 1)
		}
		n += bincode.UvarintLen(a.Inc) + bincode.UvarintLen(a.Seq)
	}
	n += bincode.UvarintLen(uint64(len(r.Closes)))
	for _, c := range r.Closes {
		n += bincode.StringLen(c.Key) + z.idx(rr, c.Region) + bincode.UvarintLen(c.Inc) + bincode.UvarintLen(c.Retire)
	}
	return n + bincode.UvarintLen(uint64(nkeys))
}

func (z sizer) keys(rr RuleReport, ks []ledger.KeyReport) int {
	n := 0
	for _, k := range ks {
		n += z.key(rr, k)
	}
	return n
}

func (z sizer) key(rr RuleReport, k ledger.KeyReport) int {
	n := bincode.StringLen(k.Key) + varintLen(k.Demand) + varintLen(k.Position) + bincode.UvarintLen(k.Retire)
	for _, cs := range [2][]ledger.Counter{k.Gave, k.Applied} {
		n += bincode.UvarintLen(uint64(len(cs)))
		for _, c := range cs {
			n += z.idx(rr, c.Region) + bincode.UvarintLen(c.Inc) + varintLen(c.Units)
		}
	}
	return n
}

// varintLen is the length of binary.AppendVarint(nil, v).
func varintLen(v int64) int { return bincode.UvarintLen(uint64(v)<<1 ^ uint64(v>>63)) }

// size is the exact encoded size of a message of m's sender and version
// with the rule reports rs.
func size(m Message, rs []RuleReport) int {
	sub := Message{From: m.From, Rules: rs, Version: m.Version}
	return len(newSizer(sub).appendMessage(nil, rs))
}

func validate(m Message) error {
	long := func(s string) bool { return len(s) > MaxStringLen }
	if m.Version != 0 && m.Version != 2 && m.Version != 3 {
		return fmt.Errorf("%w: format version %d (2 or 3)", ErrInvalid, m.Version)
	}
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
		if rr.Err != nil {
			return fmt.Errorf("%w: rule %q: a report that was not read: %w", ErrInvalid, rr.Rule, rr.Err)
		}
		if m.Version != 2 && rr.Regions == nil {
			return fmt.Errorf("%w: rule %q: no region list", ErrInvalid, rr.Rule)
		}
		region := func(name string) error {
			if m.Version == 2 {
				if long(name) {
					return fmt.Errorf("%w: region longer than %d bytes", ErrInvalid, MaxStringLen)
				}
				return nil
			}
			if rr.Regions.index(name) < 0 {
				return fmt.Errorf("%w: rule %q: region %q not in the rule's region list", ErrInvalid, rr.Rule, name)
			}
			return nil
		}
		for _, a := range r.Acks {
			if err := region(a.Region); err != nil {
				return err
			}
		}
		for _, c := range r.Closes {
			if long(c.Key) {
				return fmt.Errorf("%w: closure key longer than %d bytes", ErrInvalid, MaxStringLen)
			}
			if err := region(c.Region); err != nil {
				return err
			}
		}
		for _, k := range r.Keys {
			if long(k.Key) {
				return fmt.Errorf("%w: rule %q: key longer than %d bytes", ErrInvalid, rr.Rule, MaxStringLen)
			}
			for _, cs := range [2][]ledger.Counter{k.Gave, k.Applied} {
				for _, c := range cs {
					if err := region(c.Region); err != nil {
						return err
					}
				}
			}
		}
	}
	return nil
}

// regionTable returns the sorted, unique regions the acks and counters
// name (version 2). It allocates the table only: a region is looked up in
// it (a few entries) before it is added, not collected once per counter.
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

func (z sizer) appendMessage(buf []byte, rs []RuleReport) []byte {
	if z.v2 {
		buf = append(buf, magicV2)
		buf = bincode.AppendString(buf, z.from)
		buf = binary.AppendUvarint(buf, uint64(len(z.tab)))
		for _, r := range z.tab {
			buf = bincode.AppendString(buf, r)
		}
	} else {
		buf = append(buf, magicV3)
		buf = bincode.AppendString(buf, z.from)
	}
	buf = binary.AppendUvarint(buf, uint64(len(rs)))
	for _, rr := range rs {
		counters := func(buf []byte, cs []ledger.Counter) []byte {
			buf = binary.AppendUvarint(buf, uint64(len(cs)))
			for _, c := range cs {
				buf = binary.AppendUvarint(buf, z.index(rr, c.Region))
				buf = binary.AppendUvarint(buf, c.Inc)
				buf = binary.AppendVarint(buf, c.Units)
			}
			return buf
		}
		r := rr.Report
		buf = bincode.AppendString(buf, rr.Rule)
		if !z.v2 {
			buf = append(buf, rr.Regions.digest[:]...)
		}
		buf = binary.AppendUvarint(buf, r.Inc)
		buf = binary.AppendUvarint(buf, r.Seq)
		buf = binary.AppendVarint(buf, r.Base)
		buf = binary.AppendUvarint(buf, uint64(len(r.Acks)))
		for _, a := range r.Acks {
			var f byte
			if a.Frozen {
				f = 1
			}
			if z.v2 {
				buf = binary.AppendUvarint(buf, z.index(rr, a.Region))
				buf = binary.AppendUvarint(buf, a.Inc)
				buf = binary.AppendUvarint(buf, a.Seq)
				buf = append(buf, f)
				continue
			}
			buf = binary.AppendUvarint(buf, z.index(rr, a.Region)<<1|uint64(f))
			buf = binary.AppendUvarint(buf, a.Inc)
			buf = binary.AppendUvarint(buf, a.Seq)
		}
		buf = binary.AppendUvarint(buf, uint64(len(r.Closes)))
		for _, c := range r.Closes {
			buf = bincode.AppendString(buf, c.Key)
			buf = binary.AppendUvarint(buf, z.index(rr, c.Region))
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

// Decode parses a message, reading each rule report's regions of version 3
// against lists (which may be nil: every such report then has Err set).
// Every error wraps ErrMalformed. The message's strings are in a copy of
// data, which the caller may reuse.
func Decode(data []byte, lists Lists) (Message, error) {
	if err := precheck(data); err != nil {
		return Message{}, err
	}
	return decode(string(data), lists, nil)
}

// DecodeOwned is Decode without the copy: the message's strings (keys,
// rules, regions) point into data itself, so the caller must not modify
// data afterwards, and a string of the message kept keeps all of data
// alive. For a buffer read once and then dropped (a message as it arrived:
// the agent's receive); one copy of every message less.
func DecodeOwned(data []byte, lists Lists) (Message, error) {
	if err := precheck(data); err != nil {
		return Message{}, err
	}
	return decode(unsafe.String(unsafe.SliceData(data), len(data)), lists, nil)
}

// precheck is Decode's checks before parsing.
func precheck(data []byte) error {
	if len(data) > MaxMessageSize {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrMalformed, len(data), MaxMessageSize)
	}
	if len(data) == 0 {
		return fmt.Errorf("%w: empty", ErrMalformed)
	}
	if data[0] != magicV2 && data[0] != magicV3 {
		return fmt.Errorf("%w: unknown format byte 0x%02x", ErrMalformed, data[0])
	}
	return nil
}

// windows makes decode read each rule report's keys a window at a time
// into one reused slice (DecodeWindowsFromOwned).
type windows struct {
	size int // keys per window, > 0
	// emit receives every rule report in message order, one per window of
	// its keys (a report without keys, or with Err, once); nil: validate
	// only (decode returns the reports without their keys). It returns
	// false to stop.
	emit func(RuleReport) bool
	// errs are the first pass's Err per rule report: a report read with
	// an error there is emitted once, with its error, not by windows.
	errs []error
}

// errStopped ends decode when windows.emit returned false.
var errStopped = errors.New("wire: stopped")

// decode parses data, a message that passed precheck; with w, a window of
// keys at a time (windows).
func decode(data string, lists Lists, w *windows) (Message, error) {
	d := bincode.New(data, 1, ErrMalformed, MaxStringLen)
	m := Message{Version: 3}
	v2 := data[0] == magicV2
	m.From = d.Str()
	var tab []string // version 2's table, or the current rule's list
	var used []bool  // version 2: table entries used
	var rules *Regions
	if v2 {
		m.Version = 2
		n := d.Count(minRegion)
		tab = make([]string, n)
		for i := range tab {
			tab[i] = d.Str()
			if d.Err() == nil && i > 0 && tab[i-1] >= tab[i] {
				d.Fail("region table not sorted and unique")
			}
		}
		used = make([]bool, n)
	}
	// resolved is false while reading a version-3 report that has no
	// list: its indices are read (each a minimal uvarint) but name nothing.
	resolved := true
	name := func(i uint64) string {
		if d.Err() != nil || !resolved {
			return ""
		}
		if i >= uint64(len(tab)) {
			d.Fail("region index %d of %d", i, len(tab))
			return ""
		}
		if v2 {
			used[i] = true
		}
		return tab[i]
	}
	region := func() string { return name(d.Uvarint()) }
	// reader: the index in tab of the region reading the current rule
	// report (Regions.ReadBy), -1 for none; bad: a counter left out
	// failed the ledger's checks; arena: the kept counters of the
	// current rule report, cut as it fills (a few allocations, not one
	// per key).
	reader, bad := -1, false
	var arena []ledger.Counter
	counters := func(keysLeft int) []ledger.Counter {
		c := d.Count(minCounter)
		if c == 0 {
			return nil
		}
		if reader < 0 {
			out := make([]ledger.Counter, c)
			for j := range out {
				out[j] = ledger.Counter{Region: region(), Inc: d.Uvarint(), Units: d.Varint()}
			}
			return out
		}
		start, prev := len(arena), -1
		for range c {
			x := d.Uvarint()
			if d.Err() == nil && x >= uint64(len(tab)) {
				d.Fail("region index %d of %d", x, len(tab)) // as name() fails
			}
			inc, units := d.Uvarint(), d.Varint()
			if d.Err() != nil {
				return nil
			}
			if int(x) <= prev || inc == 0 || units < 0 {
				bad = true
			}
			prev = int(x)
			if int(x) == reader {
				if len(arena) == cap(arena) {
					// A window's keys read at most two counters
					// each (one of each kind names the reader):
					// with w, one array per window, used again.
					size := 512
					if w != nil {
						size = 2 * w.size
					}
					arena, start = make([]ledger.Counter, 0, min(2*keysLeft, size)), 0
				}
				arena = append(arena, ledger.Counter{Region: tab[x], Inc: inc, Units: units})
			}
		}
		if len(arena) == start {
			return nil
		}
		return arena[start:len(arena):len(arena)]
	}
	nr := d.Count(minRule)
	if nr > 0 {
		m.Rules = make([]RuleReport, nr)
	}
	for i := range m.Rules {
		rr := &m.Rules[i]
		rr.Rule = d.Str()
		if !v2 {
			var sum [digestLen]byte
			for j := range sum {
				sum[j] = d.Byte()
			}
			rules, resolved, tab = nil, false, nil
			reader, bad, arena = -1, false, nil
			if d.Err() == nil {
				if lists != nil {
					rules = lists(rr.Rule)
				}
				switch {
				case rules == nil:
					rr.Err = fmt.Errorf("%w %q", ErrUnknownRule, rr.Rule)
				case rules.digest != sum:
					rr.Err = fmt.Errorf("%w: rule %q, sender %q", ErrRegions, rr.Rule, m.From)
				default:
					resolved, tab, reader = true, rules.names, rules.reader-1
				}
			}
		}
		r := &rr.Report
		r.From, r.Inc, r.Seq, r.Base = m.From, d.Uvarint(), d.Uvarint(), d.Varint()
		ackMin := minAck
		if v2 {
			ackMin++
		}
		if na := d.Count(ackMin); na > 0 {
			r.Acks = make([]ledger.Ack, na)
			for j := range r.Acks {
				a := &r.Acks[j]
				if v2 {
					a.Region, a.Inc, a.Seq = region(), d.Uvarint(), d.Uvarint()
					switch d.Byte() {
					case 0:
					case 1:
						a.Frozen = true
					default:
						d.Fail("frozen flag not 0 or 1")
					}
					continue
				}
				x := d.Uvarint()
				a.Region, a.Frozen = name(x>>1), x&1 == 1
				a.Inc, a.Seq = d.Uvarint(), d.Uvarint()
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
		last := 0 // with w: the keys of the last window
		if nk := d.Count(minKey); nk > 0 {
			n := nk
			if w != nil {
				n = min(nk, w.size)
			}
			r.Keys = make([]ledger.KeyReport, n)
			for j := range nk {
				k := &r.Keys[j%n] // j itself without w (n == nk)
				k.Key, k.Demand, k.Position = d.Str(), d.Varint(), d.Varint()
				k.Gave = counters(nk - j)
				k.Applied = counters(nk - j)
				k.Retire = d.Uvarint()
				if w == nil || (j+1)%n != 0 || j+1 == nk || d.Err() != nil {
					continue
				}
				// A whole window, not the last: emitted (a report the
				// first pass read without error), then its slice and
				// counters are used again.
				if w.emit != nil && w.errs[i] == nil && rr.Err == nil && !bad {
					part := *rr
					part.Regions = rules
					if !w.emit(part) {
						return Message{}, errStopped
					}
				}
				clear(r.Keys)
				arena = arena[:0]
			}
			last = (nk-1)%n + 1
		}
		if d.Err() != nil {
			break
		}
		if bad && rr.Err == nil {
			rr.Err = fmt.Errorf("%w: counters (a region out of order or twice, an incarnation 0 or negative units)", ledger.ErrMalformed)
		}
		if rr.Err != nil {
			rr.Report = ledger.Report{From: m.From}
		} else {
			rr.Regions = rules
		}
		if w != nil {
			if w.emit == nil {
				r.Keys = nil // validated: the second pass reads them
				continue
			}
			part := *rr
			if part.Err == nil && last > 0 {
				part.Report.Keys = r.Keys[:last]
			}
			if !w.emit(part) {
				return Message{}, errStopped
			}
			*rr = RuleReport{} // emitted: the message keeps none of it
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
