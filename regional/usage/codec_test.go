package usage

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
)

// equalBatch compares batches, treating nil and empty Deltas alike.
func equalBatch(a, b Batch) bool {
	if len(a.Deltas) == 0 && len(b.Deltas) == 0 {
		a.Deltas, b.Deltas = nil, nil
	}
	return reflect.DeepEqual(a, b)
}

// grouped is what Decode(Encode(b)) returns: deltas grouped by rule.
func grouped(b Batch) Batch {
	var ds []Delta
	for _, g := range groupByRule(b.Deltas) {
		ds = append(ds, g...)
	}
	b.Deltas = ds
	return b
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	long := strings.Repeat("k", MaxStringLen)
	tests := []struct {
		name string
		in   Batch
		size int // expected encoded size, 0 = don't check
	}{
		{"empty", Batch{Region: "us-east", Enforcer: "e1", Seq: 1}, 1 + 8 + 3 + 1 + 1 + 1},
		{"empty strings", Batch{Deltas: []Delta{{}}}, 1 + 1 + 1 + 1 + 1 + 1 + (1 + 1) + (1 + 1 + 1)},
		{"one", Batch{Region: "eu-west", Enforcer: "pod-7", Seq: 42, Deltas: []Delta{{"r1", "user:42", 3, 1}}}, 0},
		{"rule written once", Batch{Region: "r", Enforcer: "e", Seq: 2, Deltas: []Delta{
			{"r1", "a", 1, 0}, {"r1", "b", 2, 0}, {"r2", "a", 0, 9}}}, 1 + 2 + 2 + 1 + 1 + 1 + (3 + 1 + 4 + 4) + (3 + 1 + 4)},
		{"big values", Batch{Region: "r", Enforcer: "e", Seq: math.MaxUint64, Deltas: []Delta{
			{"r", "k", math.MaxInt64, math.MaxInt64}}}, 0},
		{"max length strings", Batch{Region: long, Enforcer: long, Deltas: []Delta{{long, long, 1, 1}}}, 0},
		{"unicode and binary", Batch{Region: "ü", Enforcer: "\x00\xff", Deltas: []Delta{{"règle", "ключ\x00", 5, 6}}}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data, err := Encode(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			if tt.size != 0 && len(data) != tt.size {
				t.Errorf("encoded size %d, want %d", len(data), tt.size)
			}
			got, err := Decode(data)
			if err != nil {
				t.Fatal(err)
			}
			if !equalBatch(got, tt.in) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, tt.in)
			}
		})
	}
}

func TestEncodeGroupsByRule(t *testing.T) {
	in := Batch{Region: "r", Enforcer: "e", Deltas: []Delta{
		{"b", "1", 1, 0}, {"a", "1", 2, 0}, {"b", "2", 3, 0}, {"a", "2", 4, 0}, {"c", "1", 5, 0}}}
	data, err := Encode(in)
	if err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(data, []byte("b")); n != 1 {
		t.Errorf("rule b written %d times", n)
	}
	got, err := Decode(data)
	if err != nil {
		t.Fatal(err)
	}
	want := []Delta{{"b", "1", 1, 0}, {"b", "2", 3, 0}, {"a", "1", 2, 0}, {"a", "2", 4, 0}, {"c", "1", 5, 0}}
	if !reflect.DeepEqual(got.Deltas, want) {
		t.Fatalf("got %v, want %v", got.Deltas, want)
	}
}

func TestEncodeInvalid(t *testing.T) {
	long := strings.Repeat("x", MaxStringLen+1)
	tests := []struct {
		name string
		in   Batch
	}{
		{"negative admitted", Batch{Deltas: []Delta{{"r", "k", -1, 0}}}},
		{"negative rejected", Batch{Deltas: []Delta{{"r", "k", 0, -1}}}},
		{"long region", Batch{Region: long}},
		{"long enforcer", Batch{Enforcer: long}},
		{"long rule", Batch{Deltas: []Delta{{long, "k", 1, 0}}}},
		{"long key", Batch{Deltas: []Delta{{"r", long, 1, 0}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := Encode(tt.in); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Encode error = %v, want ErrInvalid", err)
			}
			if _, err := EncodeSplit(tt.in, 1<<20); !errors.Is(err, ErrInvalid) {
				t.Fatalf("EncodeSplit error = %v, want ErrInvalid", err)
			}
		})
	}
}

func randString(rng *rand.Rand, max int) string {
	b := make([]byte, rng.IntN(max+1))
	for i := range b {
		b[i] = byte(rng.IntN(256))
	}
	return string(b)
}

