// Package allocation computes how a global limit's dynamic pool is divided
// among regions. It is pure: no I/O, no clock, no randomness, no shared state;
// the same input always yields the bit-identical output, on every platform
// (no product feeds an addition without an explicit float64 rounding, so the
// compiler cannot fuse them into FMA instructions that change the last bit on
// some architectures). Every agent can therefore compute every region's target from
// the same reports and agree on it.
//
// Each region owns a floor that is never moved; a [Func] decides how the
// dynamic pool on top of the floors is shared. A region's want is its demand
// beyond its floor, max(0, Demand-Floor). Three strategies are provided:
//
//   - [MaxMinFair] (the default): weighted max-min fair water-filling. No
//     region gets more than it wants while another is short; spare capacity
//     is handed out by weight so a region whose demand rises has headroom.
//   - [Proportional]: every want is met if the pool allows, otherwise the pool
//     is split in proportion to the wants.
//   - [Static]: the pool split by weight, demand ignored.
//
// Invariants of every strategy in this package, for any input (NaN, Inf,
// negative and empty included, never a panic):
//
//   - the result has one entry per region, each finite and >= 0, so a
//     region's target (floor + share, see [Targets]) is never below its floor;
//   - the entries sum to pool, within 1e-9*pool (in practice a few ulps): the
//     largest entry absorbs the rounding residue;
//   - a pool that is not a positive finite number yields all zeros, so a
//     broken input leaves every region at its floor and can never overshoot;
//   - [MaxMinFair] and [Proportional] are monotone in demand: raising one
//     region's demand never lowers its share (up to float rounding).
//
// [SplitUnits] turns a Func's result into integer units for the ledger: they
// sum to exactly the pool.
package allocation
