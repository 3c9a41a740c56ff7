package rnbd

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// DevState is a mapped device's state.
type DevState int32

const (
	// DevInit: being opened for the first time.
	DevInit DevState = iota
	// DevOpen: open on the server; IO flows.
	DevOpen
	// DevClosed: the session lost every path (or the reopen after it
	// failed); IO waits for a reopen up to no_path_timeout.
	DevClosed
	// DevUnmapped: closed for good; IO fails.
	DevUnmapped
	// DevSrvClosed: the server closed the device (its administrator's
	// force close: an IO or the size poll's probe was answered ENOTCONN):
	// IO fails with ENOTCONN, the size poll and reconnects leave it
	// alone, until a remap opens it again.
	DevSrvClosed
)

func (s DevState) String() string {
	switch s {
	case DevInit:
		return "init"
	case DevOpen:
		return "open"
	case DevClosed:
		return "closed"
	case DevUnmapped:
		return "unmapped"
	case DevSrvClosed:
		return "closed by server"
	}
	return fmt.Sprintf("DevState(%d)", int32(s))
}

// CltDev is a device mapped through a client session (struct rnbd_clt_dev).
// It is safe for concurrent use: any number of goroutines Submit at once
// (the frontends' queues), beside Remap, Resize and Unmap; its id and
// state change under ioMu, its counters and sizes are atomic.
type CltDev struct {
	s    *CltSession
	name string
	mode AccessMode

	state atomic.Int32
	// ioMu fences submissions against a change of the device id: IO
	// holds it shared while it checks the state and posts.
	ioMu sync.RWMutex
	// +checklocks:ioMu
	info OpenRsp // under ioMu
	// gen counts the opens of the device (changed under ioMu, read
	// without it where a completion must not wait for ioMu): an answer of
	// ENOTCONN to IO sent under an earlier one says nothing of now.
	gen atomic.Uint32
	// onReopen is told of a reopen before IO goes to the device again
	// (OnReopen).
	onReopen atomic.Pointer[func()]
	// localSectors is the size the device shows (resize); 0: the remote size.
	localSectors atomic.Uint64
	// remoteSectors is info.NSectors, read without ioMu: Size is asked
	// for by every request (its bounds check, and the NBD frontend's).
	remoteSectors atomic.Uint64
	resizeMu      sync.Mutex // one OnResize at a time
	// retrying: a retryParked timer is set.
	retrying atomic.Bool
	// failRL limits the "IO failed" lines of the device: a few every
	// 10 s, the next saying how many it left out.
	failRL log.Limiter

	wait     waitQueue
	inflight sync.WaitGroup // IOReqs submitted and not done
	nflight  atomic.Int64   // how many: DevCounters.Inflight

	// ops and opBytes count submitted requests by operation, fuas those
	// with FUA (Counters).
	ops     [opLast]atomic.Uint64
	opBytes [opLast]atomic.Uint64
	fuas    atomic.Uint64
}

// DevCounters are a device's requests since it was mapped: by
// operation (indexed by Op), their bytes, and how many carried FUA.
type DevCounters struct {
	Requests [opLast]uint64
	Bytes    [opLast]uint64
	FUA      uint64
	// Inflight is the requests submitted and not done (those waiting
	// for a path included).
	Inflight int64
}

// Counters returns the device's request counters.
func (d *CltDev) Counters() DevCounters {
	var c DevCounters
	for i := range c.Requests {
		c.Requests[i], c.Bytes[i] = d.ops[i].Load(), d.opBytes[i].Load()
	}
	c.FUA = d.fuas.Load()
	c.Inflight = d.nflight.Load()
	return c
}

// Ops are the operations of DevCounters, in order.
func Ops() []Op {
	ops := make([]Op, opLast)
	for i := range ops {
		ops[i] = Op(i)
	}
	return ops
}

func (d *CltDev) log() *log.Entry { return d.s.log.WithField("device", d.name) }

// Name is the remote device name (device_path).
func (d *CltDev) Name() string { return d.name }

// Mode is the access mode it was opened with.
func (d *CltDev) Mode() AccessMode { return d.mode }

// Session is the session the device is mapped through.
func (d *CltDev) Session() *CltSession { return d.s }

