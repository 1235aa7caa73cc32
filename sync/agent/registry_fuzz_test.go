package agent

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"

	"github.com/apportion/apportion/sync/ledger"
)

// FuzzRegistryDecode: a registry document read from etcd is refused with
// ErrRegistry, or restores a registry that encodes back to the same
// document, whose next incarnation of every region is above any it has
// given out (a number used twice would make peers ignore the new life), and
// which survives what agents do to it (Start, Contribute, Records).
func FuzzRegistryDecode(f *testing.F) {
	spec := Spec{Units: 1000, MinShare: 0.1, Regions: []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 2}}}
	reg, err := ledger.NewRegistry(spec.ledgerConfig(ledger.DefaultConfig()), spec.Regions)
	if err != nil {
		f.Fatal(err)
	}
	reg.Start("a")
	reg.Start("b")
	reg.Start("a")
	reg.Contribute(ledger.Contribution{Of: ledger.Incarnation{Region: "a", Inc: 1}, From: ledger.Incarnation{Region: "b", Inc: 1}, Q: []ledger.KeyUnits{{Key: "k", Units: 5}}})
	b, err := json.Marshal(registryDoc{Spec: spec, State: reg.State()})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	r := NewEtcdRegistry(nil, "", ledger.DefaultConfig())
	f.Fuzz(func(t *testing.T, data []byte) {
		reg, sp, err := r.decode(data)
		if err != nil {
			if !errors.Is(err, ErrRegistry) {
				t.Fatalf("error %q does not wrap ErrRegistry", err)
			}
			return
		}
		st := reg.State()
		enc, err := json.Marshal(registryDoc{Spec: sp, State: st})
		if err != nil {
			t.Fatal(err)
		}
		back, sp2, err := r.decode(enc)
		if err != nil || !sp.equal(sp2) || !reflect.DeepEqual(back.State(), st) {
			t.Fatalf("decode, encode, decode: %v\n%+v\n%+v", err, back.State(), st)
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
	})
}
