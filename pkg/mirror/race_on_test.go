//go:build race

package mirror

// raceDetector: this test binary runs under the race detector, which
// allocates on its own.
const raceDetector = true
