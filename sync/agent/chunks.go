package agent

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/apportion/apportion/sync/ledger"
)

// The registry document of a rule with many active keys does not fit in one
// etcd request: etcd refuses requests above --max-request-bytes (1.5 MiB by
// default), and every per-key list of the state (a contribution's Q, a
// completed record's Keys, an account's Keys) has one entry per key. So a
// document whose lists are large keeps them in chunks, separate etcd keys of
// at most chunkBytes each, named by the SHA-256 of their content, and
// references them by hash and length (the "chunked" form below); a small
// document keeps the previous version's form, every list inline, so agents
// of both versions share it during a rolling upgrade.
//
// Why content-addressed chunks: contributions and completed records never
// change once written, so their chunks are written once and a later change
// of the document puts only the chunks the document it replaces does not
// already reference (an account's Paid, which a reclaim changes on every
// key); the document itself stays a few KiB per list at a million keys.
// Why outside the registry prefix: Records reads the whole prefix in one
// range read, and the documents under it keep their shape and count.
//
// The chunked document is {"spec": S, "state": "chunked", "chunked":
// {"state": T, "lists": [{"at": L, "chunks": [{"sha256": H, "len": N}...]}]}}:
// T is the state with the listed lists left empty, L names where each list
// goes in T, and the list is the JSON encoding of its []ledger.KeyUnits,
// split into the chunks in order. "state" is a string so that an agent of the
// previous version refuses the document (a JSON error naming the state)
// instead of reading an empty state and writing it back without the lists.

const (
	// chunkedMarker is the "state" of a chunked document.
	chunkedMarker = "chunked"
	// defaultChunkBytes is the size of a chunk: a third of etcd's default
	// request limit (1.5 MiB), so one put of a chunk is far from it.
	defaultChunkBytes = 512 << 10
	// maxChunkBytes bounds a chunk's length read from a document.
	maxChunkBytes = 1536 << 10
	// defaultInlineBytes: a document whose lists' encodings add up to at
	// most this keeps them inline (the previous version's form).
	defaultInlineBytes = 256 << 10
	// listInlineBytes: in a chunked document, lists at most this long
	// stay inline.
	listInlineBytes = 1 << 10
	// maxDocBytes bounds the document itself (chunk references and the
	// state's other fields): well under etcd's default request limit.
	maxDocBytes = 1 << 20
	// maxChunkRefs bounds the chunk references a document read from etcd
	// may hold (a document of maxDocBytes holds fewer).
	maxChunkRefs = 1 << 14
	// defaultCacheBytes bounds the chunk cache of an EtcdRegistry: above
	// the ~180 MB of chunks of a rule with 1,000,000 keys, so that a poll
	// cut off by its deadline keeps what it read and the next goes on from
	// there instead of reading it again (the cache holds only chunks read).
	defaultCacheBytes = 256 << 20
)

// chunkFormat holds the chunking thresholds (tests make them small).
type chunkFormat struct {
	chunkBytes  int // the size of a chunk
	inlineBytes int // the lists' total up to which a document is not chunked
	listInline  int // the size up to which a list stays inline in a chunked document
}

var defaultChunkFormat = chunkFormat{chunkBytes: defaultChunkBytes, inlineBytes: defaultInlineBytes, listInline: listInlineBytes}

// chunkRef references one chunk: the hex SHA-256 of its content and its length.
type chunkRef struct {
	Hash string `json:"sha256"`
	Len  int    `json:"len"`
}

// listAt names one per-key list of a ledger.RegistryState: Kind
// "contribution" is Records[I].Contributions[J].Q, "record" is
// Records[I].Record.Keys, "record_contribution" is
// Records[I].Record.Contributions[J].Q, "paid" is Paid[I].Keys, "kept" is
// Kept[I].Keys.
type listAt struct {
	Kind string `json:"kind"`
	I    int    `json:"i"`
	J    int    `json:"j,omitempty"`
}

func (a listAt) String() string { return fmt.Sprintf("%s[%d][%d]", a.Kind, a.I, a.J) }

type chunkedList struct {
	At     listAt     `json:"at"`
	Chunks []chunkRef `json:"chunks"`
}

type chunkedState struct {
	State ledger.RegistryState `json:"state"`
	Lists []chunkedList        `json:"lists"`
}

// wireDoc is a registry document of either form: State is the
// ledger.RegistryState (inline form) or the string chunkedMarker (Chunked
// set).
type wireDoc struct {
	Spec    Spec            `json:"spec"`
	State   json.RawMessage `json:"state"`
	Chunked *chunkedState   `json:"chunked,omitempty"`
}

// eachList calls fn with every non-nil per-key list of st and where it is.
func eachList(st *ledger.RegistryState, fn func(listAt, *[]ledger.KeyUnits)) {
	for i := range st.Records {
		rs := &st.Records[i]
		for j := range rs.Contributions {
			fn(listAt{"contribution", i, j}, &rs.Contributions[j].Q)
		}
		if rs.Record != nil {
			fn(listAt{"record", i, 0}, &rs.Record.Keys)
			for j := range rs.Record.Contributions {
				fn(listAt{"record_contribution", i, j}, &rs.Record.Contributions[j].Q)
			}
		}
	}
	for i := range st.Paid {
		fn(listAt{"paid", i, 0}, &st.Paid[i].Keys)
	}
	for i := range st.Kept {
		fn(listAt{"kept", i, 0}, &st.Kept[i].Keys)
	}
}

