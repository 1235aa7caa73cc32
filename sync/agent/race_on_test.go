//go:build race

package agent

// raceDetector is true in a -race build: the sharded Cluster test then
// allows for the detector's slowdown of the marker fan-outs.
const raceDetector = true
