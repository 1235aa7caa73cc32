package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/apportion/apportion/sync/ledger"
)

// memChunks is a chunk source over a map (hash -> content), as etcd would
// serve it: content under a name, not necessarily the content of that hash.
func memChunks(store map[string][]byte) func(chunkRef) ([]byte, error) {
	return func(c chunkRef) ([]byte, error) {
		b, ok := store[c.Hash]
		if !ok {
			return nil, fmt.Errorf("%w: chunk %s: %w", ErrRegistry, c.Hash, errMissingChunk)
		}
		if err := verifyChunk(c.Hash, c, b); err != nil {
			return nil, err
		}
		return b, nil
	}
}

// fuzzRegistry is a registry with every list in chunks of 64 bytes, so that
// the fuzz targets' small documents take the chunked form.
func fuzzRegistry() *EtcdRegistry {
	r := NewEtcdRegistry(nil, "", ledger.DefaultConfig())
	r.format = chunkFormat{chunkBytes: 64, inlineBytes: 0, listInline: 8}
	return r
}

// fuzzSeed returns a small registry's spec and state.
func fuzzSeed(f testing.TB) (Spec, ledger.RegistryState) {
	spec := Spec{Units: 1000, MinShare: 0.1, Regions: []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 2}}}
	reg, err := ledger.NewRegistry(spec.ledgerConfig(ledger.DefaultConfig()), spec.Regions)
	if err != nil {
		f.Fatal(err)
	}
	reg.Start("a")
	reg.Start("b")
	reg.Start("a")
	reg.Contribute(ledger.Contribution{Of: ledger.Incarnation{Region: "a", Inc: 1}, From: ledger.Incarnation{Region: "b", Inc: 1},
		Q: []ledger.KeyUnits{{Key: "k", Units: 5}, {Key: "k2", Units: -3}, {Key: "k3", Units: 7}}})
	return spec, reg.State()
}

// checkDecoded is the fuzz targets' property of a document that decoded
// with the chunks of store: every chunk it references is in store under
// its own hash; it encodes (in r's form, into store) to a document that
// decodes to the same spec and state; the next incarnation of every region
// is above any it has given out (a number used twice would make peers
// ignore the new life); it survives what agents do to it (Start,
// Contribute, Records).
func checkDecoded(t *testing.T, r *EtcdRegistry, store map[string][]byte, reg *ledger.Registry, sp Spec, p *parsedDoc) {
	for _, c := range p.refs() {
		if b := store[c.Hash]; chunkHash(b) != c.Hash || len(b) != c.Len {
			t.Fatalf("accepted chunk %s whose content does not match", c.Hash)
		}
	}
	st := reg.State()
	enc, chunks, err := r.format.encodeDoc(sp, st)
	if err != nil {
		t.Fatal(err)
	}
	for h, b := range chunks {
		store[h] = b
	}
	back, sp2, _, err := r.decode(enc, memChunks(store))
	if err != nil || !sp.equal(sp2) || !reflect.DeepEqual(back.State(), st) {
		t.Fatalf("decode, encode, decode: %v\n%+v\n%+v", err, back, st)
	}
	reg.Records()
	highest := map[string]uint64{}
	for _, l := range st.Lives {
		highest[l.Region] = max(highest[l.Region], l.Inc)
	}
	for _, x := range sp.Regions {
		s, err := reg.Start(x.Name)
		if err != nil {
			continue
		}
		if s.Inc <= highest[x.Name] {
			t.Fatalf("Start(%q) = incarnation %d, but %d was given out", x.Name, s.Inc, highest[x.Name])
		}
		highest[x.Name] = s.Inc
		for _, y := range sp.Regions {
			if y.Name != x.Name {
				reg.Contribute(ledger.Contribution{Of: ledger.Incarnation{Region: y.Name, Inc: highest[y.Name]}, From: ledger.Incarnation{Region: x.Name, Inc: s.Inc}})
			}
		}
	}
	reg.Records()
}

// decodeChecked decodes data with the chunks of store: an error must wrap
// ErrRegistry, and a registry it restores must have checkDecoded's
// properties.
func decodeChecked(t *testing.T, r *EtcdRegistry, store map[string][]byte, data []byte) {
	t.Helper()
	reg, sp, p, err := r.decode(data, memChunks(store))
	if err != nil {
		if !errors.Is(err, ErrRegistry) {
			t.Fatalf("error %q does not wrap ErrRegistry", err)
		}
		return
	}
	checkDecoded(t, r, store, reg, sp, p)
}

// FuzzRegistryDecode: a registry document read from etcd (no chunk
// available) is refused with ErrRegistry, or restores a registry with the
// properties of checkDecoded.
func FuzzRegistryDecode(f *testing.F) {
	spec, st := fuzzSeed(f)
	b, err := json.Marshal(registryDoc{Spec: spec, State: st})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	r := NewEtcdRegistry(nil, "", ledger.DefaultConfig())
	f.Fuzz(func(t *testing.T, data []byte) {
		store := map[string][]byte{}
		decodeChecked(t, r, store, data)
	})
}

