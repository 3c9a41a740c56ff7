// Package conntest helps test implementations of the fabric contract: a
// handler that records what a connection delivers.
package conntest

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Recorder is a fabric.Handler for tests of a fabric: it keeps the
// connection it is attached to, queues every completion, and reports the
// connection's end. C, WCs and Dead are its state.
type Recorder struct {
	C    fabric.Conn
	WCs  chan fabric.WC
	Dead chan error
	N    atomic.Int64 // completions seen
}

// NewRecorder returns a Recorder with room for 4096 completions.
func NewRecorder() *Recorder {
	return &Recorder{WCs: make(chan fabric.WC, 4096), Dead: make(chan error, 1)}
}

func (r *Recorder) Attached(c fabric.Conn) { r.C = c }

func (r *Recorder) Completion(wc *fabric.WC) {
	r.N.Add(1)
	r.WCs <- *wc
}

func (r *Recorder) Disconnected(err error) { r.Dead <- err }

// Next returns the next completion; the test fails if the connection
// ends first or none comes within 10 s.
func (r *Recorder) Next(t testing.TB) fabric.WC {
	t.Helper()
	select {
	case wc := <-r.WCs:
		return wc
	case err := <-r.Dead:
		t.Fatalf("disconnected: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no completion")
	}
	panic("unreachable")
}

// Ended returns why the connection ended; the test fails if it does not
// within 20 s.
func (r *Recorder) Ended(t testing.TB) error {
	t.Helper()
	select {
	case err := <-r.Dead:
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("connection not killed")
	}
	return nil
}
