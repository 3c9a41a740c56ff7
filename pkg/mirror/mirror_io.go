package mirror

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// Buffer is memory a mirror's requests carry data in: registered with
// each leg's session (with a leg's that rejoins too).
type Buffer struct {
	m *Mirror
	// owner is the registration that owns the memory (a leg's when
	// allocated; kept when that leg's session is replaced).
	owner *rtrs.Buffer
	// legs are the registrations by leg; written under m.bufMu, read
	// by IO to legs not out (a rejoining leg's is set before it is
	// written).
	legs [MaxLegs]*rtrs.Buffer
	b    []byte
}

// Bytes is the buffer's memory.
func (b *Buffer) Bytes() []byte { return b.b }

// AllocBuffer allocates n bytes usable by every leg IO goes to.
func (m *Mirror) AllocBuffer(n int) (*Buffer, error) {
	b := &Buffer{m: m}
	m.bufMu.Lock()
	defer m.bufMu.Unlock()
	var owner *rtrs.Buffer
	for i := range m.legs {
		v := m.leg(i)
		if v == nil || v.fenced.Load() || m.state[i].Load() == legOut {
			continue // no IO goes to it
		}
		s := v.dev.Session().Session()
		var err error
		if owner == nil {
			owner, err = s.AllocBuffer(n)
			b.legs[i] = owner
		} else {
			b.legs[i], err = s.ShareBuffer(owner)
		}
		if err != nil {
			m.freeBufLocked(b)
			return nil, err
		}
	}
	if owner == nil {
		return nil, errors.New("mirror: no leg to allocate a buffer on")
	}
	b.owner, b.b = owner, owner.Bytes()
	m.bufs[b] = struct{}{}
	return b, nil
}

// Free releases the buffer; no request may be using it. The error is
// the first of the registrations'.
func (b *Buffer) Free() error {
	m := b.m
	m.bufMu.Lock()
	defer m.bufMu.Unlock()
	delete(m.bufs, b)
	return m.freeBufLocked(b)
}

// freeBufLocked frees b's registrations and memory.
//
// +checklocks:m.bufMu
func (m *Mirror) freeBufLocked(b *Buffer) error {
	// The shared registrations first, the owner's memory last.
	var errs []error
	owner := b.owner
	for _, x := range b.legs {
		if x == nil {
			continue
		}
		if owner == nil {
			owner = x // AllocBuffer's failure: the first is the owner
			continue
		}
		if x != owner {
			errs = append(errs, x.Free())
		}
	}
	if owner != nil {
		errs = append(errs, owner.Free())
	}
	b.legs, b.owner = [MaxLegs]*rtrs.Buffer{}, nil
	return errors.Join(errs...)
}

// shareLocked registers every live buffer with leg i's voter v, which
// IO is about to go to.
//
// +checklocks:m.bufMu
func (m *Mirror) shareLocked(i int, v *voter) error {
	s := v.dev.Session().Session()
	for b := range m.bufs {
		if old := b.legs[i]; old != nil && old != b.owner {
			old.Free() // the registration with the leg's old session
		}
		b.legs[i] = nil
		x, err := s.ShareBuffer(b.owner)
		if err != nil {
			return err
		}
		b.legs[i] = x
	}
	return nil
}

// Req is a request of a mirror's user (a frontend).
type Req struct {
	Op     rnbd.Op
	Flags  uint32 // rnbd.FFUA
	Off    int64
	Len    int
	Buf    *Buffer
	BufOff int
	// Plug, if not nil, holds the pieces Submit sends to the legs
	// until its owner unplugs it (rtrs.Plug): the caller's burst goes to
	// each leg's session in one write. Submit takes it (nil on return).
	Plug *rtrs.Plug
	// Done is called once, from any goroutine; it must not block.
	Done func(r *Req, err error)
	// Burst is, during Done, the transport burst whose completion ended
	// the request (that of its last leg), or nil: the caller may defer
	// work to its end (rtrs.Burst.Defer), as with a single device.
	Burst *rtrs.Burst
}