// State is the device's state.
func (d *CltDev) State() DevState { return DevState(d.state.Load()) }

func (d *CltDev) setState(st DevState) {
	d.ioMu.Lock()
	d.state.Store(int32(st))
	d.ioMu.Unlock()
}

// Info is the server's last OPEN_RSP for the device.
func (d *CltDev) Info() OpenRsp {
	d.ioMu.RLock()
	defer d.ioMu.RUnlock()
	return d.info
}

// Size is the size the device shows, in bytes.
func (d *CltDev) Size() int64 {
	if n := d.localSectors.Load(); n != 0 {
		return int64(n) * 512
	}
	return int64(d.remoteSectors.Load()) * 512
}

// Resize sets the size the device shows (the kernel's resize): at most
// the remote size, a multiple of the logical block size.
func (d *CltDev) Resize(bytes int64) error {
	info := d.Info()
	lbs := int64(info.LogicalBlockSize)
	if bytes <= 0 || bytes%lbs != 0 {
		return fmt.Errorf("rnbd: size %d is not a positive multiple of the block size %d: %w", bytes, lbs, syscall.EINVAL)
	}
	if uint64(bytes)/512 > info.NSectors {
		return fmt.Errorf("rnbd: size %d is larger than the remote device (%d): %w", bytes, info.NSectors*512, syscall.EINVAL)
	}
	d.localSectors.Store(uint64(bytes) / 512)
	return nil
}

func (d *CltDev) disconnected() {
	if d.State() == DevOpen {
		d.setState(DevClosed)
	}
}

// reopen opens the device again on the server (after a reconnect, or the
// rnbd tool's remap) and lets the IO that waited go.
func (d *CltDev) reopen(ctx context.Context) error {
	if d.State() == DevUnmapped {
		return nil
	}
	info, err := d.s.open(ctx, d.name, d.mode)
	if err != nil {
		return err
	}
	d.ioMu.Lock()
	if d.State() == DevUnmapped {
		d.ioMu.Unlock()
		return nil
	}
	old := d.info.NSectors
	d.info = info
	if f := d.onReopen.Load(); f != nil {
		(*f)() // before the count: see Opens
	}
	d.gen.Add(1)
	d.remoteSectors.Store(info.NSectors)
	d.state.Store(int32(DevOpen))
	d.ioMu.Unlock()
	d.log().WithField("device_id", info.DeviceID).Info("device reopened")
	d.resubmit()
	if info.NSectors != old {
		d.sizeChanged(old, info.NSectors)
	}
	return nil
}

// Opens counts the device's opens after the first: each reopen (after
// its session reconnected — all its paths went down, or its server
// restarted — or a Remap) adds one. What answers at the name then may not be what
// answered before (a disk replaced, a file recreated): a caller that
// must know keeps the count a request went out under and compares it at
// its completion. The OnReopen function runs before the count changes.
func (d *CltDev) Opens() uint32 { return d.gen.Load() }

// OnReopen has f called at each reopen of the device (a reconnect, a
// Remap), before the reopen is counted (Opens) and before any request goes to
// the device again: what holds the device and must check what it now is
// (a mirror's leg) stops using it there. f must not block, nor do IO.
func (d *CltDev) OnReopen(f func()) { d.onReopen.Store(&f) }

// PollSize asks the server for the device's size now, as the session's
// size poll does every SetSizePoll: Size has it on return if the server
// answered (what holds the device, a mirror growing, needs not wait for
// the next poll). It may run beside the session's own poll.
func (d *CltDev) PollSize(ctx context.Context) { d.pollSize(ctx) }

