package rnbd

import (
	"fmt"
	"syscall"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// What the server accepts in an IO message (process_rdma), one rule per
// operation. docs/protocol.md ("IO requests") has the same table with
// what the kernel's rnbd-clt sends for each, from its source; the
// unit tests replay those messages byte for byte.
//
// The rules are as liberal as correctness allows, because peers differ:
// the kernel sends a flush as an RTRS read at sector (u64)-1 with FUA
// set, we send it as a write at sector 0. What cannot be run safely — an
// unknown flag that may change the meaning, data where there should be
// none, a range outside the device — is refused with an errno and a
// rate-limited log line that says why.
type ioRule struct {
	flags  uint32   // the flags the operation may carry
	data   bool     // the data is in the chunk, bi_size bytes of it
	dir    rtrs.Dir // the RTRS direction a request with data must come in
	ranged bool     // sector and bi_size address the device
	write  bool     // changes the device: refused on a read-only open
}

var ioRules = [opLast]ioRule{
	// FUA and PREFLUSH on a read: the block layer refuses them, no
	// client sends them.
	OpRead: {flags: FSync, data: true, dir: rtrs.Read, ranged: true},
	// PREFLUSH (2.1) flushes before the write, FUA makes it durable.
	// An empty write with either is a flush (a 2.0 client encodes
	// PREFLUSH as FUA).
	OpWrite: {flags: FSync | FFUA | FPreflush, data: true, dir: rtrs.Write, ranged: true, write: true},
	// Either direction; sector and bi_size mean nothing. The kernel's
	// client sets FUA on every flush (op_is_flush), a 2.1 one PREFLUSH
	// too. Allowed on a read-only open, as the block layer allows it.
	OpFlush: {flags: FSync | FFUA | FPreflush},
	// FUA on these: made durable by a flush after them (NBD allows FUA
	// on TRIM and WRITE_ZEROES; the kernel never sends it).
	OpDiscard:     {flags: FSync | FFUA, ranged: true, write: true},
	OpSecureErase: {flags: FSync | FFUA, ranged: true, write: true},
	OpWriteZeroes: {flags: FSync | FFUA | FNoUnmap, ranged: true, write: true},
}

// refusal is an IO the server will not run: the errno the client gets,
// and why, for the log.
type refusal struct {
	errno syscall.Errno
	why   string
}

func refuse(errno syscall.Errno, format string, args ...any) *refusal {
	return &refusal{errno: errno, why: fmt.Sprintf(format, args...)}
}

// admit checks an IO message against the rules, the RTRS request it came
// in (direction, bytes of data in the chunk) and the device, and returns
// the byte range it addresses (0, 0 for none).
func (d *SrvSessDev) admit(m *IO, dir rtrs.Dir, dataLen int) (off, n int64, r *refusal) {
	if err := CheckRW(m.RW); err != nil {
		return 0, 0, refuse(syscall.EINVAL, "%v", err)
	}
	op := m.Op()
	rule := &ioRules[op]
	if f := m.Flags() &^ rule.flags; f != 0 {
		return 0, 0, refuse(syscall.EINVAL, "%s with flags %s, which have no meaning on it", op, FlagString(f))
	}
	switch {
	case rule.data && dir != rule.dir:
		return 0, 0, refuse(syscall.EINVAL, "%s as an RTRS %v: its data can only travel in an RTRS %v", op, dir, rule.dir)
	case rule.data && dataLen != int(m.Size):
		return 0, 0, refuse(syscall.EINVAL, "%s of bi_size %d with %d bytes of data in the chunk", op, m.Size, dataLen)
	case !rule.data && dataLen != 0:
		return 0, 0, refuse(syscall.EINVAL, "%s with %d bytes of data in the chunk: it carries none", op, dataLen)
	case rule.write && d.readonly:
		return 0, 0, refuse(syscall.EROFS, "%s on a device open read-only", op)
	case !rule.ranged || m.Size == 0:
		// Nothing of the device is addressed: the sector is not
		// looked at (a flush's is (u64)-1).
		return 0, 0, nil
	}
	size := uint64(d.backend.Size())
	lbs := uint64(d.backend.LogicalBlockSize())
	// Past the end: ENOSPC for anything that writes, as NBD reports it
	// and as docs/server.md promises, whether the range starts inside
	// the device or beyond it (after a forced shrink, or a kernel
	// client's own resize beyond the export). EINVAL there made tools
	// take an O_DIRECT write for a misaligned buffer and write again
	// through the page cache, where the error was lost. A read past the
	// end is EINVAL.
	pastEnd := syscall.ENOSPC
	if op == OpRead {
		pastEnd = syscall.EINVAL
	}
	if m.Sector > size/512 {
		return 0, 0, refuse(pastEnd, "%s at sector %d, beyond the device's %d sectors", op, m.Sector, size/512)
	}
	start := m.Sector * 512
	if start%lbs != 0 || uint64(m.Size)%lbs != 0 {
		return 0, 0, refuse(syscall.EINVAL, "%s of %d bytes at byte %d, not aligned to the logical block size %d", op, m.Size, start, lbs)
	}
	if uint64(m.Size) > size-start {
		return 0, 0, refuse(pastEnd, "%s of %d bytes at byte %d runs past the end of the device (%d bytes)", op, m.Size, start, size)
	}
	return int64(start), int64(m.Size), nil
}

// HandleIO takes the requests of an RTRS session that has no RNBD
// session (its link event has not come, or it failed): they are refused.
// Those of an RNBD session go straight to it (SrvSession.HandleIO), which
// the link event made the RTRS session's IOHandler.
func (s *Server) HandleIO(op *rtrs.SrvOp) error {
	if s.closed.Load() {
		return syscall.ESHUTDOWN
	}
	s.rl.Log(s.log.WithField("session", op.Session().Name()), log.WarnLevel, "request refused: the session is not connected")
	return syscall.ENOTCONN
}

// HandleIO takes a request of the session from RTRS (rtrs.IOHandler), on
// the connection's receive path. A read or write that cannot block
// (blockdev's TryReadAt/TryWriteAt) runs right here: that costs a memory
// copy, where a hand-off to a worker costs a goroutine switch. Everything
// else runs on the workers, with what was found of it (srvReq): closing
// waits for IO and backend IO may block.
func (x *SrvSession) HandleIO(op *rtrs.SrvOp) error {
	s := x.srv
	if s.closed.Load() {
		return syscall.ESHUTDOWN
	}
	q := srvReq{op: op, x: x}
	typ, err := MsgType(op.Usr()) // serve refuses what is short
	if err == nil && typ == MsgIO && s.tryInline(&q) {
		return nil
	}
	if err == nil && typ == MsgOpen {
		// An OPEN opens a file, which on a mount that stopped
		// answering never returns: not on a worker, which the IO of
		// every session needs. (In flight at once: a session's
		// queue depth, as for any request.)
		s.serveApart(q)
		return nil
	}
	select {
	case s.ios <- q:
	default:
		// Every worker busy and the queue full: do not stall the
		// connection's receive path.
		s.serveApart(q)
	}
	return nil
}

// srvReq is a request on its way to a worker. An IO carries what the
// receive path found of it (tryInline): its message decoded and its
// device, so that the worker neither decodes nor looks it up again. The
// device comes without a reference (the worker takes one, and refuses
// the IO if it closed meanwhile): a reference held while the IO waits
// for a worker would let a CLOSE on a worker wait for IO queued behind
// it.
type srvReq struct {
	op *rtrs.SrvOp
	x  *SrvSession // the session it came on
	d  *SrvSessDev // the IO's device; nil: not found (or not an IO)
	m  IO          // the IO message, decoded if d is set
}

// serveApart serves q on a goroutine of its own.
func (s *Server) serveApart(q srvReq) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.serve(&q)
	}()
}