// FuzzRegistryChunkedDecode: a document and a chunk read from etcd, the
// chunk stored under its own hash and under the hash of the seed's first
// chunk (so a chunk that does not match its name is served too), are
// refused with ErrRegistry, or restore a registry with the properties of
// checkDecoded: in particular no chunk is accepted that does not match the
// hash and length its document gives.
func FuzzRegistryChunkedDecode(f *testing.F) {
	spec, st := fuzzSeed(f)
	r := fuzzRegistry()
	doc, chunks, err := r.format.encodeDoc(spec, st)
	if err != nil {
		f.Fatal(err)
	}
	p, err := parseDoc(doc)
	if err != nil || len(p.lists) == 0 || len(p.refs()) < 2 {
		f.Fatalf("seed document not chunked in 2 chunks or more: %v %s", err, doc)
	}
	first := p.refs()[0].Hash
	f.Add(doc, chunks[first])
	f.Add(doc, []byte(`[{"Key":"k","Units":5}]`))
	old, err := json.Marshal(registryDoc{Spec: spec, State: st})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(old, []byte(nil))
	f.Fuzz(func(t *testing.T, data, chunk []byte) {
		store := map[string][]byte{}
		for h, b := range chunks {
			store[h] = b
		}
		store[chunkHash(chunk)] = chunk
		store[first] = chunk
		decodeChecked(t, r, store, data)
	})
}

// TestRegistryChunkedDocRefused: chunked documents that are wrong in one
// place each are refused with ErrRegistry saying what is wrong, and the
// untouched document decodes.
func TestRegistryChunkedDocRefused(t *testing.T) {
	spec, st := fuzzSeed(t)
	r := fuzzRegistry()
	doc, chunks, err := r.format.encodeDoc(spec, st)
	if err != nil {
		t.Fatal(err)
	}
	p, err := parseDoc(doc)
	if err != nil {
		t.Fatal(err)
	}
	first := p.lists[0].Chunks[0]
	if _, _, _, err := r.decode(doc, memChunks(chunks)); err != nil {
		t.Fatalf("the document itself: %v", err)
	}
	edit := func(old, new string) []byte {
		if !strings.Contains(string(doc), old) {
			t.Fatalf("%q not in %s", old, doc)
		}
		return []byte(strings.Replace(string(doc), old, new, 1))
	}
	corrupt := map[string][]byte{}
	for h, b := range chunks {
		corrupt[h] = b
	}
	corrupt[first.Hash] = append([]byte(" "), chunks[first.Hash][1:]...)
	missing := map[string][]byte{}
	for h, b := range chunks {
		if h != first.Hash {
			missing[h] = b
		}
	}
	for _, tc := range []struct {
		name   string
		doc    []byte
		chunks map[string][]byte
		want   string
	}{
		{"list nowhere", edit(`"kind":"`+p.lists[0].At.Kind+`"`, `"kind":"nowhere"`), chunks, "no such list"},
		{"list twice", edit(`"lists":[`, `"lists":[{"at":{"kind":"`+p.lists[0].At.Kind+`","i":0},"chunks":[{"sha256":"`+first.Hash+`","len":1}]},`), chunks, "twice"},
		{"bad hash", edit(`"sha256":"`+first.Hash, `"sha256":"`+strings.ToUpper(first.Hash)), chunks, "not a SHA-256"},
		{"zero length", edit(fmt.Sprintf(`"sha256":"%s","len":%d`, first.Hash, first.Len), fmt.Sprintf(`"sha256":"%s","len":0`, first.Hash)), chunks, "not a SHA-256"},
		{"wrong length", edit(fmt.Sprintf(`"sha256":"%s","len":%d`, first.Hash, first.Len), fmt.Sprintf(`"sha256":"%s","len":%d`, first.Hash, first.Len-1)), chunks, "does not match"},
		{"state not the marker", edit(`"state":"chunked"`, `"state":{}`), chunks, "not \"chunked\""},
		{"corrupt chunk", doc, corrupt, "does not match"},
		{"missing chunk", doc, missing, "missing"},
		{"quantum below zero", edit(`"units":`, `"quantum":-1,"units":`), chunks, "quantum -1 outside"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, _, err := r.decode(tc.doc, memChunks(tc.chunks))
			if !errors.Is(err, ErrRegistry) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("decode: %v, want ErrRegistry with %q", err, tc.want)
			}
		})
	}
}

// FuzzDecodeLayout: the layout document is read from etcd, so anyone who
// can write there writes it. decodeLayout never panics; it refuses with
// ErrLayout naming the key, in an error of bounded size whatever the
// document's, or returns a layout agents can run that encodes back to a
// document decoding to the same layout.
func FuzzDecodeLayout(f *testing.F) {
	for _, s := range []string{`{"shards":2,"epoch":1}`, `{"shards":1}`, `{"shards":0}`, `{"shards":300}`, `{"shards":2,"epoch":-1}`,
		`null`, `[]`, `{"shards":1e3}`, `{"shards":"2"}`, `{"shards":2,"shards":0}`, `{"shards":2,"x":"` + strings.Repeat("a", 4000) + `"}`, `{"shards":0,"x":"` + strings.Repeat("a", 4000) + `"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		l, err := decodeLayout(doc)
		if err != nil {
			if !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), LayoutKey) {
				t.Fatalf("error %v: not ErrLayout naming %s", err, LayoutKey)
			}
			if n := len(err.Error()); n > 2048 {
				t.Fatalf("an error of %d bytes for a document of %d", n, len(doc))
			}
			return
		}
		if err := l.validate(); err != nil {
			t.Fatalf("accepted %+v: %v", l, err)
		}
		b, _ := json.Marshal(l)
		if back, err := decodeLayout(b); err != nil || back != l {
			t.Fatalf("%+v encodes to %s, which decodes to %+v, %v", l, b, back, err)
		}
	})
}