// listSlot returns the list of st at a, or nil if st has no such place.
func listSlot(st *ledger.RegistryState, a listAt) *[]ledger.KeyUnits {
	in := func(i, n int) bool { return i >= 0 && i < n }
	switch a.Kind {
	case "contribution":
		if in(a.I, len(st.Records)) && in(a.J, len(st.Records[a.I].Contributions)) {
			return &st.Records[a.I].Contributions[a.J].Q
		}
	case "record":
		if in(a.I, len(st.Records)) && st.Records[a.I].Record != nil && a.J == 0 {
			return &st.Records[a.I].Record.Keys
		}
	case "record_contribution":
		if in(a.I, len(st.Records)) && st.Records[a.I].Record != nil && in(a.J, len(st.Records[a.I].Record.Contributions)) {
			return &st.Records[a.I].Record.Contributions[a.J].Q
		}
	case "paid":
		if in(a.I, len(st.Paid)) && a.J == 0 {
			return &st.Paid[a.I].Keys
		}
	case "kept":
		if in(a.I, len(st.Kept)) && a.J == 0 {
			return &st.Kept[a.I].Keys
		}
	}
	return nil
}

func chunkHash(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// validHash reports whether s is a lowercase hex SHA-256, the only chunk
// names there are.
func validHash(s string) bool {
	if len(s) != 2*sha256.Size {
		return false
	}
	for _, c := range []byte(s) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// copyHolders returns st with copies of the slices that hold its per-key
// lists (the lists themselves are shared), so that setting a list of the
// copy leaves st unchanged.
func copyHolders(st ledger.RegistryState) ledger.RegistryState {
	st.Records = append([]ledger.RecordState(nil), st.Records...)
	for i := range st.Records {
		rs := &st.Records[i]
		rs.Contributions = append([]ledger.Contribution(nil), rs.Contributions...)
		if rs.Record != nil {
			rec := *rs.Record
			rec.Contributions = append([]ledger.Contribution(nil), rec.Contributions...)
			rs.Record = &rec
		}
	}
	st.Paid = append([]ledger.AccountState(nil), st.Paid...)
	st.Kept = append([]ledger.AccountState(nil), st.Kept...)
	return st
}

// encodeDoc returns the document of spec and st in the form f chooses, and
// the chunks it references (hash -> content).
func (f chunkFormat) encodeDoc(spec Spec, st ledger.RegistryState) ([]byte, map[string][]byte, error) {
	type enc struct {
		at listAt
		b  []byte
	}
	var lists []enc
	var total int
	var err error
	eachList(&st, func(at listAt, l *[]ledger.KeyUnits) {
		if len(*l) == 0 || err != nil {
			return
		}
		var b []byte
		if b, err = json.Marshal(*l); err == nil {
			lists = append(lists, enc{at, b})
			total += len(b)
		}
	})
	if err != nil {
		return nil, nil, err
	}
	if total <= f.inlineBytes {
		b, err := json.Marshal(registryDoc{Spec: spec, State: st})
		return b, nil, err
	}
	chunks := map[string][]byte{}
	cs := chunkedState{}
	st = copyHolders(st) // the caller's st stays as it is
	for _, l := range lists {
		ptr := listSlot(&st, l.at)
		if len(l.b) <= f.listInline {
			continue
		}
		cl := chunkedList{At: l.at}
		for b := l.b; len(b) > 0; {
			n := min(len(b), f.chunkBytes)
			h := chunkHash(b[:n])
			chunks[h] = b[:n]
			cl.Chunks = append(cl.Chunks, chunkRef{Hash: h, Len: n})
			b = b[n:]
		}
		cs.Lists = append(cs.Lists, cl)
		*ptr = nil
	}
	cs.State = st
	b, err := json.Marshal(wireDoc{Spec: spec, State: json.RawMessage(`"` + chunkedMarker + `"`), Chunked: &cs})
	if err != nil {
		return nil, nil, err
	}
	if len(b) > maxDocBytes {
		return nil, nil, fmt.Errorf("%w: the document would be %d bytes even with its %d per-key lists in chunks (at most %d)", ErrRegistry, len(b), len(cs.Lists), maxDocBytes)
	}
	return b, chunks, nil
}

// parsedDoc is a document parsed but not yet restored: its chunks are
// still to be read.
type parsedDoc struct {
	spec  Spec
	state ledger.RegistryState
	lists []chunkedList // nil for an inline document
}

// parseDoc parses a document of either form and checks its chunk
// references (well-formed, each list once, in a place the state has and
// left empty there); it reads no chunk.
func parseDoc(b []byte) (*parsedDoc, error) {
	var w wireDoc
	if err := json.Unmarshal(b, &w); err != nil {
		return nil, fmt.Errorf("%w: document: %w", ErrRegistry, err)
	}
	p := &parsedDoc{spec: w.Spec}
	if w.Chunked == nil {
		if err := json.Unmarshal(w.State, &p.state); err != nil {
			return nil, fmt.Errorf("%w: document: state: %w", ErrRegistry, err)
		}
		return p, nil
	}
	var marker string
	if err := json.Unmarshal(w.State, &marker); err != nil || marker != chunkedMarker {
		return nil, fmt.Errorf("%w: document: chunked, but its state is not %q", ErrRegistry, chunkedMarker)
	}
	p.state, p.lists = w.Chunked.State, w.Chunked.Lists
	if p.lists == nil {
		p.lists = []chunkedList{}
	}
	seen := map[listAt]bool{}
	refs := 0
	for _, l := range p.lists {
		slot := listSlot(&p.state, l.At)
		switch {
		case slot == nil:
			return nil, fmt.Errorf("%w: document: chunked list at %v: the state has no such list", ErrRegistry, l.At)
		case len(*slot) > 0:
			return nil, fmt.Errorf("%w: document: chunked list at %v is also inline", ErrRegistry, l.At)
		case seen[l.At]:
			return nil, fmt.Errorf("%w: document: chunked list at %v twice", ErrRegistry, l.At)
		case len(l.Chunks) == 0:
			return nil, fmt.Errorf("%w: document: chunked list at %v has no chunk", ErrRegistry, l.At)
		}
		seen[l.At] = true
		for _, c := range l.Chunks {
			if !validHash(c.Hash) || c.Len <= 0 || c.Len > maxChunkBytes {
				return nil, fmt.Errorf("%w: document: list at %v: chunk %q of length %d is not a SHA-256 of a length in (0, %d]", ErrRegistry, l.At, c.Hash, c.Len, maxChunkBytes)
			}
			if refs++; refs > maxChunkRefs {
				return nil, fmt.Errorf("%w: document: more than %d chunk references", ErrRegistry, maxChunkRefs)
			}
		}
	}
	return p, nil
}

// refs returns the chunks p references, each once.
func (p *parsedDoc) refs() []chunkRef {
	var out []chunkRef
	seen := map[string]bool{}
	for _, l := range p.lists {
		for _, c := range l.Chunks {
			if !seen[c.Hash] {
				seen[c.Hash] = true
				out = append(out, c)
			}
		}
	}
	return out
}

// verifyChunk checks that b is the chunk c references; name is the chunk's
// etcd key, for the error.
func verifyChunk(name string, c chunkRef, b []byte) error {
	if len(b) != c.Len || chunkHash(b) != c.Hash {
		return fmt.Errorf("%w: chunk %s: content does not match its reference (%d bytes, want %d with that SHA-256)", ErrRegistry, name, len(b), c.Len)
	}
	return nil
}

// assemble fills p's chunked lists from chunks (hash -> verified content)
// and returns the state.
func (p *parsedDoc) assemble(chunks map[string][]byte) (ledger.RegistryState, error) {
	st := p.state
	if len(p.lists) == 0 {
		return st, nil
	}
	st = copyHolders(st) // p's slices stay as they are
	for _, l := range p.lists {
		var buf []byte
		for _, c := range l.Chunks {
			b, ok := chunks[c.Hash]
			if !ok {
				return st, fmt.Errorf("%w: chunk %s of list %v not read", ErrRegistry, c.Hash, l.At)
			}
			buf = append(buf, b...)
		}
		var keys []ledger.KeyUnits
		if err := json.Unmarshal(buf, &keys); err != nil {
			return st, fmt.Errorf("%w: document: chunked list at %v: %w", ErrRegistry, l.At, err)
		}
		*listSlot(&st, l.At) = keys
	}
	return st, nil
}

// chunkCache keeps verified chunks by hash (they never change), up to max
// bytes, evicting the least recently used.
type chunkCache struct {
	mu    sync.Mutex
	max   int
	size  int
	clock uint64
	m     map[string]*cached
}

type cached struct {
	b    []byte
	used uint64
}

func newChunkCache(max int) *chunkCache { return &chunkCache{max: max, m: map[string]*cached{}} }

func (c *chunkCache) get(h string) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[h]
	if !ok {
		return nil, false
	}
	c.clock++
	e.used = c.clock
	return e.b, true
}

func (c *chunkCache) put(h string, b []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[h]; ok || len(b) > c.max {
		return
	}
	c.clock++
	c.m[h] = &cached{b: b, used: c.clock}
	c.size += len(b)
	for c.size > c.max {
		var old string
		for k, e := range c.m {
			if old == "" || e.used < c.m[old].used {
				old = k
			}
		}
		c.size -= len(c.m[old].b)
		delete(c.m, old)
	}
}

// errMissingChunk is wrapped by the error of a referenced chunk not in etcd.
var errMissingChunk = errors.New("missing")

// chunkName returns the hash of a chunk key under a rule's chunk prefix, or
// "" if rest (the key without that prefix) is not a chunk of that rule.
func chunkName(rest string) string {
	if strings.Contains(rest, "/") || !validHash(rest) {
		return ""
	}
	return rest
}