func (s *Server) worker() {
	defer s.wg.Done()
	for q := range s.ios {
		s.serve(&q)
	}
}

func (s *Server) serve(q *srvReq) {
	op, x := q.op, q.x
	typ, err := MsgType(op.Usr())
	if err != nil {
		op.Respond(x.refuse(msgFields(op), refuse(syscall.EINVAL, "message of %d bytes has no RNBD header", len(op.Usr()))))
		return
	}
	switch typ {
	case MsgIO:
		if err := x.processIO(q); err != errParked {
			op.Respond(err)
		}
	case MsgOpen:
		op.Respond(x.processOpen(op))
	case MsgSessInfo:
		op.Respond(x.processSessInfo(op))
	case MsgClose:
		op.Respond(x.processClose(op))
	default:
		op.Respond(x.refuse(msgFields(op), refuse(syscall.EINVAL, "message type %d is not one a client sends", typ)))
	}
}

// tryInline answers a plain read or write whose backend IO cannot block,
// and reports whether it did. Anything else, including every request
// that is refused or fails, is left to a worker, which logs it; q then
// carries the message decoded and its device, if found. q.op is an
// RNBD_MSG_IO (HandleIO looked).
func (s *Server) tryInline(q *srvReq) bool {
	op, m, x := q.op, &q.m, q.x
	if m.Decode(op.Usr()) != nil {
		return false
	}
	d := x.get(m.DeviceID)
	if d == nil {
		return false
	}
	defer d.refs.Done()
	q.d = d
	if s.beforeIO != nil {
		return false
	}
	if rw := m.RW &^ FSync; rw != uint32(OpRead) && rw != uint32(OpWrite) {
		return false
	}
	off, n, r := d.admit(m, op.Dir(), len(op.Data()))
	if r != nil || n == 0 {
		return false
	}
	if m.Op() == OpRead && op.CanRespondFrom() {
		// A large read of a memory backend over TCP is sent from the
		// mapping of the file, not copied into the chunk first.
		if src, h := d.backend.ReadView(off, len(op.Data())); src != nil {
			d.count(m, n)
			s.inline.Add(1)
			s.lent.Add(1)
			op.RespondFrom(src, h)
			return true
		}
	}
	var done bool
	var err error
	if m.Op() == OpRead {
		d.inflight.Add(1)
		done, err = d.backend.TryReadAt(op.Data(), off)
		d.inflight.Add(-1)
	} else {
		// Counted before it looks for a hold (processIO).
		d.writing.Add(1)
		if d.dev.held.Load() == nil {
			done, err = d.backend.TryWriteAt(op.Data(), off)
		}
		d.writing.Add(-1)
	}
	if !done || err != nil {
		return false // the worker does it again and reports the error
	}
	d.count(m, n)
	s.inline.Add(1)
	op.Respond(nil)
	return true
}