// pollSize asks the server for the device's size: an OPEN of the device
// the session has open, which the server answers with it as it is now.
//
// An OPEN of a device its administrator closed opens it again, and the
// kernel's server (6.12) hands back the same device id, so its answer
// cannot tell "still open" from "opened anew". A one-block read with the
// device's id goes first: a server that no longer has the device open
// answers it ENOTCONN (both servers do), and the device is then closed
// for good here, with no OPEN. What remains is the moment between the
// read's answer and the OPEN (docs/client.md).
func (d *CltDev) pollSize(ctx context.Context) {
	d.ioMu.RLock()
	st, id, gen, lbs := d.State(), d.info.DeviceID, d.gen.Load(), int(d.info.LogicalBlockSize)
	d.ioMu.RUnlock()
	if st != DevOpen {
		return
	}
	if err := d.s.probe(ctx, id, lbs); err != nil {
		if errors.Is(err, syscall.ENOTCONN) {
			d.closedByServer(gen, "the size poll's read")
			return
		}
		var errno syscall.Errno
		if !errors.As(err, &errno) || errors.Is(err, rtrs.ErrNoPath) {
			// No answer from the server: no OPEN either, this time.
			d.s.rl.Log(d.log().WithError(err), log.DebugLevel, "the size poll's read got no answer")
			return
		}
		// Any other errno (a device of size 0, a read that failed
		// on the server): the server knows the device id.
	}
	// Checked again in turn with the admin messages: an Unmap's CLOSE
	// cannot come between the check and the OPEN, nor a remap.
	open := func() bool {
		d.ioMu.RLock()
		defer d.ioMu.RUnlock()
		return d.State() == DevOpen && d.gen.Load() == gen
	}
	info, err := d.s.openIf(ctx, d.name, d.mode, open)
	if errors.Is(err, errNotNow) {
		return
	}
	if err != nil {
		d.s.rl.Log(d.log().WithError(err), log.DebugLevel, "asking the server for the size failed")
		return
	}
	d.ioMu.Lock()
	old, st, now := d.info.NSectors, d.State(), d.gen.Load()
	same := st == DevOpen && now == gen && info.DeviceID == id
	if same {
		d.info.NSectors = info.NSectors
		d.remoteSectors.Store(info.NSectors)
	}
	d.ioMu.Unlock()
	if !same {
		switch {
		case st == DevOpen && now == gen:
			// A new id: the server no longer had the device open
			// (its administrator closed it between the read and
			// the OPEN, and the server gave it a new id), and this
			// opened it anew. Undo that; the device stays as the
			// administrator left it until a remap.
			if d.closedByServer(gen, "the size poll's OPEN (a new device id)") {
				d.closeOpened(ctx, info.DeviceID)
			}
		case st == DevSrvClosed && now == gen, st == DevUnmapped:
			// Closed by its server (found by its IO) or unmapped
			// while the poll asked: this OPEN opened the device
			// again on the server.
			d.closeOpened(ctx, info.DeviceID)
		}
		// Reopened meanwhile (a remap, a reconnect): that open got
		// the device this OPEN found.
		return
	}
	if info.NSectors != old {
		d.sizeChanged(old, info.NSectors)
	}
}

// closedByServer closes the device for good here if it is still open
// under open number gen: the server answered ENOTCONN to its IO or to the
// size poll's read (how), or the poll's OPEN found it under a new id. IO
// fails from now on, and what waited for a path fails too; no CLOSE is
// sent (the kernel's server may have given the id to another device of
// the session). It reports whether it closed it.
func (d *CltDev) closedByServer(gen uint32, how string) bool {
	d.ioMu.Lock()
	if d.State() != DevOpen || d.gen.Load() != gen {
		d.ioMu.Unlock()
		return false
	}
	d.state.Store(int32(DevSrvClosed))
	id := d.info.DeviceID
	d.ioMu.Unlock()
	d.log().WithFields(log.Fields{"device_id": id, "found_by": how}).
		Warn("the server closed the device (its administrator's force close): its IO fails until it is remapped")
	for _, p := range d.wait.take(time.Time{}, true) {
		p.r.pieceDone(errSrvClosed)
	}
	return true
}

// errSrvClosed fails the IO of a device its server closed.
var errSrvClosed = fmt.Errorf("rnbd: the server closed the device; remap it to open it again: %w", syscall.ENOTCONN)

func (d *CltDev) closeOpened(ctx context.Context, id uint32) {
	if err := d.s.close(ctx, d.name, id); err != nil {
		d.log().WithError(err).WithField("device_id", id).Warn("closing what the size poll opened failed")
	}
}

