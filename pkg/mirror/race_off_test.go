//go:build !race

package mirror

const raceDetector = false