// processIO runs one IO on the backend, straight from or into the chunk.
// An IO whose device the receive path found (q.d) is not decoded nor
// looked up again; it is admitted again, as the device's size may have
// changed while it waited for a worker (a resize).
func (x *SrvSession) processIO(q *srvReq) error {
	op, m, d := q.op, &q.m, q.d
	if d == nil {
		if err := m.Decode(op.Usr()); err != nil {
			return x.refuse(msgFields(op), refuse(syscall.EINVAL, "malformed IO message: %v", err))
		}
		d = x.get(m.DeviceID)
	} else if !d.ref() {
		d = nil // closed since
	}
	if d == nil {
		return x.refuse(ioFields(op, m, ""), refuse(syscall.ENOTCONN, "IO for a device that is not open"))
	}
	defer d.refs.Done()
	if h := x.srv.beforeIO; h != nil {
		h()
	}
	off, n, r := d.admit(m, op.Dir(), len(op.Data()))
	if r != nil {
		return x.refuse(ioFields(op, m, d.name), r)
	}
	// A write is counted before it looks for a hold of the device's
	// writes: a hold that finds none counted knows every later one
	// parks.
	write := ioRules[m.Op()].write
	for write {
		d.writing.Add(1)
		h := d.dev.held.Load()
		if h == nil {
			break
		}
		d.writing.Add(-1)
		q.d = d // served again from here when the hold ends
		if h.park(q) {
			return errParked
		}
	}
	var err error
	if write {
		err = d.run(m, op.Data(), off, n)
		d.writing.Add(-1)
	} else {
		d.inflight.Add(1)
		err = d.run(m, op.Data(), off, n)
		d.inflight.Add(-1)
	}
	if err != nil {
		x.srv.rl.Log(x.log().WithFields(ioFields(op, m, d.name)).WithError(err), log.ErrorLevel, "IO failed on the backend")
		return err
	}
	d.count(m, n)
	return nil
}

