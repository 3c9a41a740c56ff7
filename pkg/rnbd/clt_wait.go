package rnbd

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// The client's IO that waits for its device: the pieces parked while the
// session has no path or the device is being reopened, sent again once it
// is open, or failed when no_path_timeout passes.

// parked is a piece of a block request waiting for its device.
type parked struct {
	r        *IOReq
	off      int64
	n        int
	bufOff   int
	deadline time.Time
}

// waitQueue holds the pieces of IO that wait for their device to be open
// again — the session lost every path, or the device is being reopened
// after a reconnect — each until its deadline, no_path_timeout after it
// began to wait. It is the client's one queue of IO waiting for a path:
// RTRS fails such a request at once, as the kernel's does, because only
// this layer can send it again after the device was reopened, possibly
// under another id.
type waitQueue struct {
	// expired is told, from the queue's timer, the pieces whose
	// deadline passed; they are no longer in the queue.
	expired func([]*parked)

	mu sync.Mutex
	// +checklocks:mu
	items []*parked
	// +checklocks:mu
	timer *time.Timer
	// +checklocks:mu
	closed bool
}

// add queues p unless the queue is closed; it reports whether it did.
func (q *waitQueue) add(p *parked) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return false
	}
	q.items = append(q.items, p)
	q.armLocked()
	return true
}

// pending is how many pieces wait and the earliest deadline among them
// (zero when none wait).
func (q *waitQueue) pending() (n int, first time.Time) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, p := range q.items {
		if first.IsZero() || p.deadline.Before(first) {
			first = p.deadline
		}
	}
	return len(q.items), first
}

// take removes and returns the pieces whose deadline is at or before
// now, or all of them if all.
func (q *waitQueue) take(now time.Time, all bool) []*parked {
	q.mu.Lock()
	defer q.mu.Unlock()
	var out []*parked
	keep := q.items[:0]
	for _, p := range q.items {
		if all || !p.deadline.After(now) {
			out = append(out, p)
		} else {
			keep = append(keep, p)
		}
	}
	clear(q.items[len(keep):])
	q.items = keep
	q.armLocked()
	return out
}

// armLocked sets the timer to the earliest deadline left.
// +checklocks:q.mu
func (q *waitQueue) armLocked() {
	if len(q.items) == 0 {
		if q.timer != nil {
			q.timer.Stop()
		}
		return
	}
	next := q.items[0].deadline
	for _, p := range q.items[1:] {
		if p.deadline.Before(next) {
			next = p.deadline
		}
	}
	if q.timer == nil {
		q.timer = time.AfterFunc(time.Until(next), q.expire)
	} else {
		q.timer.Reset(time.Until(next))
	}
}

func (q *waitQueue) expire() {
	if ps := q.take(time.Now(), false); len(ps) > 0 {
		q.expired(ps)
	}
}

// fail closes the queue for good and ends every piece in it with err.
func (q *waitQueue) fail(err error) {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	for _, p := range q.take(time.Time{}, true) {
		p.r.pieceDone(err)
	}
}

// park keeps a piece, last sent (or found the device closed) under open
// number gen, until the device is open again or no_path_timeout (or
// fast_io_fail_tmo) passes.
func (d *CltDev) park(r *IOReq, off int64, n, bufOff int, gen uint32) {
	now := time.Now()
	deadline := d.s.ioDeadline(now)
	if !deadline.After(now) {
		r.pieceDone(rtrs.ErrNoPath)
		return
	}
	if !d.wait.add(&parked{r: r, off: off, n: n, bufOff: bufOff, deadline: deadline}) {
		r.pieceDone(errUnmapped)
		return
	}
	// The device may have been reopened between the state check and
	// the add: its resubmission would have missed this piece; or
	// closed by its server, whose failing of what waited missed it.
	// Open under the same open, the session has no path but has not
	// told the device yet (its last path is being torn down): sending
	// again at once would only fail again, in a loop, until it does.
	// Not under ioMu: park runs on completions too (ConfirmBurst),
	// which must not wait for it. The state first: a reopen counts gen
	// before it stores DevOpen.
	st := d.State()
	cur := d.gen.Load()
	switch {
	case st == DevOpen && cur != gen:
		d.resubmit()
	case st == DevOpen:
		d.retryParked()
	case st == DevSrvClosed:
		for _, p := range d.wait.take(time.Time{}, true) {
			p.r.pieceDone(errSrvClosed)
		}
	}
}

// expired fails the pieces whose no_path_timeout passed.
func (d *CltDev) expired(ps []*parked) {
	d.log().WithField("requests", len(ps)).Warn("no path within no_path_timeout (or fast_io_fail_tmo): failing requests")
	for _, p := range ps {
		p.r.pieceDone(errNoPathTimeout)
	}
}

// errNoPathTimeout fails the requests that waited no_path_timeout (or
// fast_io_fail_tmo) for a path: ErrNoPath, logged once for them all.
var errNoPathTimeout = fmt.Errorf("rnbd: no path within no_path_timeout: %w", rtrs.ErrNoPath)

// resubmit sends the waiting pieces again, the device being open (again).
func (d *CltDev) resubmit() { d.resend(log.InfoLevel) }

// resend sends the waiting pieces again, logging that at level.
func (d *CltDev) resend(level log.Level) {
	ps := d.wait.take(time.Time{}, true)
	if len(ps) == 0 {
		return
	}
	d.log().WithField("requests", len(ps)).Log(level, "resubmitting requests that waited for the device")
	// Not on the caller's goroutine: sending waits for permits.
	go func() {
		for _, p := range ps {
			d.sendPiece(context.Background(), p.r, nil, p.off, p.n, p.bufOff)
		}
	}()
}

// parkedRetry is how long pieces that found no path while the device
// is open wait before they are sent again, unless the device is
// reopened first.
const parkedRetry = 100 * time.Millisecond

// retryParked sends the waiting pieces again after parkedRetry if the
// device is still open then: one timer per device, however many pieces
// park meanwhile.
func (d *CltDev) retryParked() {
	if d.retrying.Swap(true) {
		return
	}
	time.AfterFunc(parkedRetry, func() {
		d.retrying.Store(false)
		if d.State() == DevOpen {
			d.resend(log.DebugLevel)
		}
	})
}
