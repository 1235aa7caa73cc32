package wire

import (
	"bytes"
	"crypto/ed25519"
	"errors"
	"fmt"
	"iter"
	"maps"
	"slices"
	"strings"
	"sync"
	"unsafe"

	"github.com/nats-io/nkeys"
)

// # Signed envelope (format version 1)
//
//	magic    byte 0xB5
//	message  a report message (Encode's output, starting 0xB3, or 0xB2 in format 2)
//	sig      64 bytes: Ed25519 signature of sigContext || message
//
// The key that verifies a message is the public key configured for the
// region the message comes from (its subject, which must equal the
// message's From): a region can only speak for itself, and any change to
// any byte of the envelope makes Open fail. Keys are NATS NKeys (user keys:
// seeds "SU...", public keys "U..."), so the seed a deployment already
// manages for a region's NATS user can sign its reports too. sigContext
// starts with the byte 0xFF, which no UTF-8 string holds, so no NATS
// authentication nonce (a string the server chooses and the client signs)
// can ever be a signed report.
//
// Signatures prove origin and integrity, not freshness: a recorded message
// verifies forever. Replays are the receiver's business (the agent drops
// reports older than the newest it accepted; the ledger rejects stale and
// frozen incarnations).

const (
	magicSigned = 0xB5
	// SignatureSize is the size of the signature that ends a signed message.
	SignatureSize = ed25519.SignatureSize
	sigContext    = "\xffapportion report v1\x00"
	// Overhead is what Seal adds to an encoded message.
	Overhead = 1 + SignatureSize
)

var (
	// ErrUnsigned is returned by Open for an unsigned message from a
	// region that must sign (every region, unless unsigned ones are allowed).
	ErrUnsigned = errors.New("wire: unsigned report")
	// ErrUnknownKey is returned by Open for a signed message from a region
	// without a configured public key.
	ErrUnknownKey = errors.New("wire: no public key for the sending region")
	// ErrBadSignature is returned by Open when the signature does not verify:
	// the message is forged, altered or truncated.
	ErrBadSignature = errors.New("wire: bad signature")
	// ErrKey is wrapped by errors about a seed or public key.
	ErrKey = errors.New("wire: invalid key")
)

// Signer signs the messages of one region.
type Signer struct {
	region string
	priv   ed25519.PrivateKey
	pub    string
}

// NewSigner returns the signer of region from an NKey user seed ("SU...").
// seed may be the content of a seed file or of a NATS .creds file (the seed
// is found in it); surrounding whitespace is ignored.
func NewSigner(region string, seed []byte) (*Signer, error) {
	kp, err := nkeys.FromSeed(bytes.TrimSpace(seed))
	if err != nil {
		kp, err = nkeys.ParseDecoratedNKey(seed)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: seed: %v", ErrKey, err)
	}
	defer kp.Wipe()
	s, err := kp.Seed()
	if err != nil {
		return nil, fmt.Errorf("%w: seed: %v", ErrKey, err)
	}
	prefix, raw, err := nkeys.DecodeSeed(s)
	if err != nil {
		return nil, fmt.Errorf("%w: seed: %v", ErrKey, err)
	}
	if prefix != nkeys.PrefixByteUser {
		return nil, fmt.Errorf("%w: seed is not an NKey user seed (SU...)", ErrKey)
	}
	priv := ed25519.NewKeyFromSeed(raw)
	pub, err := nkeys.Encode(nkeys.PrefixByteUser, priv.Public().(ed25519.PublicKey))
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrKey, err)
	}
	return &Signer{region: region, priv: priv, pub: string(pub)}, nil
}

// GenerateSeed returns a new random NKey user seed and its public key.
func GenerateSeed() (seed []byte, public string, err error) {
	kp, err := nkeys.CreateUser()
	if err != nil {
		return nil, "", err
	}
	seed, err = kp.Seed()
	if err != nil {
		return nil, "", err
	}
	public, err = kp.PublicKey()
	return seed, public, err
}

// Region returns the region whose messages s signs.
func (s *Signer) Region() string { return s.region }

// PublicKey returns the NKey public key ("U...") that verifies s's signatures.
func (s *Signer) PublicKey() string { return s.pub }

// Public returns the public key that verifies s's signatures.
func (s *Signer) Public() ed25519.PublicKey { return s.priv.Public().(ed25519.PublicKey) }