// run does an admitted IO on the backend.
func (d *SrvSessDev) run(m *IO, data []byte, off, n int64) error {
	be := d.backend
	fua := m.RW&FFUA != 0
	switch op := m.Op(); op {
	case OpRead:
		return be.ReadAt(data, off)
	case OpWrite:
		if m.RW&FPreflush != 0 || (n == 0 && fua) {
			if err := be.Flush(); err != nil {
				return err
			}
		}
		if n == 0 {
			return nil
		}
		return be.WriteAt(data, off, fua)
	case OpFlush:
		return be.Flush()
	default:
		var err error
		switch op {
		case OpDiscard:
			err = be.Discard(off, n)
		case OpWriteZeroes:
			err = be.WriteZeroes(off, n, m.RW&FNoUnmap != 0)
		case OpSecureErase:
			err = be.SecureErase(off, n)
		}
		if err == nil && fua && n > 0 {
			err = be.Flush()
		}
		return err
	}
}

// count adds a completed IO to the device's counters: what reached the
// backend, so a flush is counted whatever carried it.
func (d *SrvSessDev) count(m *IO, n int64) {
	fua := m.RW&FFUA != 0
	switch m.Op() {
	case OpRead:
		d.reads.Add(1)
		d.rdSect.Add(uint64(n / 512))
		return
	case OpWrite:
		if m.RW&FPreflush != 0 || (n == 0 && fua) {
			d.flushes.Add(1)
		}
		if n > 0 {
			d.writes.Add(1)
		}
		d.wrSect.Add(uint64(n / 512))
	case OpFlush:
		d.flushes.Add(1)
		return
	case OpDiscard:
		d.discards.Add(1)
	case OpWriteZeroes:
		d.wzeros.Add(1)
	}
	if fua && n > 0 {
		d.fuas.Add(1)
	}
}

// ioFields describe an IO message and the RTRS request it came in, for a
// log line; device is the name the device was opened by, if it is open.
func ioFields(op *rtrs.SrvOp, m *IO, device string) log.Fields {
	f := log.Fields{
		"device_id": m.DeviceID, "op": m.Op().String(), "flags": FlagString(m.RW), "sector": m.Sector,
		"bi_size": m.Size, "rtrs_dir": op.Dir().String(), "data_len": len(op.Data()),
	}
	if device != "" {
		f["device"] = device
	}
	return f
}

// msgFields describe a message that is not (or not yet known to be) an
// IO, for a log line.
func msgFields(op *rtrs.SrvOp) log.Fields {
	return log.Fields{"usr_len": len(op.Usr()), "rtrs_dir": op.Dir().String(), "data_len": len(op.Data())}
}

// refuse logs, rate-limited, a request the session's server will not run
// and returns the errno its client gets.
func (x *SrvSession) refuse(f log.Fields, r *refusal) error {
	x.srv.rl.Log(x.log().WithFields(f).WithField("errno", r.errno.Error()), log.WarnLevel, "request refused: "+r.why)
	return r.errno
}
