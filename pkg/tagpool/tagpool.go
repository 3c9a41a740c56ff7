// Package tagpool hands out the tags 0..n-1 of a fixed set of resources
// (a session's permits, a device's buffer slots) lowest first, as the
// kernel's tag bitmaps do (find_first_zero_bit), rather than in the order
// they came back. At a queue depth of 32 over 512 tags, requests then
// cycle through the first 32 resources and their memory stays in the
// CPU's caches; a FIFO free list makes every request take the least
// recently used one.
package tagpool

import (
	"context"
	"errors"
	"math/bits"
	"sync"
)

// ErrStopped is what Get returns when its stop channel is closed.
var ErrStopped = errors.New("tagpool: stopped")

// Pool is a set of tags. The zero Pool has none (Get waits); Init gives
// it its tags.
//
// Concurrency: Get, TryGet and Put are safe for concurrent use; Init is
// called once, before the tags are used. mu guards the free bitmap, the
// count of waiters and the wake channel, and is held for no wait (Get
// waits on wake outside it) and over no other lock. A tag put back that
// was not taken, or twice, is the caller's bug: Put does not check.
type Pool struct {
	mu sync.Mutex
	// free has bit t%64 of word t/64 set while tag t is free.
	// +checklocks:mu
	free []uint64
	// +checklocks:mu
	waiters int
	// wake has a token when a tag came back while someone waited; a
	// waiter that takes a tag passes the token on if more are free.
	// +checklocks:mu
	wake chan struct{}
}

// Init makes tags 0..n-1, all free. It is called once; a Get waiting
// on the zero Pool before it ends only at its context or stop.
func (p *Pool) Init(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.free = make([]uint64, (n+63)/64)
	for t := 0; t < n; t++ {
		p.free[t/64] |= 1 << (t % 64)
	}
	p.wake = make(chan struct{}, 1)
}

// New returns a pool of n tags.
func New(n int) *Pool {
	p := &Pool{}
	p.Init(n)
	return p
}

// TryGet takes the lowest free tag, or returns -1. While others wait for
// a tag it takes none: a tag that comes back is theirs, in the order they
// came (a caller that could always barge in could starve a waiter).
func (p *Pool) TryGet() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.waiters > 0 {
		return -1
	}
	return p.takeLocked()
}

// +checklocks:p.mu
func (p *Pool) takeLocked() int {
	for w, word := range p.free {
		if word != 0 {
			b := bits.TrailingZeros64(word)
			p.free[w] = word &^ (1 << b)
			return w*64 + b
		}
	}
	return -1
}

// +checklocks:p.mu
func (p *Pool) anyFreeLocked() bool {
	for _, word := range p.free {
		if word != 0 {
			return true
		}
	}
	return false
}

// Get takes the lowest free tag, waiting for one until ctx ends
// (ctx.Err()) or stop is closed (ErrStopped).
func (p *Pool) Get(ctx context.Context, stop <-chan struct{}) (int, error) {
	p.mu.Lock()
	if p.waiters == 0 {
		if t := p.takeLocked(); t >= 0 {
			p.mu.Unlock()
			return t, nil
		}
	}
	p.waiters++
	wake := p.wake
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		p.waiters--
		p.mu.Unlock()
	}()
	for {
		select {
		case <-wake:
		case <-stop:
			return -1, ErrStopped
		case <-ctx.Done():
			return -1, ctx.Err()
		}
		p.mu.Lock()
		t := p.takeLocked()
		if t >= 0 && p.waiters > 1 && p.anyFreeLocked() {
			p.signal() // another waiter may take the next
		}
		p.mu.Unlock()
		if t >= 0 {
			return t, nil
		}
	}
}

// Put returns tag t.
func (p *Pool) Put(t int) {
	p.mu.Lock()
	p.free[t/64] |= 1 << (t % 64)
	if p.waiters > 0 {
		p.signal()
	}
	p.mu.Unlock()
}

// +checklocks:p.mu
func (p *Pool) signal() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}
