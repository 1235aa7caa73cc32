package etcdstore

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/apportion/apportion/rules"
)

// FuzzDecode: a value read from etcd is a rule of its key's id, valid and
// stable under Encode, or an error wrapping ErrInvalidDocument and
// rules.ErrInvalid that names the key.
func FuzzDecode(f *testing.F) {
	f.Add("orders", []byte(`{"id":"orders","algorithm":"token_bucket","capacity":20,"refill_per_second":10}`))
	f.Fuzz(func(t *testing.T, id string, doc []byte) {
		r, err := decode(id, doc)
		if err != nil {
			if !errors.Is(err, ErrInvalidDocument) || !errors.Is(err, rules.ErrInvalid) {
				t.Fatalf("error %q does not wrap ErrInvalidDocument and rules.ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), "key ") {
				t.Fatalf("error %q does not name the key", err)
			}
			return
		}
		if r.ID != id {
			t.Fatalf("key %q decoded as rule %q", id, r.ID)
		}
		if err := r.Validate(); err != nil {
			t.Fatalf("decoded rule is not valid: %v", err)
		}
		b, err := Encode(r)
		if err != nil {
			t.Fatal(err)
		}
		back, err := decode(id, b)
		if err != nil || !reflect.DeepEqual(back, r) {
			t.Fatalf("Encode then decode: %+v %v, want %+v", back, err, r)
		}
	})
}

// FuzzReadCache: a cache file is refused whole or gives valid rules with
// distinct ids in id order, which writeCache writes back to the same rules
// and revision.
func FuzzReadCache(f *testing.F) {
	f.Add([]byte(`{"revision":7,"rules":[{"id":"b","algorithm":"fixed_window","limit":1,"window":"1s"},{"id":"a","algorithm":"token_bucket","capacity":2,"refill_per_second":1}]}`))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, data []byte) {
		path := filepath.Join(dir, "cache.json")
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		rs, rev, err := readCache(path)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "etcdstore: cache "+path+": ") {
				t.Fatalf("error %q does not name the cache file", err)
			}
			return
		}
		if !sort.SliceIsSorted(rs, func(i, j int) bool { return rs[i].ID < rs[j].ID }) {
			t.Fatal("rules not in id order")
		}
		for i, r := range rs {
			if err := r.Validate(); err != nil {
				t.Fatalf("cached rule is not valid: %v", err)
			}
			if i > 0 && rs[i-1].ID == r.ID {
				t.Fatalf("duplicate id %q", r.ID)
			}
		}
		again := filepath.Join(dir, "again.json")
		if err := writeCache(again, rev, rs); err != nil {
			t.Fatal(err)
		}
		back, backRev, err := readCache(again)
		if err != nil || backRev != rev || !reflect.DeepEqual(back, rs) && len(rs) > 0 {
			t.Fatalf("writeCache then readCache: %d %+v %v, want %d %+v", backRev, back, err, rev, rs)
		}
	})
}
