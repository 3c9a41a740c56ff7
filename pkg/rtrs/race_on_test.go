//go:build race

package rtrs

// raceDetector: this test binary runs under the race detector, which
// allocates on its own.
const raceDetector = true
