package redisstore

import (
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"
)

// testingSeed reads REDISSTORE_SEED to replay a randomized run (0: none).
func testingSeed() uint64 {
	s, _ := strconv.ParseUint(os.Getenv("REDISSTORE_SEED"), 10, 64)
	return s
}

// seededRand is a test's random source: seeded by REDISSTORE_SEED, else
// by the time, which it logs for a rerun; stream tells tests apart.
func seededRand(t *testing.T, stream uint64) *rand.Rand {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := testingSeed(); s != 0 {
		seed = s
	}
	t.Logf("seed %d (rerun with REDISSTORE_SEED=%d)", seed, seed)
	return rand.New(rand.NewPCG(seed, stream))
}