// mreq is a request in flight: one rnbd.IOReq per leg, reused.
type mreq struct {
	m       *Mirror
	r       *Req
	legs    [MaxLegs]rnbd.IOReq
	on      [MaxLegs]*voter // the voter each piece went to
	opens   [MaxLegs]uint32 // its device's opens then (rnbd.CltDev.Opens)
	errs    [MaxLegs]error
	sent    [MaxLegs]bool
	pending atomic.Int32
	// readLeg is the leg a read went to; tried the legs it tried.
	readLeg int
	tried   [MaxLegs]bool
	marked  bool   // the bitmap counts it (EndWrite due)
	pass    uint64 // its cleaning pass then (Need.Pass)
	// plain: a write counted in rs.plain; gated: one the resync gate
	// admitted.
	plain, gated bool
}

func (m *Mirror) getReq() *mreq {
	if x, ok := m.reqs.Get().(*mreq); ok {
		return x
	}
	x := &mreq{m: m}
	for i := range x.legs {
		x.legs[i].Done = func(lr *rnbd.IOReq, err error) { x.legDone(i, err, lr.Burst) }
	}
	return x
}

func (m *Mirror) putReq(x *mreq) {
	x.r = nil
	x.errs, x.sent, x.tried = [MaxLegs]error{}, [MaxLegs]bool{}, [MaxLegs]bool{}
	x.marked, x.plain, x.gated = false, false, false
	m.reqs.Put(x)
}

// errFailed is the error of IO on a mirror that lost its quorum or every
// leg.
var errFailed = fmt.Errorf("mirror: no quorum or no leg left: %w", syscall.EIO)

// Submit starts r: a read goes to one leg in sync, anything else to
// every leg written (in sync or resyncing). It returns an error without
// calling Done only for a request that cannot be valid.
func (m *Mirror) Submit(ctx context.Context, r *Req) error {
	if r.Off < 0 || r.Off%512 != 0 || r.Len < 0 || (r.Op != rnbd.OpFlush && r.Off+int64(r.Len) > m.size.Load()) {
		return syscall.EINVAL
	}
	if (r.Op == rnbd.OpRead || r.Op == rnbd.OpWrite) && (r.Buf == nil || r.BufOff < 0 || r.BufOff+r.Len > len(r.Buf.b)) {
		return syscall.EINVAL
	}
	if m.failed.Load() {
		r.Done(r, errFailed)
		return nil
	}
	x := m.getReq()
	x.r = r
	// The plug is this call's alone: a write the resync gate defers is
	// submitted again by another goroutine, without it.
	pl := r.Plug
	r.Plug = nil
	if r.Op == rnbd.OpRead {
		return m.sendRead(ctx, x, pl)
	}
	if r.Op != rnbd.OpFlush && r.Len > 0 && !m.enter(x) {
		return nil // held off a resync's window: submitted again after it
	}
	if r.Op != rnbd.OpFlush && r.Len > 0 {
		need := m.bm.StartWrite(r.Off, int64(r.Len))
		x.marked, x.pass = true, need.Pass
		for blk := m.bm.Pending(need); blk >= 0; blk = m.bm.Pending(need) {
			if pl != nil {
				// The bitmap's write is waited for: what the plug
				// holds (and the permits it took) goes out first.
				pl.Unplug()
			}
			if err := m.storeBitmap(ctx, blk); err != nil {
				m.finish(x, err, nil)
				return nil
			}
		}
	}
	// Count every leg before sending to any: a completion must not see
	// 0 while others are still to go.
	n := int32(0)
	for i := range m.cfg.Layout.NLegs {
		if m.state[i].Load() != legOut {
			x.sent[i] = true
			n++
		}
	}
	if n == 0 {
		m.finish(x, errFailed, nil)
		return nil
	}
	x.pending.Store(n)
	// x may be done, and reused, once its last piece is sent: the loop
	// goes by a copy.
	sent := x.sent
	for i := range m.cfg.Layout.NLegs {
		if sent[i] {
			m.sendLeg(ctx, x, i, r.Op, r.Flags, pl)
		}
	}
	return nil
}

