//go:build race

package e2e

// raceDetector: this test binary runs under the race detector.
const raceDetector = true