// Seal returns the signed envelope of an encoded message (Encode's output).
// It copies msg once: the signed bytes (sigContext, msg) and the envelope
// (magicSigned, msg, signature) share one array, the envelope starting at
// the context's last byte.
func (s *Signer) Seal(msg []byte) []byte {
	c := len(sigContext)
	buf := make([]byte, c+len(msg)+SignatureSize)
	copy(buf, sigContext)
	copy(buf[c:], msg)
	sig := ed25519.Sign(s.priv, buf[:c+len(msg)])
	copy(buf[c+len(msg):], sig)
	buf[c-1] = magicSigned
	return buf[c-1:]
}

// verifySigned reports whether sig is key's signature of msg in the
// signing context (sigContext, msg). Ed25519 takes the signed bytes whole,
// so they are assembled in a buffer from a pool: a message of up to the
// max payload (1 MiB) arrives every interval from every peer, and a new
// buffer each time was that much garbage per message.
func verifySigned(key ed25519.PublicKey, msg, sig []byte) bool {
	bp := signedBufs.Get().(*[]byte)
	b := append(append((*bp)[:0], sigContext...), msg...)
	ok := ed25519.Verify(key, b, sig)
	*bp = b[:0]
	signedBufs.Put(bp)
	return ok
}

// signedBufs holds verifySigned's buffers.
var signedBufs = sync.Pool{New: func() any { return new([]byte) }}

// Keys maps a region to the public key its messages verify with.
type Keys map[string]ed25519.PublicKey

// ParsePublicKey decodes an NKey user public key ("U...").
func ParsePublicKey(s string) (ed25519.PublicKey, error) {
	raw, err := nkeys.Decode(nkeys.PrefixByteUser, []byte(strings.TrimSpace(s)))
	if err != nil {
		return nil, fmt.Errorf("%w: public key %q: %v (want an NKey user public key, U...)", ErrKey, s, err)
	}
	return ed25519.PublicKey(raw), nil
}

// ParseKeys parses "region=PUBKEY" entries separated by commas, spaces or
// newlines (a flag value or a file); lines starting with # are comments.
// Every region appears once.
func ParseKeys(s string) (Keys, error) {
	out := Keys{}
	var lines []string
	for _, line := range strings.Split(s, "\n") {
		if t := strings.TrimSpace(line); !strings.HasPrefix(t, "#") {
			lines = append(lines, t)
		}
	}
	for _, f := range strings.FieldsFunc(strings.Join(lines, " "), func(r rune) bool { return r == ',' || r == ' ' || r == '\t' || r == '\r' }) {
		region, pub, ok := strings.Cut(f, "=")
		if !ok || region == "" {
			return nil, fmt.Errorf("%w: entry %q: want region=PUBLICKEY", ErrKey, f)
		}
		if _, dup := out[region]; dup {
			return nil, fmt.Errorf("%w: region %q listed twice", ErrKey, region)
		}
		k, err := ParsePublicKey(pub)
		if err != nil {
			return nil, fmt.Errorf("region %q: %w", region, err)
		}
		out[region] = k
	}
	return out, nil
}

// String returns k in the form ParseKeys reads, sorted by region.
func (k Keys) String() string {
	var parts []string
	for _, r := range slices.Sorted(maps.Keys(k)) {
		pub, _ := nkeys.Encode(nkeys.PrefixByteUser, k[r])
		parts = append(parts, r+"="+string(pub))
	}
	return strings.Join(parts, ",")
}

// Verifier opens the messages of the regions whose keys it holds.
type Verifier struct {
	keys     Keys
	unsigned bool
}

// NewVerifier returns a verifier of keys' regions. With acceptUnsigned, a
// region that has no key in keys may send unsigned messages (they are
// accepted unverified: for tests and migrations only); a region with a key
// must always sign.
func NewVerifier(keys Keys, acceptUnsigned bool) *Verifier {
	return &Verifier{keys: keys, unsigned: acceptUnsigned}
}

// Open checks the message data that arrived on region from's subject and
// decodes it: Verify, then DecodeFrom. It fails with ErrUnsigned,
// ErrUnknownKey, ErrBadSignature or ErrMalformed (also when the message
// names another sender than from); a message that fails changes nothing.
func (v *Verifier) Open(from string, data []byte, lists Lists) (Message, error) {
	msg, err := v.Verify(from, data)
	if err != nil {
		return Message{}, err
	}
	return DecodeFrom(from, msg, lists)
}