// enter counts write x in flight, or has the resync gate admit it; false:
// the gate deferred it (x is put back).
func (m *Mirror) enter(x *mreq) bool {
	m.rs.plain.Add(1)
	if !m.rs.active.Load() {
		x.plain = true
		return true
	}
	m.rs.plain.Add(-1)
	if !m.rs.admit(x.r, x) {
		m.putReq(x)
		return false
	}
	x.gated = true
	return true
}

// sendLeg submits the request's piece for leg i, held in plug pl if not
// nil.
func (m *Mirror) sendLeg(ctx context.Context, x *mreq, i int, op rnbd.Op, flags uint32, pl *rtrs.Plug) {
	r := x.r
	lr := &x.legs[i]
	*lr = rnbd.IOReq{Op: op, Flags: flags, Off: DataOff + r.Off, Len: r.Len, Done: lr.Done, Plug: pl}
	if op == rnbd.OpFlush {
		lr.Off = 0
	}
	if op == rnbd.OpRead || op == rnbd.OpWrite {
		lr.Buf, lr.BufOff = r.Buf.legs[i], r.BufOff
	}
	v := m.leg(i)
	x.on[i] = v
	v.io.start()
	// The count first, then the state: a reopen takes the leg out
	// before it counts (rnbd.CltDev.OnReopen), so a piece is either
	// refused here or answered under a count that says so (legDone).
	x.opens[i] = v.dev.Opens()
	if m.state[i].Load() == legOut {
		x.legDone(i, errTakenOut, nil)
		return
	}
	if err := v.dev.Submit(ctx, lr); err != nil {
		x.legDone(i, err, nil)
	}
}

// sendRead sends a read to an in-sync leg it has not tried, chosen by
// the read policy (held in plug pl if not nil), or completes it with the
// last error.
func (m *Mirror) sendRead(ctx context.Context, x *mreq, pl *rtrs.Plug) error {
	if i := m.readLeg(x); i >= 0 {
		x.tried[i], x.readLeg = true, i
		x.pending.Store(1)
		m.sendLeg(ctx, x, i, rnbd.OpRead, 0, pl)
		return nil
	}
	err := errFailed
	for _, e := range x.errs {
		if e != nil {
			err = fmt.Errorf("mirror: read failed on every leg in sync: %w", e)
		}
	}
	m.finish(x, err, nil)
	return nil
}

// readLeg is the in-sync leg x has not tried that the read policy
// chooses (as a session's mpath_policy chooses a path): the next by
// round robin, the one with the fewest requests in flight, or the one
// whose session's paths answer heartbeats fastest; -1 if none.
func (m *Mirror) readLeg(x *mreq) int {
	n := m.cfg.Layout.NLegs
	start := int(m.rr.Add(1))
	best := -1
	var bestKey int64
	for k := range n {
		i := (start + k) % n
		if x.tried[i] || m.state[i].Load() != legIn {
			continue
		}
		var key int64
		switch m.cfg.ReadPolicy {
		case rtrs.MPRoundRobin:
			return i
		case rtrs.MPMinLatency:
			key = m.leg(i).latency.Load()
		default:
			key = int64(m.leg(i).io.inflight.Load())
		}
		if best < 0 || key < bestKey {
			best, bestKey = i, key
		}
	}
	return best
}