// sizeChanged logs a new remote size, drops a local size (resize) the
// device no longer has room for, and tells the session's OnResize — on a
// goroutine of its own, one at a time per device: applying a size may
// wait for the device's IO (the kernel freezes a queue to resize it),
// which must not wait for the goroutine that reopens devices. Each call
// applies d.Size() as it is then, so the last one leaves the last size.
func (d *CltDev) sizeChanged(old, now uint64) {
	d.log().WithFields(log.Fields{"was": old * 512, "now": now * 512}).Info("remote device size changed")
	if l := d.localSectors.Load(); l > now {
		d.localSectors.CompareAndSwap(l, 0)
	}
	if fn := d.s.onResize.Load(); fn != nil {
		go func() {
			d.resizeMu.Lock()
			defer d.resizeMu.Unlock()
			(*fn)(d)
		}()
	}
}

// Remap opens the device on the server again and refreshes what the
// server says of it (the rnbd tool's remap).
func (d *CltDev) Remap(ctx context.Context) error {
	if d.State() == DevUnmapped {
		return fmt.Errorf("rnbd: %s is unmapped: %w", d.name, syscall.ENODEV)
	}
	if !d.s.sess.Connected() {
		return fmt.Errorf("rnbd: session %s has no connected path: %w", d.s.sess.Name(), syscall.ENOTCONN)
	}
	return d.reopen(ctx)
}

// Unmap closes the device on the server and removes it from the session
// (rnbd_clt_unmap_device). IO in flight is waited for; IO after fails.
// The caller stops its own submitters first (the client daemon removes
// the frontend): a Submit racing Unmap may find the device still mapped
// and add to the in-flight count Unmap waits on, which sync.WaitGroup
// does not allow.
func (d *CltDev) Unmap(ctx context.Context) error {
	s := d.s
	s.mu.Lock()
	for i, x := range s.devs {
		if x == d {
			s.devs = append(s.devs[:i:i], s.devs[i+1:]...)
			break
		}
	}
	s.mu.Unlock()
	was := d.State()
	d.setState(DevUnmapped)
	d.wait.fail(errUnmapped)
	d.inflight.Wait()
	if was != DevOpen {
		return nil // the server forgot it with the session's last path
	}
	return s.close(ctx, d.name, d.Info().DeviceID)
}

var errUnmapped = fmt.Errorf("rnbd: device unmapped: %w", syscall.ENODEV)

// IOReq is one block request on a mapped device: it is split into pieces
// the transport carries, each on a permit of its own.
//
// It is not for concurrent use: from Submit until its Done is called it
// belongs to the device, and its submitter neither changes nor submits
// it meanwhile; once Done is called it may be submitted again (the
// client daemon's frontends reuse theirs).
type IOReq struct {
	Op     Op
	Flags  uint32 // FFUA, FPreflush, FNoUnmap, FSync
	Off    int64  // bytes, a multiple of 512
	Len    int    // bytes
	Buf    *rtrs.Buffer
	BufOff int
	// Done is called once with nil or the first error, from any
	// goroutine; it must not block.
	Done func(r *IOReq, err error)
	// Burst is, during Done, the burst of transport completions the
	// request completed in (nil: none): Done may defer work to its end
	// (rtrs.Burst.Defer), e.g. writing a reply once for many requests.
	Burst *rtrs.Burst
	// Plug, if not nil, holds the request's pieces until the
	// submitter's pl.Unplug (it is used only during Submit, which
	// unplugs it itself before it waits for a permit). docs/rtrs.md,
	// "Batching", has the whole path of Plug and Burst.
	Plug *rtrs.Plug

	dev     *CltDev
	pending atomic.Int32
	// failed is set by the first piece that fails, which then writes
	// firstErr; the last piece reads it after pending reached 0 (the
	// atomics order the two). No allocation per request.
	failed   atomic.Bool
	firstErr error
	// flush: a FLUSH follows the request's pieces (FUA on an operation
	// other than a write); flushing: it is under way.
	flush, flushing bool
}

// wire is the operation and flags a piece of r goes out with. The wire
// carries FUA on writes only: the kernel's server hands the flags to the
// block layer, which fails FUA on anything else (with a warning), so a
// durable discard or write-zeroes is the operation, then a flush.
func (r *IOReq) wire() (Op, uint32) {
	switch {
	case r.flushing:
		return OpFlush, 0
	case r.Op != OpWrite:
		return r.Op, r.Flags &^ FFUA
	}
	return r.Op, r.Flags
}

