package wire

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/apportion/apportion/sync/ledger"
)

var regionNames = []string{"ap-south", "eu-west", "us-east", "us-west"}

// testRegions is regionNames' list, every rule's in these tests.
var testRegions = mustRegions(regionNames...)

func testLists(string) *Regions { return testRegions }

func mustRegions(names ...string) *Regions {
	g, err := NewRegions(names)
	if err != nil {
		panic(err)
	}
	return g
}

func randCounters(rng *rand.Rand) []ledger.Counter {
	var out []ledger.Counter
	for _, r := range regionNames {
		if rng.Intn(3) == 0 {
			out = append(out, ledger.Counter{Region: r, Inc: uint64(rng.Intn(5)), Units: rng.Int63n(2_000_000) - 1000})
		}
	}
	return out
}

func randMessage(rng *rand.Rand) Message {
	m := Message{From: regionNames[rng.Intn(len(regionNames))], Version: 2 + rng.Intn(2)}
	for i := rng.Intn(4); i > 0; i-- {
		r := ledger.Report{From: m.From, Inc: uint64(rng.Intn(4)), Seq: rng.Uint64() >> uint(rng.Intn(64)), Base: rng.Int63n(1_000_000)}
		if rng.Intn(10) == 0 {
			r.Base = math.MinInt64
		}
		for _, reg := range regionNames {
			if rng.Intn(2) == 0 {
				r.Acks = append(r.Acks, ledger.Ack{Region: reg, Inc: uint64(rng.Intn(3) + 1), Seq: uint64(rng.Intn(1000)), Frozen: rng.Intn(4) == 0})
			}
		}
		for k := rng.Intn(6); k > 0; k-- {
			r.Keys = append(r.Keys, ledger.KeyReport{
				Key:      fmt.Sprintf("rl:{user:%d}:orders", rng.Intn(1000)),
				Demand:   rng.Int63n(3_000_000),
				Position: rng.Int63() >> uint(rng.Intn(63)),
				Gave:     randCounters(rng),
				Applied:  randCounters(rng),
				Retire:   uint64(rng.Intn(3)) * rng.Uint64() >> uint(rng.Intn(64)),
			})
		}
		for k := rng.Intn(3); k > 0; k-- {
			r.Closes = append(r.Closes, ledger.Closure{Key: fmt.Sprintf("rl:{user:%d}:orders", rng.Intn(1000)),
				Region: regionNames[rng.Intn(len(regionNames))], Inc: uint64(rng.Intn(4)), Retire: rng.Uint64() >> uint(rng.Intn(64))})
		}
		rr := RuleReport{Rule: fmt.Sprintf("rule-%d", rng.Intn(10)), Report: r}
		if m.Version == 3 {
			rr.Regions = testRegions
		}
		m.Rules = append(m.Rules, rr)
	}
	return m
}

