package wire

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand"
	"reflect"
	"strings"
	"testing"

	"github.com/nats-io/nkeys"
)

// testSeed returns a fixed NKey user seed for name (tests only).
func testSeed(t testing.TB, name string) []byte {
	t.Helper()
	raw := sha256.Sum256([]byte("wire test key " + name))
	seed, err := nkeys.EncodeSeed(nkeys.PrefixByteUser, raw[:])
	if err != nil {
		t.Fatal(err)
	}
	return seed
}

func testSigner(t testing.TB, region string) *Signer {
	t.Helper()
	s, err := NewSigner(region, testSeed(t, region))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// testKeys returns the public keys of the signers of regions.
func testKeys(t testing.TB, regions ...string) Keys {
	t.Helper()
	var b strings.Builder
	for _, r := range regions {
		b.WriteString(r + "=" + testSigner(t, r).PublicKey() + ",")
	}
	k, err := ParseKeys(b.String())
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// signedMessages returns real signed messages of several shapes and sizes.
func signedMessages(t testing.TB, n int) (froms []string, datas [][]byte, msgs []Message) {
	rng := rand.New(rand.NewSource(11))
	for len(datas) < n {
		m := randMessage(rng)
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		froms = append(froms, m.From)
		datas = append(datas, testSigner(t, m.From).Seal(b))
		msgs = append(msgs, m)
	}
	return froms, datas, msgs
}

func TestSealOpen(t *testing.T) {
	v := NewVerifier(testKeys(t, regionNames...), false)
	froms, datas, msgs := signedMessages(t, 200)
	for i := range datas {
		got, err := v.Open(froms[i], datas[i], testLists)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		if !reflect.DeepEqual(got, msgs[i]) {
			t.Fatalf("case %d: got %+v want %+v", i, got, msgs[i])
		}
		msg, err := v.Verify(froms[i], datas[i])
		if err != nil {
			t.Fatalf("case %d: verify: %v", i, err)
		}
		if got, err := DecodeFromOwned(froms[i], msg, testLists); err != nil || !reflect.DeepEqual(got, msgs[i]) {
			t.Fatalf("case %d: DecodeFromOwned: %v: got %+v want %+v", i, err, got, msgs[i])
		}
	}
}

func TestOpenRefuses(t *testing.T) {
	m := Message{From: "us-east"}
	plain, err := Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	other, _ := Encode(Message{From: "eu-west"})
	good := testSigner(t, "us-east").Seal(plain)
	forger, err := NewSigner("us-east", testSeed(t, "mallory"))
	if err != nil {
		t.Fatal(err)
	}
	strict := NewVerifier(testKeys(t, "us-east", "eu-west"), false)
	lax := NewVerifier(testKeys(t, "eu-west"), true) // us-east has no key
	tests := []struct {
		name string
		v    *Verifier
		from string
		data []byte
		want error // nil: accepted
	}{
		{"signed", strict, "us-east", good, nil},
		{"forged signature", strict, "us-east", forger.Seal(plain), ErrBadSignature},
		{"signed by the subject's key, naming another sender", strict, "us-east", testSigner(t, "us-east").Seal(other), ErrMalformed},
		{"signed by another region's key", strict, "eu-west", testSigner(t, "us-east").Seal(other), ErrBadSignature},
		{"on another region's subject", strict, "eu-west", good, ErrBadSignature},
		{"unsigned", strict, "us-east", plain, ErrUnsigned},
		{"unknown region", strict, "ap-south", testSigner(t, "ap-south").Seal(mustEncode(t, Message{From: "ap-south"})), ErrUnknownKey},
		{"signature only", strict, "us-east", good[len(good)-SignatureSize-1:], ErrMalformed},
		{"empty", strict, "us-east", nil, ErrMalformed},
		{"unknown format", strict, "us-east", append([]byte{0xB6}, good[1:]...), ErrMalformed},
		{"signature appended twice", strict, "us-east", append(bytes.Clone(good), good[len(good)-SignatureSize:]...), ErrBadSignature},
		{"lax: unsigned from a region without key", lax, "us-east", plain, nil},
		{"lax: signed from a region without key", lax, "us-east", good, nil},
		{"lax: unsigned from a region with key", lax, "eu-west", other, ErrUnsigned},
		{"lax: forged from a region with key", lax, "eu-west", forger.Seal(other), ErrBadSignature},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.v.Open(tc.from, tc.data, testLists)
			if tc.want == nil && err != nil {
				t.Fatalf("refused: %v", err)
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
		})
	}
}

func mustEncode(t testing.TB, m Message) []byte {
	t.Helper()
	b, err := Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestOpenEveryBitFlipAndTruncation: no single-bit change anywhere in a
// real signed message, and no prefix of it, opens.
func TestOpenEveryBitFlipAndTruncation(t *testing.T) {
	v := NewVerifier(testKeys(t, regionNames...), false)
	froms, datas, _ := signedMessages(t, 12)
	bits := 0
	for i, data := range datas {
		for n := 0; n < len(data); n++ {
			if _, err := v.Open(froms[i], data[:n], testLists); err == nil {
				t.Fatalf("message %d truncated to %d of %d bytes opened", i, n, len(data))
			}
		}
		for bit := 0; bit < 8*len(data); bit++ {
			c := bytes.Clone(data)
			c[bit/8] ^= 1 << (bit % 8)
			if _, err := v.Open(froms[i], c, testLists); err == nil {
				t.Fatalf("message %d with bit %d flipped opened", i, bit)
			}
			bits++
		}
	}
	t.Logf("%d messages, %d bit flips, all refused", len(datas), bits)
}

func TestSignerAndKeys(t *testing.T) {
	seed, pub, err := GenerateSeed()
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSigner("us-east", append(append([]byte("\n  "), seed...), '\n'))
	if err != nil {
		t.Fatal(err)
	}
	if s.PublicKey() != pub || s.Region() != "us-east" {
		t.Fatalf("public key %s region %s, want %s us-east", s.PublicKey(), s.Region(), pub)
	}
	// A NATS .creds file holds the seed between decorations.
	creds := "-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.sig\n------END NATS USER JWT------\n\n" +
		"-----BEGIN USER NKEY SEED-----\n" + string(seed) + "\n------END USER NKEY SEED------\n"
	if c, err := NewSigner("us-east", []byte(creds)); err != nil || c.PublicKey() != pub {
		t.Fatalf("creds file: %v, key %v", err, c)
	}
	acct, _ := nkeys.CreateAccount()
	aseed, _ := acct.Seed()
	apub, _ := acct.PublicKey()
	for name, seed := range map[string][]byte{"empty": nil, "garbage": []byte("SUxyz"), "account seed": aseed} {
		if _, err := NewSigner("r", seed); !errors.Is(err, ErrKey) {
			t.Errorf("%s: got %v, want ErrKey", name, err)
		}
	}
	k, err := ParseKeys("# peers\nus-east=" + pub + "\n eu-west=" + testSigner(t, "eu-west").PublicKey() + ",\n")
	if err != nil {
		t.Fatal(err)
	}
	if len(k) != 2 {
		t.Fatalf("parsed %d keys", len(k))
	}
	again, err := ParseKeys(k.String())
	if err != nil || again.String() != k.String() {
		t.Fatalf("String does not round trip: %q -> %v %q", k.String(), err, again.String())
	}
	for _, bad := range []string{"us-east", "=" + pub, "us-east=" + pub + ",us-east=" + pub, "us-east=" + apub, "us-east=U123"} {
		if _, err := ParseKeys(bad); !errors.Is(err, ErrKey) {
			t.Errorf("ParseKeys(%q): got %v, want ErrKey", bad, err)
		}
	}
}

// FuzzOpen: Open never panics, and whatever opens is exactly what the
// region's signer seals (Ed25519 signatures are deterministic, and Go's
// Verify refuses non-canonical ones), so nothing else verifies.
func FuzzOpen(f *testing.F) {
	_, datas, _ := signedMessages(f, 8)
	for _, d := range datas {
		f.Add(d)
	}
	f.Add([]byte{magicSigned})
	signers := map[string]*Signer{}
	for _, r := range regionNames {
		signers[r] = testSigner(f, r)
	}
	v := NewVerifier(testKeys(f, regionNames...), false)
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, r := range regionNames {
			m, err := v.Open(r, data, testLists)
			if err != nil {
				continue
			}
			b, err := Encode(m)
			if err != nil {
				t.Fatalf("opened message does not encode: %v", err)
			}
			if !bytes.Equal(signers[r].Seal(b), data) {
				t.Fatalf("opened %x, which %s's signer does not produce", data, r)
			}
		}
	})
}

// benchMessage is a report of n keys (typicalMessage), encoded.
func benchMessage(b *testing.B, n int) []byte { return mustEncode(b, typicalMessage(n)) }

// BenchmarkOpen: verifying and decoding a signed message against decoding
// the same message unsigned (Decode), for 1 and 1000 keys.
func BenchmarkOpen(b *testing.B) {
	s := testSigner(b, "us-east")
	v := NewVerifier(testKeys(b, "us-east"), false)
	for _, n := range []int{1, 1000} {
		msg := benchMessage(b, n)
		sealed := s.Seal(msg)
		b.Run(fmt.Sprintf("keys=%d/decode", n), func(b *testing.B) {
			for b.Loop() {
				if _, err := Decode(msg, testLists); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("keys=%d/open", n), func(b *testing.B) {
			for b.Loop() {
				if _, err := v.Open("us-east", sealed, typicalLists); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("keys=%d/verify", n), func(b *testing.B) {
			for b.Loop() {
				if _, err := v.Verify("us-east", sealed); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("keys=%d/seal", n), func(b *testing.B) {
			for b.Loop() {
				s.Seal(msg)
			}
		})
	}
}