// piece is the part of a request one permit carries.
type piece struct {
	r      *IOReq
	p      *rtrs.Permit
	off    int64
	n      int
	bufOff int
	sess   *CltSession
	gen    uint32 // the device's open it was sent under
}

// Submit starts r. It waits for permits when all are in use (back
// pressure) and returns an error without calling Done only for a request
// that cannot be valid.
func (d *CltDev) Submit(ctx context.Context, r *IOReq) error {
	if r.Off < 0 || r.Off%512 != 0 || r.Len < 0 || r.Op >= opLast {
		return syscall.EINVAL
	}
	if d.State() == DevUnmapped {
		return errUnmapped
	}
	if r.Op == OpRead || r.Op == OpWrite {
		if r.Buf == nil || r.BufOff < 0 || r.BufOff+r.Len > len(r.Buf.Bytes()) {
			return syscall.EINVAL
		}
	}
	if r.Op != OpFlush && r.Off+int64(r.Len) > d.Size() {
		// As the server answers it: ENOSPC for what writes, EINVAL
		// for a read.
		if r.Op == OpRead {
			return syscall.EINVAL
		}
		return syscall.ENOSPC
	}
	r.dev = d
	r.failed.Store(false)
	r.firstErr = nil
	r.flushing = false
	r.flush = r.Flags&FFUA != 0 && r.Len > 0 && (r.Op == OpDiscard || r.Op == OpWriteZeroes || r.Op == OpSecureErase)
	step := d.pieceSize(r.Op)
	if step <= 0 {
		return syscall.EOPNOTSUPP
	}
	d.ops[r.Op].Add(1)
	d.opBytes[r.Op].Add(uint64(r.Len))
	if r.Flags&FFUA != 0 {
		d.fuas.Add(1)
	}
	n := 1
	if r.Len > step {
		n = (r.Len + step - 1) / step
	}
	d.inflight.Add(1)
	d.nflight.Add(1)
	r.pending.Store(int32(n))
	for i := 0; i < n; i++ {
		off := int64(i) * int64(step)
		l := min(step, r.Len-int(off))
		if r.Len == 0 {
			l = 0
		}
		d.sendPiece(ctx, r, r.Plug, r.Off+off, l, r.BufOff+int(off))
	}
	return nil
}

// Do runs one request and waits for it: for tools and tests; the IO path
// uses Submit.
func (d *CltDev) Do(ctx context.Context, op Op, flags uint32, off int64, n int, buf *rtrs.Buffer, bufOff int) error {
	done := make(chan error, 1)
	r := &IOReq{Op: op, Flags: flags, Off: off, Len: n, Buf: buf, BufOff: bufOff,
		Done: func(_ *IOReq, err error) { done <- err }}
	if err := d.Submit(ctx, r); err != nil {
		return err
	}
	return <-done
}

// pieceSize is the most one request of op may carry.
func (d *CltDev) pieceSize(op Op) int {
	info := d.Info()
	switch op {
	case OpRead, OpWrite:
		n := min(int(info.MaxHWSectors)*512, d.s.sess.MaxIOSize())
		return n &^ (int(info.LogicalBlockSize) - 1)
	case OpDiscard, OpSecureErase:
		if op == OpSecureErase && info.SecureDiscard == 0 {
			return 0
		}
		// Whole logical blocks: a piece the server would refuse as
		// not aligned must not be cut.
		return int(min(uint64(info.MaxDiscardSectors)*512, 1<<30)) &^ (int(info.LogicalBlockSize) - 1)
	case OpWriteZeroes:
		return int(min(uint64(info.MaxWriteZeroesSectors)*512, 1<<30)) &^ (int(info.LogicalBlockSize) - 1)
	}
	return 1 << 30 // flush
}

