package redisstore

import (
	"os"
	"strconv"
)

// testingSeed reads REDISSTORE_SEED to replay a randomized run (0: none).
func testingSeed() uint64 {
	s, _ := strconv.ParseUint(os.Getenv("REDISSTORE_SEED"), 10, 64)
	return s
}
