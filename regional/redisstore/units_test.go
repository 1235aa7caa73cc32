package redisstore

import (
	"slices"
	"testing"
)

// TestUnitsGroupByTime: the calls of a pipeline share one script call only
// when their time arguments agree (the multi-call script takes one for
// all), in the order of each group's first call; with Redis TIME (every
// time argument "") they are one script call.
func TestUnitsGroupByTime(t *testing.T) {
	mk := func(key string, now any) *call {
		c := &call{}
		c.items = []item{{args: []any{"evalsha", "h", 1, key, int64(1), now, int64(0)}}}
		return c
	}
	keysOf := func(its []*item, units []int) [][]string {
		var out [][]string
		for k := 0; k+1 < len(units); k++ {
			var ks []string
			for _, it := range its[units[k]:units[k+1]] {
				ks = append(ks, it.args[3].(string))
			}
			out = append(out, ks)
		}
		return out
	}
	s := &Store{}
	for _, tc := range []struct {
		batch []*call
		want  [][]string
	}{
		{[]*call{mk("a", ""), mk("b", ""), mk("c", "")}, [][]string{{"a", "b", "c"}}},
		{[]*call{mk("a", int64(5)), mk("b", int64(6)), mk("c", int64(5))}, [][]string{{"a", "c"}, {"b"}}},
		{[]*call{mk("a", int64(7))}, [][]string{{"a"}}},
	} {
		its, units := s.units(tc.batch, len(tc.batch), nil, nil)
		if got := keysOf(its, units); !slices.EqualFunc(got, tc.want, slices.Equal) {
			t.Errorf("units %v, want %v", got, tc.want)
		}
	}
}