// Verify checks the message data that arrived on region from's subject
// and returns the report message it carries (a sub-slice of data, not yet
// decoded: DecodeFrom decodes it), so that a receiver can keep verified
// messages in their compact encoded form until it consumes them. It fails
// with ErrUnsigned, ErrUnknownKey, ErrBadSignature or ErrMalformed.
func (v *Verifier) Verify(from string, data []byte) ([]byte, error) {
	if len(data) == 0 {
		return nil, fmt.Errorf("%w: empty", ErrMalformed)
	}
	key, haveKey := v.keys[from]
	switch data[0] {
	case magicV2, magicV3:
		if haveKey || !v.unsigned {
			return nil, fmt.Errorf("%w from %q", ErrUnsigned, from)
		}
		return data, nil
	case magicSigned:
		if len(data) < Overhead+1 {
			return nil, fmt.Errorf("%w: signed message of %d bytes", ErrMalformed, len(data))
		}
		msg := data[1 : len(data)-SignatureSize]
		switch {
		case haveKey:
			if !verifySigned(key, msg, data[len(data)-SignatureSize:]) {
				return nil, fmt.Errorf("%w: message on %q's subject", ErrBadSignature, from)
			}
		case !v.unsigned:
			return nil, fmt.Errorf("%w: %q", ErrUnknownKey, from)
		}
		return msg, nil
	}
	return nil, fmt.Errorf("%w: unknown format byte 0x%02x", ErrMalformed, data[0])
}

// DecodeFrom decodes a message that arrived on region from's subject
// (Verify's result): Decode, failing with ErrMalformed also when the
// message names another sender than from.
func DecodeFrom(from string, msg []byte, lists Lists) (Message, error) {
	m, err := Decode(msg, lists)
	if err != nil {
		return Message{}, err
	}
	return checkFrom(from, m)
}

// DecodeFromOwned is DecodeFrom with DecodeOwned: msg must not be modified
// afterwards (the message's strings point into it).
func DecodeFromOwned(from string, msg []byte, lists Lists) (Message, error) {
	m, err := DecodeOwned(msg, lists)
	if err != nil {
		return Message{}, err
	}
	return checkFrom(from, m)
}

// DecodeWindowsFromOwned is DecodeFromOwned for a receiver that merges a
// message a window of at most window keys at a time, so that a report of
// many keys is never held decoded whole (a part of up to the max payload,
// 1 MiB, holds about 24,000 keys at 42 B a key: about 3 MB decoded at
// three regions, 127 B a key, BenchmarkDecode). It
// checks the whole message first, as DecodeFromOwned does, keeping no key
// (an error: nothing was read), and returns it without its keys (its
// rules, each with its Err), and the sequence of its windows: one message
// per rule report and window of keys, in order, each with the report's
// header (sequence, acknowledgements, closures), so that each window reads
// as a part of a report its sender split (EncodeParts); a report without
// keys, or with Err, is one message. The sequence decodes the message
// again as it is ranged over, reading lists anew, and reuses a window's
// slices for the next: the consumer must not keep them (strings it keeps
// must be copies, as with DecodeFromOwned, and msg must not change).
func DecodeWindowsFromOwned(from string, msg []byte, lists Lists, window int) (Message, iter.Seq[Message], error) {
	if err := precheck(msg); err != nil {
		return Message{}, nil, err
	}
	window = max(window, 1)
	data := unsafe.String(unsafe.SliceData(msg), len(msg))
	m, err := decode(data, lists, &windows{size: window})
	if err != nil {
		return Message{}, nil, err
	}
	if m, err = checkFrom(from, m); err != nil {
		return Message{}, nil, err
	}
	errs := make([]error, len(m.Rules))
	for i := range m.Rules {
		errs[i] = m.Rules[i].Err
	}
	version := m.Version
	return m, func(yield func(Message) bool) {
		one := make([]RuleReport, 1)
		_, _ = decode(data, lists, &windows{size: window, errs: errs, emit: func(rr RuleReport) bool {
			rr.Report.From = from
			one[0] = rr
			return yield(Message{From: from, Rules: one, Version: version})
		}})
	}, nil
}

// checkFrom fails a message from another sender than from.
func checkFrom(from string, m Message) (Message, error) {
	if m.From != from {
		return Message{}, fmt.Errorf("%w: message from %q on %q's subject", ErrMalformed, m.From, from)
	}
	// The caller's string, equal: a sender's name kept (a map's key) does
	// not keep the message's buffer alive.
	m.From = from
	for i := range m.Rules {
		m.Rules[i].Report.From = from
	}
	return m, nil
}