func randBatch(rng *rand.Rand) Batch {
	b := Batch{Region: randString(rng, 12), Enforcer: randString(rng, 20), Seq: rng.Uint64() >> rng.IntN(64)}
	rules := make([]string, 1+rng.IntN(5))
	for i := range rules {
		rules[i] = randString(rng, 10)
	}
	for range rng.IntN(60) {
		b.Deltas = append(b.Deltas, Delta{
			Rule:     rules[rng.IntN(len(rules))],
			Key:      randString(rng, 30),
			Admitted: rng.Int64() >> rng.IntN(64),
			Rejected: rng.Int64() >> rng.IntN(64),
		})
	}
	return b
}

// TestRoundTripProperty: for random batches, Decode(Encode(b)) is b grouped
// by rule, re-encoding is byte-identical, every split fits and carries the
// same deltas, and every proper prefix is rejected.
func TestRoundTripProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 2000 {
		in := randBatch(rng)
		data, err := Encode(in)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		got, err := Decode(data)
		if err != nil {
			t.Fatalf("case %d: decode: %v", i, err)
		}
		if !equalBatch(got, grouped(in)) {
			t.Fatalf("case %d: round trip:\n got %+v\nwant %+v", i, got, grouped(in))
		}
		again, err := Encode(got)
		if err != nil || !bytes.Equal(again, data) {
			t.Fatalf("case %d: re-encoding differs (%v)", i, err)
		}

		maxSize := len(data)/(1+rng.IntN(4)) + 120
		parts, err := EncodeSplit(in, maxSize)
		if errors.Is(err, ErrTooLarge) {
			continue // a single random delta can exceed a tiny limit
		}
		if err != nil {
			t.Fatalf("case %d: split: %v", i, err)
		}
		var all []Delta
		for j, p := range parts {
			if len(p) > maxSize {
				t.Fatalf("case %d: part %d has %d bytes, limit %d", i, j, len(p), maxSize)
			}
			pb, err := Decode(p)
			if err != nil {
				t.Fatalf("case %d: part %d: %v", i, j, err)
			}
			if pb.Seq != in.Seq+uint64(j) || pb.Region != in.Region || pb.Enforcer != in.Enforcer {
				t.Fatalf("case %d: part %d header %q %q %d", i, j, pb.Region, pb.Enforcer, pb.Seq)
			}
			all = append(all, pb.Deltas...)
		}
		if !equalBatch(Batch{Deltas: all}, Batch{Deltas: grouped(in).Deltas}) {
			t.Fatalf("case %d: split lost or reordered deltas", i)
		}
	}
}

// TestDecodeTruncated cuts valid encodings at every byte offset.
func TestDecodeTruncated(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 50 {
		data, err := Encode(randBatch(rng))
		if err != nil {
			t.Fatal(err)
		}
		for n := range len(data) {
			if _, err := Decode(data[:n]); !errors.Is(err, ErrMalformed) {
				t.Fatalf("case %d: Decode of %d/%d bytes: err = %v, want ErrMalformed", i, n, len(data), err)
			}
		}
		if _, err := Decode(append(data, 0)); !errors.Is(err, ErrMalformed) {
			t.Fatalf("case %d: trailing byte accepted: %v", i, err)
		}
	}
}

func TestDecodeMalformed(t *testing.T) {
	hdr := []byte{magicV1, 1, 'r', 1, 'e', 7} // region "r", enforcer "e", seq 7
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	tests := []struct {
		name string
		data []byte
	}{
		{"nil", nil},
		{"unknown version", []byte{0xA2, 0, 0, 0, 0, 0}},
		{"oversized", make([]byte, MaxMessageSize+1)},
		{"no counts", hdr},
		{"groups without deltas", cat(hdr, []byte{0, 1})},
		{"deltas without groups", cat(hdr, []byte{1, 0, 0, 0, 0})},
		{"more groups than deltas", cat(hdr, []byte{1, 2, 1, 'a', 1, 1, 'k', 1, 0, 1, 'b', 1, 1, 'k', 1, 0})},
		{"empty group", cat(hdr, []byte{1, 1, 1, 'a', 0, 1, 'k', 1, 0})},
		{"group count above total", cat(hdr, []byte{1, 1, 1, 'a', 2, 1, 'k', 1, 0, 1, 'j', 1, 0})},
		{"rule in two groups", cat(hdr, []byte{2, 2, 1, 'a', 1, 1, 'k', 1, 0, 1, 'a', 1, 1, 'j', 1, 0})},
		{"huge delta count", cat(hdr, []byte{0xff, 0xff, 0xff, 0xff, 0x0f, 1})},
		{"huge string", []byte{magicV1, 0xff, 0xff, 0xff, 0xff, 0x0f}},
		{"string above MaxStringLen", cat([]byte{magicV1, 0x81, 0x20}, bytes.Repeat([]byte{'x'}, MaxStringLen+1), []byte{0, 0, 0, 0})},
		{"non-minimal uvarint", []byte{magicV1, 0x80, 0x00, 0, 0, 0, 0}},
		{"uvarint overflow", cat(hdr[:5], bytes.Repeat([]byte{0xff}, 9), []byte{0x02, 0, 0})},
		{"count above int64", cat(hdr, []byte{1, 1, 1, 'a', 1, 1, 'k'}, bytes.Repeat([]byte{0xff}, 9), []byte{0x01, 0})},
		{"trailing byte", cat(hdr, []byte{0, 0, 0})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := Decode(tt.data)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("err = %v, want ErrMalformed", err)
			}
			if !equalBatch(b, Batch{}) {
				t.Fatalf("malformed input returned a non-zero batch %+v", b)
			}
		})
	}
	// The header used above is itself valid.
	if _, err := Decode(cat(hdr, []byte{0, 0})); err != nil {
		t.Fatalf("valid empty batch: %v", err)
	}
}