// legDone is a leg's completion of x's piece, in that leg's transport
// burst b (nil: none).
func (x *mreq) legDone(i int, err error, b *rtrs.Burst) {
	x.on[i].io.done()
	if err == nil && x.on[i].dev.Opens() != x.opens[i] {
		err = errReopened // another device may have answered
	}
	x.errs[i] = err
	if x.pending.Add(-1) != 0 {
		return
	}
	m := x.m
	if m.closing.Load() {
		// The sessions are closing under it: no leg is judged.
		var err error
		for j, e := range x.errs {
			if x.sent[j] || x.r.Op == rnbd.OpRead {
				err = cmp.Or(err, e)
			}
		}
		if err != nil {
			err = fmt.Errorf("mirror: closing: %w", err)
		}
		m.finish(x, err, b)
		return
	}
	if x.r.Op == rnbd.OpRead {
		if err == nil {
			m.finish(x, nil, b)
			return
		}
		if !legFault(err) {
			m.finish(x, err, b)
			return
		}
		// Another leg; not from this callback, which must not block. A
		// bad block (the leg's EIO) is rewritten from it (repair.go),
		// the leg staying in; a leg that failed otherwise is out.
		go func() {
			if mediaError(err) && m.repair(x, i) {
				return
			}
			if !mediaError(err) {
				m.markOut(i)
			}
			// A bad block not repaired (another repair runs, or no
			// other leg could serve it) leaves the leg in: it
			// answers, and this read fails if no leg can serve it,
			// as md keeps its last device.
			m.stats.ReadRetry.Add(1)
			m.sendRead(context.Background(), x, nil)
		}()
		return
	}
	ok := 0
	for j, e := range x.errs {
		if x.sent[j] && e == nil {
			ok++
		}
	}
	for j, e := range x.errs {
		// A leg that failed where another did not now differs from
		// it, whatever the error: out. Where none took it, only the
		// legs' own faults are (a request every leg refuses changed
		// nothing).
		if x.sent[j] && e != nil && (ok > 0 || legFault(e)) {
			m.markOut(j)
		}
	}
	if ok == 0 {
		m.finish(x, fmt.Errorf("mirror: no leg took it: %w", firstErr(x.errs[:])), b)
		return
	}
	m.complete(x, b)
}

// legFault says whether err is a leg's failure (it is taken out) rather
// than the request's own (every leg would say the same).
func legFault(err error) bool {
	for _, e := range []error{syscall.EINVAL, syscall.ENOSPC, syscall.EOPNOTSUPP, syscall.EROFS} {
		if errors.Is(err, e) {
			return false
		}
	}
	return true
}

func firstErr(errs []error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return syscall.EIO
}

// complete acknowledges a write (in burst b) once the legs' states it ran
// under are committed, else holds it for the worker.
func (m *Mirror) complete(x *mreq, b *rtrs.Burst) {
	if m.committedSeq.Load() >= m.memberSeq.Load() {
		m.finish(x, nil, b)
		return
	}
	m.heldMu.Lock()
	m.held = append(m.held, x)
	m.heldMu.Unlock()
	select {
	case m.wake <- struct{}{}:
	default:
	}
}

// finish ends x with err, in burst b (nil: none).
func (m *Mirror) finish(x *mreq, err error, b *rtrs.Burst) {
	r := x.r
	if x.marked {
		m.bm.EndWrite(r.Off, int64(r.Len), x.pass)
	}
	if x.plain {
		m.rs.plain.Add(-1)
	}
	if x.gated {
		m.rs.ended(x)
	}
	m.putReq(x)
	r.Burst = b
	r.Done(r, err)
}

// storeBitmap writes bitmap block blk to every leg written.
func (m *Mirror) storeBitmap(ctx context.Context, blk int) error {
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	return m.storeBitmapLocked(ctx, blk)
}

// +checklocks:m.metaMu
func (m *Mirror) storeBitmapLocked(ctx context.Context, blk int) error {
	change := m.bm.Snapshot(blk, m.bmBuf)
	// To every leg at once: the write that waits for it waits for the
	// slowest leg, not for the sum of them.
	var ok [MaxLegs]bool
	var wg sync.WaitGroup
	for i := range m.legs {
		v := m.leg(i)
		if v == nil || m.state[i].Load() == legOut {
			continue
		}
		copy(v.buf.Bytes(), m.bmBuf)
		wg.Go(func() {
			if err := v.do(ctx, rnbd.OpWrite, rnbd.FFUA, BitmapOff+int64(blk)*BitmapBlock, BitmapBlock, v.buf); err != nil {
				m.markOut(i)
				return
			}
			ok[i] = true
		})
	}
	wg.Wait()
	if ok == [MaxLegs]bool{} {
		m.failed.Store(true)
		return errFailed
	}
	m.bm.Written(blk, change)
	return nil
}
