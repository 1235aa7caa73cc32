package redisstore

// Enforced returns the units the model enforces at nowMs for the global
// token bucket key of g, as Check would compute them (the marker, the key's
// share record, the floor; see the package doc). It changes no state a
// check or write can see: the simulator reads each region's enforced share
// with it.
func (m *Model) Enforced(nowMs int64, key string, g Global) int64 {
	mk, okm := m.markers[MarkerKey(g.Rule)]
	k := m.get(nowMs, key)
	if ri, ok := m.field(k, "i"); ok {
		return m.enforced(mk, okm, nowMs, g.Units, g.Floor, true, ri, k.h["u"]/2)
	}
	return m.enforced(mk, okm, nowMs, g.Units, g.Floor, false, 0, 0)
}