func TestEncodeSplitTooLarge(t *testing.T) {
	b := Batch{Region: "r", Enforcer: "e", Deltas: []Delta{{"rule", strings.Repeat("k", 100), 1, 0}}}
	if _, err := EncodeSplit(b, 50); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("err = %v, want ErrTooLarge", err)
	}
}

func FuzzDecode(f *testing.F) {
	rng := rand.New(rand.NewPCG(5, 6))
	for range 8 {
		data, _ := Encode(randBatch(rng))
		f.Add(data)
	}
	f.Add([]byte{})
	f.Add([]byte{magicV1, 0, 0, 0, 0, 0})
	// Counts of any size (a rogue publisher's: 1e15, 2^62 twice, whose sum
	// passes 2^63, math.MaxInt64; the agent adds them with saturation and
	// the ledger bounds the demand they make), keys and rules that are not
	// valid UTF-8 (Decode is byte-level: the agent drops such deltas one by
	// one), and a count of math.MaxUint64 (refused).
	for _, b := range []Batch{
		{Region: "r", Enforcer: "e", Seq: math.MaxUint64, Deltas: []Delta{{Rule: "user-global", Key: "rl:{p1}:user-global", Admitted: 1e15}}},
		{Region: "r", Enforcer: "e", Seq: 1, Deltas: []Delta{{Rule: "g", Key: "k", Admitted: 1 << 62, Rejected: 1 << 62}, {Rule: "g", Key: "j", Admitted: math.MaxInt64, Rejected: math.MaxInt64}}},
		{Region: "r", Enforcer: "e\xff", Seq: 2, Deltas: []Delta{{Rule: "g", Key: "ok", Admitted: 1}, {Rule: "g", Key: "rl:{bad\xff\xfe}:g", Admitted: 1}, {Rule: "g\xc3", Key: "k", Rejected: 1}}},
	} {
		data, err := Encode(b)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add(append([]byte{magicV1, 1, 'r', 1, 'e', 7, 1, 1, 1, 'a', 1, 1, 'k'}, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0))
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := Decode(data)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		for _, d := range b.Deltas {
			if d.Admitted < 0 || d.Rejected < 0 {
				t.Fatalf("decoded a negative count: %+v", d)
			}
		}
		// Accepted input is canonical.
		again, err := Encode(b)
		if err != nil {
			t.Fatalf("re-encode of a decoded batch: %v", err)
		}
		if !bytes.Equal(again, data) {
			t.Fatalf("re-encoding differs:\n in %x\nout %x", data, again)
		}
	})
}

func sampleDeltas(n int) []Delta {
	ds := make([]Delta, n)
	for i := range ds {
		ds[i] = Delta{Rule: fmt.Sprintf("global-%d", i%4), Key: fmt.Sprintf("user:%06d", i), Admitted: int64(1 + i%100), Rejected: int64(i % 3)}
	}
	return grouped(Batch{Deltas: ds}).Deltas
}

func BenchmarkEncode(b *testing.B) {
	const n = 10_000
	batch := Batch{Region: "us-east", Enforcer: "ratelimitd-7f9c", Seq: 12345, Deltas: sampleDeltas(n)}
	var size int
	b.ReportAllocs()
	for b.Loop() {
		data, err := Encode(batch)
		if err != nil {
			b.Fatal(err)
		}
		size = len(data)
	}
	b.SetBytes(int64(size))
	b.ReportMetric(float64(size)/n, "B/delta")
	b.ReportMetric(float64(size), "B/msg")
}

func BenchmarkDecode(b *testing.B) {
	const n = 10_000
	data, err := Encode(Batch{Region: "us-east", Enforcer: "ratelimitd-7f9c", Seq: 12345, Deltas: sampleDeltas(n)})
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Decode(data); err != nil {
			b.Fatal(err)
		}
	}
}