// sendPiece sends one piece, held in pl if not nil, or parks it while the
// device is closed.
func (d *CltDev) sendPiece(ctx context.Context, r *IOReq, pl *rtrs.Plug, off int64, n, bufOff int) {
	s := d.s
	p := s.sess.TryGetPermit(rtrs.IOCon)
	if p == nil {
		// What the plug holds may be what frees a permit.
		if pl != nil {
			pl.Unplug()
		}
		var err error
		if p, err = s.sess.GetPermit(ctx, rtrs.IOCon); err != nil {
			r.pieceDone(err)
			return
		}
	}
	var err error
	d.ioMu.RLock()
	switch d.State() {
	case DevOpen:
	case DevClosed, DevInit:
		gen := d.gen.Load()
		d.ioMu.RUnlock()
		s.sess.PutPermit(p)
		d.park(r, off, n, bufOff, gen)
		return
	case DevSrvClosed:
		d.ioMu.RUnlock()
		s.sess.PutPermit(p)
		r.pieceDone(errSrvClosed)
		return
	default:
		d.ioMu.RUnlock()
		s.sess.PutPermit(p)
		r.pieceDone(errUnmapped)
		return
	}
	gen := d.gen.Load()
	pc := &s.pieces[p.ID()]
	*pc = piece{r: r, p: p, off: off, n: n, bufOff: bufOff, sess: s, gen: gen}
	var usr [IOSize]byte
	op, flags := r.wire()
	(&IO{DeviceID: d.info.DeviceID, Sector: uint64(off) / 512, RW: uint32(op) | flags, Size: uint32(n)}).Encode(usr[:])
	switch op {
	case OpRead:
		err = s.sess.RequestPlugged(pl, rtrs.Read, p, pc, usr[:], r.Buf, bufOff, n)
	case OpWrite:
		err = s.sess.RequestPlugged(pl, rtrs.Write, p, pc, usr[:], r.Buf, bufOff, n)
	default:
		err = s.sess.RequestPlugged(pl, rtrs.Write, p, pc, usr[:], nil, 0, 0)
	}
	d.ioMu.RUnlock()
	if err != nil {
		s.sess.PutPermit(p)
		if errors.Is(err, rtrs.ErrNoPath) {
			d.park(r, off, n, bufOff, gen)
			return
		}
		r.pieceDone(err)
	}
}

// Confirm ends a piece: on success or a server error the request counts
// it; without a path it waits for the device to be reopened.
func (pc *piece) Confirm(err error) { pc.ConfirmBurst(err, nil) }

// ConfirmBurst is Confirm within transport burst b (rtrs.BurstConfirmer).
func (pc *piece) ConfirmBurst(err error, b *rtrs.Burst) {
	r, s := pc.r, pc.sess
	off, n, bufOff, gen := pc.off, pc.n, pc.bufOff, pc.gen
	s.sess.PutPermit(pc.p)
	if errors.Is(err, rtrs.ErrNoPath) {
		r.dev.park(r, off, n, bufOff, gen)
		return
	}
	if errors.Is(err, syscall.ENOTCONN) {
		// The server does not have the device open (its
		// administrator closed it). Not on this goroutine: a
		// completion must not wait for ioMu, which a submitter holds
		// while it posts.
		go r.dev.closedByServer(gen, "an IO answered ENOTCONN")
	}
	r.pieceDoneIn(err, b)
}

func (r *IOReq) pieceDone(err error) { r.pieceDoneIn(err, nil) }

// pieceDoneIn counts a piece done; the last one completes r, in burst b.
func (r *IOReq) pieceDoneIn(err error, b *rtrs.Burst) {
	if err != nil && r.failed.CompareAndSwap(false, true) {
		r.firstErr = err
	}
	if r.pending.Add(-1) != 0 {
		return
	}
	if r.flush && !r.flushing && !r.failed.Load() {
		// Not here: a completion must not wait for a permit.
		r.flushing = true
		r.pending.Store(1)
		go r.dev.sendPiece(context.Background(), r, nil, 0, 0, 0)
		return
	}
	d := r.dev
	if r.firstErr != nil && !eventLogged(r.firstErr) {
		d.failRL.Log(d.log().WithFields(log.Fields{"op": r.Op, "offset": r.Off, "length": r.Len}).WithError(r.firstErr),
			log.ErrorLevel, "IO failed")
	}
	r.Burst = b
	d.nflight.Add(-1)
	r.Done(r, r.firstErr)
	d.inflight.Done()
}

// eventLogged says whether a request's error is an event of the device
// that was logged once for all the requests it failed (expired,
// closedByServer, Unmap), not a failure of its own.
func eventLogged(err error) bool {
	return errors.Is(err, errNoPathTimeout) || errors.Is(err, errSrvClosed) || errors.Is(err, errUnmapped)
}