func TestRoundTripProperty(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 2000; i++ {
		m := randMessage(rng)
		b, err := Encode(m)
		if err != nil {
			t.Fatalf("case %d: encode: %v", i, err)
		}
		b2, _ := Encode(m)
		if !bytes.Equal(b, b2) {
			t.Fatalf("case %d: encoding not deterministic", i)
		}
		got, err := Decode(b, testLists)
		if err != nil {
			t.Fatalf("case %d: decode: %v", i, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Fatalf("case %d: round trip\n got %+v\nwant %+v", i, got, m)
		}
		if got, err := DecodeOwned(b, testLists); err != nil || !reflect.DeepEqual(got, m) {
			t.Fatalf("case %d: DecodeOwned round trip: %v\n got %+v\nwant %+v", i, err, got, m)
		}
	}
}

func TestDecodeTruncatedAtEveryOffset(t *testing.T) {
	rng := rand.New(rand.NewSource(2))
	for i := 0; i < 50; i++ {
		m := randMessage(rng)
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		for n := 0; n < len(b); n++ {
			if _, err := Decode(b[:n], testLists); !errors.Is(err, ErrMalformed) {
				t.Fatalf("case %d: truncated at %d of %d: err %v, want ErrMalformed", i, n, len(b), err)
			}
		}
		if _, err := Decode(append(b, 0), testLists); !errors.Is(err, ErrMalformed) {
			t.Fatalf("case %d: trailing byte accepted: %v", i, err)
		}
	}
}

func TestDecodeMalformed(t *testing.T) {
	good, err := Encode(Message{Version: 2, From: "a", Rules: []RuleReport{{Rule: "r", Report: ledger.Report{From: "a", Inc: 1, Seq: 1,
		Acks: []ledger.Ack{{Region: "b", Inc: 1, Seq: 3}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	closing, err := Encode(Message{Version: 2, From: "a", Rules: []RuleReport{{Rule: "r", Report: ledger.Report{From: "a", Inc: 1, Seq: 1,
		Closes: []ledger.Closure{{Key: "k", Region: "b", Inc: 1, Retire: 7}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	// good: B2 01 'a' | 01 01 'b' | 01 | 01 'r' 01 01 00 | 01 00 01 03 00 | 00 | 00
	// good3: B3 01 'a' | 01 | 01 'r' digest[8] 01 01 00 | 01 05 01 03 | 00 |
	// 01 01 'k' 00 00 | 00 | 01 03 01 09 | 00 (ack of us-east, frozen;
	// a key with an applied counter of us-west)
	good3, err := Encode(Message{From: "a", Rules: []RuleReport{{Rule: "r", Regions: testRegions, Report: ledger.Report{From: "a", Inc: 1, Seq: 1,
		Acks: []ledger.Ack{{Region: "us-east", Inc: 1, Seq: 3, Frozen: true}},
		Keys: []ledger.KeyReport{{Key: "k", Applied: []ledger.Counter{{Region: "us-west", Inc: 1, Units: -5}}}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"version 1", append([]byte{0xB1}, good[1:]...)},
		{"huge string", []byte{magicV2, 0xff, 0xff, 0x03}},
		{"huge count", []byte{magicV2, 0x00, 0xff, 0xff, 0xff, 0xff, 0x0f}},
		{"non-minimal uvarint", []byte{magicV2, 0x80, 0x00, 0x00, 0x00}},
		{"uvarint overflow", []byte{magicV2, 0x00, 0x00, 0x01, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0x00, 0x00, 0x00, 0x00}},
		{"unsorted table", []byte{magicV2, 0x00, 0x02, 0x01, 'b', 0x01, 'a', 0x00}},
		{"unused table entry", []byte{magicV2, 0x00, 0x01, 0x01, 'b', 0x00}},
		{"bad region index", bytes.Replace(good, []byte{0x01, 0x00, 0x01, 0x03}, []byte{0x01, 0x05, 0x01, 0x03}, 1)},
		{"bad closure region index", bytes.Replace(closing, []byte{0x01, 'k', 0x00, 0x01, 0x07}, []byte{0x01, 'k', 0x05, 0x01, 0x07}, 1)},
		{"closure truncated", closing[:len(closing)-2]},
		{"bad frozen flag", bytes.Replace(good, []byte{0x01, 0x03, 0x00}, []byte{0x01, 0x03, 0x02}, 1)},
		{"trailing", append(append([]byte{}, good...), 0)},
		// Version 3, against testRegions (4 regions: indices 0..3, acks 0..7).
		{"v3 bad ack index", bytes.Replace(good3, []byte{0x05, 0x01, 0x03}, []byte{0x08, 0x01, 0x03}, 1)},
		{"v3 bad counter index", bytes.Replace(good3, []byte{0x01, 0x03, 0x01, 0x09}, []byte{0x01, 0x04, 0x01, 0x09}, 1)},
		{"v3 digest truncated", good3[:6]},
		{"v3 trailing", append(append([]byte{}, good3...), 0)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Decode(tc.data, testLists); !errors.Is(err, ErrMalformed) {
				t.Fatalf("err %v, want ErrMalformed", err)
			}
		})
	}
	for _, m := range [][]byte{good, closing, good3} {
		if _, err := Decode(m, testLists); err != nil {
			t.Fatalf("good message %x: %v", m, err)
		}
	}
}

func TestEncodeInvalid(t *testing.T) {
	long := strings.Repeat("x", MaxStringLen+1)
	for _, tc := range []struct {
		name string
		m    Message
	}{
		{"other sender", Message{From: "a", Rules: []RuleReport{{Rule: "r", Report: ledger.Report{From: "b"}}}}},
		{"long from", Message{From: long}},
		{"long rule", Message{From: "a", Rules: []RuleReport{{Rule: long, Report: ledger.Report{From: "a"}}}}},
		{"long key", Message{From: "a", Rules: []RuleReport{{Rule: "r", Regions: testRegions, Report: ledger.Report{From: "a", Keys: []ledger.KeyReport{{Key: long}}}}}}},
		{"version 4", Message{From: "a", Version: 4}},
		{"no region list", Message{From: "a", Rules: []RuleReport{{Rule: "r", Report: ledger.Report{From: "a"}}}}},
		{"region not in the list", Message{From: "a", Rules: []RuleReport{{Rule: "r", Regions: testRegions, Report: ledger.Report{From: "a",
			Acks: []ledger.Ack{{Region: "eu-north", Inc: 1, Seq: 1}}}}}}},
		{"counter region not in the list", Message{From: "a", Rules: []RuleReport{{Rule: "r", Regions: testRegions, Report: ledger.Report{From: "a",
			Keys: []ledger.KeyReport{{Key: "k", Gave: []ledger.Counter{{Region: "eu-north", Inc: 1, Units: 1}}}}}}}}},
		{"a report not read", Message{From: "a", Rules: []RuleReport{{Rule: "r", Regions: testRegions, Report: ledger.Report{From: "a"}, Err: ErrRegions}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Encode(tc.m); !errors.Is(err, ErrInvalid) {
				t.Fatalf("err %v, want ErrInvalid", err)
			}
		})
	}
}

// TestDecodeRegionLists: a version-3 rule report is read against the
// receiver's list of its rule only if the sender's has the same digest;
// otherwise that report alone comes back empty with Err set, and the
// message's other reports are read as sent.
func TestDecodeRegionLists(t *testing.T) {
	rep := func(rule string, g *Regions) RuleReport {
		return RuleReport{Rule: rule, Regions: g, Report: ledger.Report{From: "eu-west", Inc: 2, Seq: 9, Base: 100,
			Acks: []ledger.Ack{{Region: "us-east", Inc: 1, Seq: 4}},
			Keys: []ledger.KeyReport{{Key: "k", Demand: 5, Gave: []ledger.Counter{{Region: "ap-south", Inc: 1, Units: 30}}}}}}
	}
	// The sender lists three regions for "moved", the receiver four. The
	// indices of this report would even name the same regions, but the
	// rule is not the same rule on both sides (other peers, other
	// floors): the report is not read.
	three := mustRegions("ap-south", "eu-west", "us-east")
	m := Message{From: "eu-west", Rules: []RuleReport{rep("same", testRegions), rep("moved", three), rep("unknown", testRegions), rep("after", testRegions)}}
	b, err := Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Decode(b, func(rule string) *Regions {
		if rule == "unknown" {
			return nil
		}
		return testRegions
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Rules) != 4 {
		t.Fatalf("%d rule reports, want 4", len(got.Rules))
	}
	for _, i := range []int{0, 3} {
		if !reflect.DeepEqual(got.Rules[i], m.Rules[i]) {
			t.Errorf("rule %q: got %+v, want %+v", m.Rules[i].Rule, got.Rules[i], m.Rules[i])
		}
	}
	for i, want := range map[int]error{1: ErrRegions, 2: ErrUnknownRule} {
		rr := got.Rules[i]
		if !errors.Is(rr.Err, want) || rr.Regions != nil || !reflect.DeepEqual(rr.Report, ledger.Report{From: "eu-west"}) {
			t.Errorf("rule %q: Err %v, Regions %v, report %+v; want %v and an empty report", rr.Rule, rr.Err, rr.Regions, rr.Report, want)
		}
	}
	// A list with the same names in another order is the same list.
	if a, b := mustRegions("b", "a", "c"), mustRegions("c", "b", "a"); a.digest != b.digest || !slices.Equal(a.Names(), []string{"a", "b", "c"}) {
		t.Errorf("lists of the same names differ: %v %v", a.Names(), b.Names())
	}
	for _, bad := range [][]string{nil, {"a", "a"}, {""}} {
		if _, err := NewRegions(bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("NewRegions(%q): %v, want ErrInvalid", bad, err)
		}
	}
}

func TestEncodeSplit(t *testing.T) {
	rng := rand.New(rand.NewSource(3))
	for i := 0; i < 200; i++ {
		m := randMessage(rng)
		whole, _ := Encode(m)
		maxSize := 60 + rng.Intn(400)
		parts, err := EncodeSplit(m, maxSize)
		if errors.Is(err, ErrTooLarge) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(whole) <= maxSize && (len(parts) != 1 || !bytes.Equal(parts[0], whole)) {
			t.Fatalf("case %d: a message that fits was split", i)
		}
		// Concatenating the parts' reports (merging consecutive parts of one
		// rule report) gives back the message.
		var got []RuleReport
		for _, p := range parts {
			if len(p) > maxSize {
				t.Fatalf("case %d: part of %d bytes > %d", i, len(p), maxSize)
			}
			d, err := Decode(p, testLists)
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, d.Rules...)
		}
		var merged []RuleReport
		j := 0
		for _, want := range m.Rules {
			acc := got[j]
			j++
			for len(acc.Report.Keys) < len(want.Report.Keys) {
				acc.Report.Keys = append(acc.Report.Keys, got[j].Report.Keys...)
				j++
			}
			merged = append(merged, acc)
		}
		if j != len(got) || !reflect.DeepEqual(Message{From: m.From, Rules: merged, Version: m.Version}, m) {
			t.Fatalf("case %d: split parts do not give the message back", i)
		}
	}
}

func FuzzDecode(f *testing.F) {
	rng := rand.New(rand.NewSource(4))
	for i := 0; i < 20; i++ {
		b, _ := Encode(randMessage(rng))
		f.Add(b)
	}
	f.Add([]byte{magicV2})
	f.Add([]byte{magicV3})
	// rule-0..rule-9 have the test list but rule-5 (none) and rule-7 (a
	// list of other regions).
	other := mustRegions("ap-south", "eu-west", "us-east")
	lists := func(rule string) *Regions {
		switch rule {
		case "rule-5":
			return nil
		case "rule-7":
			return other
		}
		return testRegions
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := Decode(data, lists)
		// DecodeOwned (no copy) decodes and refuses alike.
		owned := append([]byte(nil), data...)
		mo, erro := DecodeOwned(owned, lists)
		if (err == nil) != (erro == nil) || err != nil && err.Error() != erro.Error() || !reflect.DeepEqual(m, mo) {
			t.Fatalf("Decode and DecodeOwned differ: %v, %v", err, erro)
		}
		// A reader's lists read what the ledger would accept alike.
		checkReadBy(t, data, lists, "eu-west")
		// Read a window of keys at a time, the message reads the same.
		for _, ls := range []Lists{lists, readBy(lists, "eu-west")} {
			for _, size := range []int{1, 2, 3, 1000} {
				checkWindows(t, data, ls, size)
			}
		}
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		for _, rr := range m.Rules {
			if rr.Err != nil { // read against no list or another one: cannot encode
				if rr.Regions != nil || !reflect.DeepEqual(rr.Report, ledger.Report{From: m.From}) {
					t.Fatalf("rule %q not read (%v) but has a report or a list", rr.Rule, rr.Err)
				}
				return
			}
		}
		b, err := Encode(m)
		if err != nil {
			t.Fatalf("decoded message does not encode: %v", err)
		}
		if !bytes.Equal(b, data) {
			t.Fatalf("not canonical: decode then encode changed the bytes")
		}
	})
}

// BenchmarkEncode reports bytes per key for a typical 3-region report: every
// key with one gift counter and one applied counter.
func BenchmarkEncode(b *testing.B) {
	m := typicalMessage(1000)
	var n int
	for b.Loop() {
		buf, err := Encode(m)
		if err != nil {
			b.Fatal(err)
		}
		n = len(buf)
	}
	b.ReportMetric(float64(n)/1000, "bytes/key")
}

// TestSizerExact: the sizes EncodeParts cuts by are the encoding's, with
// the message's own region table.
func TestSizerExact(t *testing.T) {
	rng := rand.New(rand.NewSource(5))
	for i := 0; i < 500; i++ {
		m := randMessage(rng)
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		z := newSizer(m)
		n := z.header(len(m.Rules))
		for _, rr := range m.Rules {
			n += z.ruleHeader(rr, len(rr.Report.Keys)) + z.keys(rr, rr.Report.Keys)
		}
		if n != len(b) {
			t.Fatalf("case %d: sizer %d bytes, encoding %d", i, n, len(b))
		}
	}
}

// BenchmarkEncodeParts splits a report of 100,000 keys (a full report of
// BenchmarkAgent100kKeys) into parts of at most 1 MiB, every part taken.
func BenchmarkEncodeParts(b *testing.B) {
	m := typicalMessage(100_000)
	b.ReportAllocs()
	for b.Loop() {
		parts, err := EncodeParts(m, 1<<20)
		if err != nil {
			b.Fatal(err)
		}
		for range parts {
		}
	}
}

// typicalMessage is a typical 3-region report of keys keys, every key with
// one gift counter and one applied counter.
func typicalMessage(keys int) Message {
	r := ledger.Report{From: "us-east", Inc: 1, Seq: 12345, Base: 450000,
		Acks: []ledger.Ack{{Region: "ap-south", Inc: 1, Seq: 12000}, {Region: "eu-west", Inc: 1, Seq: 12001}}}
	for i := 0; i < keys; i++ {
		r.Keys = append(r.Keys, ledger.KeyReport{Key: fmt.Sprintf("rl:{user:%06d}:orders", i), Demand: 300000, Position: 520000,
			Gave: []ledger.Counter{{Region: "eu-west", Inc: 1, Units: 70000}}, Applied: []ledger.Counter{{Region: "ap-south", Inc: 1, Units: 1000}}})
	}
	return Message{From: "us-east", Rules: []RuleReport{{Rule: "orders-free", Regions: typicalRegions, Report: r}}}
}

var typicalRegions = mustRegions("ap-south", "eu-west", "us-east")

func typicalLists(string) *Regions { return typicalRegions }

// checkReadBy decodes data with lists and with lists read by reader
// (Regions.ReadBy) and fails unless the two agree: the same error or none,
// and per rule report either the same Err, or for a report resolved
// without a reader, Err wrapping ledger.ErrMalformed if one of its
// counters fails the ledger's checks, else the same report with only the
// counters naming reader.
func checkReadBy(t *testing.T, data []byte, lists Lists, reader string) {
	t.Helper()
	byReader := readBy(lists, reader)
	m, err := Decode(data, lists)
	mr, errr := Decode(data, byReader)
	if (err == nil) != (errr == nil) || err != nil && err.Error() != errr.Error() {
		t.Fatalf("errors differ: %v, with a reader %v", err, errr)
	}
	if err != nil {
		return
	}
	if len(m.Rules) != len(mr.Rules) || m.From != mr.From || m.Version != mr.Version {
		t.Fatalf("messages differ: %d rules from %q, with a reader %d from %q", len(m.Rules), m.From, len(mr.Rules), mr.From)
	}
	for i, rr := range m.Rules {
		got := mr.Rules[i]
		if rr.Err != nil || rr.Regions == nil || rr.Regions.index(reader) < 0 || m.Version != 3 {
			if (rr.Err == nil) != (got.Err == nil) || !reflect.DeepEqual(rr.Report, got.Report) {
				t.Fatalf("rule %q: not read by %s alike: %v / %v", rr.Rule, reader, rr.Err, got.Err)
			}
			continue
		}
		ok := true
		want := rr.Report
		want.Keys = nil
		for _, k := range rr.Report.Keys {
			ok = ok && ledgerCountersOK(k.Gave, rr.Regions) && ledgerCountersOK(k.Applied, rr.Regions)
			k.Gave, k.Applied = naming(k.Gave, reader), naming(k.Applied, reader)
			want.Keys = append(want.Keys, k)
		}
		if !ok {
			if !errors.Is(got.Err, ledger.ErrMalformed) || !reflect.DeepEqual(got.Report, ledger.Report{From: m.From}) {
				t.Fatalf("rule %q: a counter the ledger refuses, read by %s: %v, %+v", rr.Rule, reader, got.Err, got.Report)
			}
			continue
		}
		if got.Err != nil || !reflect.DeepEqual(got.Report, want) {
			t.Fatalf("rule %q read by %s: %v\n%+v\nwant %+v", rr.Rule, reader, got.Err, got.Report, want)
		}
	}
}

// ledgerCountersOK is ledger.Receive's check of one counter list: every
// region in the list, sorted and unique, incarnations not 0, units not
// negative.
func ledgerCountersOK(cs []ledger.Counter, g *Regions) bool {
	for j, c := range cs {
		if g.index(c.Region) < 0 || c.Inc == 0 || c.Units < 0 || j > 0 && cs[j-1].Region >= c.Region {
			return false
		}
	}
	return true
}

func naming(cs []ledger.Counter, region string) []ledger.Counter {
	var out []ledger.Counter
	for _, c := range cs {
		if c.Region == region {
			out = append(out, c)
		}
	}
	return out
}

// TestReadBy: random messages, some with counters the ledger refuses
// (out of order, repeated, incarnation 0, negative units), read by every
// region of the list and by one outside it.
func TestReadBy(t *testing.T) {
	rng := rand.New(rand.NewSource(9))
	lists := func(string) *Regions { return testRegions }
	for i := 0; i < 3000; i++ {
		m := randMessage(rng)
		m.Version = 3
		for j := range m.Rules {
			m.Rules[j].Regions = testRegions
			for k := range m.Rules[j].Report.Keys {
				kr := &m.Rules[j].Report.Keys[k]
				for _, cs := range []*[]ledger.Counter{&kr.Gave, &kr.Applied} {
					if rng.Intn(3) == 0 {
						// Inc and Units as drawn (0 and negative at times);
						// else valid ones, so that most reports pass.
						continue
					}
					for n := range *cs {
						(*cs)[n].Inc, (*cs)[n].Units = (*cs)[n].Inc+1, max(0, (*cs)[n].Units)
					}
					if len(*cs) > 1 && rng.Intn(20) == 0 {
						(*cs)[0], (*cs)[1] = (*cs)[1], (*cs)[0]
					} else if len(*cs) > 0 && rng.Intn(20) == 0 {
						*cs = append(*cs, (*cs)[len(*cs)-1])
					}
				}
			}
		}
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		for _, reader := range append(slices.Clone(regionNames), "sa-east") {
			checkReadBy(t, b, lists, reader)
		}
	}
	if _, err := testRegions.ReadBy("sa-east"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("ReadBy of a region not in the list: %v, want ErrInvalid", err)
	}
}

// BenchmarkDecode decodes a report of 1,000 keys as a receiver reads it
// (DecodeOwned against its own list, Regions.ReadBy) and, for comparison,
// whole (reader=none). At 3 regions each key has one gift counter and one
// applied counter (typicalMessage); at 10 every key has a counter of each
// kind for every peer (one hot key's shares moving among ten regions).
//
//	go test -run '^$' -bench Decode -benchmem ./sync/wire/
func BenchmarkDecode(b *testing.B) {
	ten := []string{"af-south", "ap-east", "ap-south", "eu-north", "eu-west", "me-south", "sa-east", "us-east", "us-west", "ca-central"}
	for _, regions := range []int{3, 10} {
		var m Message
		var g *Regions
		reader := "eu-west"
		if regions == 3 {
			m, g = typicalMessage(1000), typicalRegions
		} else {
			g = mustRegions(ten...)
			r := ledger.Report{From: "us-east", Inc: 1, Seq: 12345, Base: 0}
			var cs []ledger.Counter
			for _, n := range g.Names() {
				if n != "us-east" {
					cs = append(cs, ledger.Counter{Region: n, Inc: 3, Units: 70000})
				}
			}
			for i := 0; i < 1000; i++ {
				r.Keys = append(r.Keys, ledger.KeyReport{Key: fmt.Sprintf("rl:{user:%06d}:orders", i), Demand: 300000, Position: 100000, Gave: cs, Applied: cs})
			}
			m = Message{From: "us-east", Rules: []RuleReport{{Rule: "orders-free", Regions: g, Report: r}}}
		}
		data, err := Encode(m)
		if err != nil {
			b.Fatal(err)
		}
		rg, err := g.ReadBy(reader)
		if err != nil {
			b.Fatal(err)
		}
		for _, c := range []struct {
			name string
			g    *Regions
		}{{"none", g}, {reader, rg}} {
			b.Run(fmt.Sprintf("regions=%d/reader=%s", regions, c.name), func(b *testing.B) {
				b.ReportAllocs()
				lists := func(string) *Regions { return c.g }
				for b.Loop() {
					if _, err := DecodeOwned(data, lists); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(len(data))/1000, "wire-B/key")
			})
		}
	}
}

// readBy is lists as region reader reads them (Regions.ReadBy), each list
// that does not name reader as it is.
func readBy(lists Lists, reader string) Lists {
	return func(rule string) *Regions {
		g := lists(rule)
		if g == nil {
			return nil
		}
		r, err := g.ReadBy(reader)
		if err != nil {
			return g // reader not in this list: read as before
		}
		return r
	}
}

// checkWindows checks that DecodeWindowsFromOwned, windows of size keys,
// refuses what DecodeFromOwned refuses, and otherwise yields each rule
// report in order, by windows of at most size keys with the report's
// header, whose keys make the report's keys.
func checkWindows(t *testing.T, data []byte, lists Lists, size int) {
	t.Helper()
	from := "x"
	if m, err := Decode(data, lists); err == nil {
		from = m.From
	}
	own := append([]byte(nil), data...)
	want, err := DecodeFromOwned(from, own, lists)
	own2 := append([]byte(nil), data...)
	head, seq, errw := DecodeWindowsFromOwned(from, own2, lists, size)
	if (err == nil) != (errw == nil) || err != nil && err.Error() != errw.Error() {
		t.Fatalf("window %d: errors differ: %v, by windows %v", size, err, errw)
	}
	if err != nil {
		return
	}
	if head.From != want.From || head.Version != want.Version || len(head.Rules) != len(want.Rules) {
		t.Fatalf("window %d: header differs", size)
	}
	i, j := 0, 0 // the rule report, and its keys yielded so far
	for m := range seq {
		if len(m.Rules) != 1 || m.From != want.From || m.Version != want.Version || i >= len(want.Rules) {
			t.Fatalf("window %d: a window of %d rules from %q after %d reports", size, len(m.Rules), m.From, i)
		}
		got, rr := m.Rules[0], want.Rules[i]
		if head.Rules[i].Rule != rr.Rule || (head.Rules[i].Err == nil) != (rr.Err == nil) || head.Rules[i].Report.Keys != nil {
			t.Fatalf("window %d: rule %q: the first pass read %+v", size, rr.Rule, head.Rules[i])
		}
		if got.Rule != rr.Rule || !reflect.DeepEqual(got.Regions, rr.Regions) || (got.Err == nil) != (rr.Err == nil) || got.Err != nil && got.Err.Error() != rr.Err.Error() {
			t.Fatalf("window %d: rule %q read as %q (%v, want %v)", size, rr.Rule, got.Rule, got.Err, rr.Err)
		}
		h, wh := got.Report, rr.Report
		h.Keys, wh.Keys = nil, nil
		if !reflect.DeepEqual(h, wh) {
			t.Fatalf("window %d: rule %q: header %+v, want %+v", size, rr.Rule, h, wh)
		}
		n := len(got.Report.Keys)
		if n > size || n == 0 && len(rr.Report.Keys) > 0 || j+n > len(rr.Report.Keys) || !reflect.DeepEqual(got.Report.Keys, rr.Report.Keys[j:j+n:j+n]) && n > 0 {
			t.Fatalf("window %d: rule %q: %d keys at %d of %d, or other keys", size, rr.Rule, n, j, len(rr.Report.Keys))
		}
		if j += n; j == len(rr.Report.Keys) {
			i, j = i+1, 0
		}
	}
	if i != len(want.Rules) {
		t.Fatalf("window %d: %d of %d rule reports yielded", size, i, len(want.Rules))
	}
}
