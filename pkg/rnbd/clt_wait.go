package rnbd

import (
	"sync"
	"time"
)

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

	mu     sync.Mutex
	items  []*parked
	timer  *time.Timer
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
