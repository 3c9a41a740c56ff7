// Package lint holds tests about the code base itself: documentation,
// where cgo may appear, and which way dependencies point.
package lint
