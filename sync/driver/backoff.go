package driver

import "time"

// The agent's and the simulator's waits after a failed registry call, so
// that the simulator waits as the agent does.

// StartBackoff is the wait before the next try after a Start that failed,
// given the last wait (0 after a success): 200 ms, doubled with every
// failure in a row, at most 10 s. A registry read that succeeds after
// failures ends it at once (the agent's registryBack).
func StartBackoff(last time.Duration) time.Duration {
	return min(max(2*last, 200*time.Millisecond), 10*time.Second)
}

// PollWait is the wait between two registry reads after fails failed ones
// in a row: poll, then 2 and 4 polls (2 s at DefaultRegistryPoll), so that
// a registry back after an outage is read again within that.
func PollWait(poll time.Duration, fails int) time.Duration {
	return poll * time.Duration(1<<min(fails, 2))
}
