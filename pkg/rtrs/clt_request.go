package rtrs

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Requests of a client session (rtrs_clt_request): posting one on a path
// the multipath policy picks, its response, failover to another path,
// and the synchronous Do.

// Confirmer receives the result of a request: nil, a syscall.Errno the
// server answered, or an error of this package. It is called exactly once,
// from a fabric goroutine, and must not block.
type Confirmer interface {
	Confirm(err error)
}

// Request sends one request on permit p (rtrs_clt_request). For Write, the
// n bytes at buf[off:] and the user header usr are written into the
// permit's chunk on the server; for Read, the server writes n bytes of
// answer into buf[off:]. conf is told the outcome. A request that finds no
// connected path fails at once with ErrNoPath, as in the kernel: waiting
// for a path is the user's (pkg/rnbd holds block requests until their
// device is open again). The error returned here means conf is not told.
func (s *CltSession) Request(dir Dir, p *Permit, conf Confirmer, usr []byte, buf *Buffer, off, n int) error {
	return s.RequestPlugged(nil, dir, p, conf, usr, buf, off, n)
}

// RequestPlugged is Request, the request held in pl (if not nil) until
// pl.Unplug (docs/rtrs.md, "Batching").
func (s *CltSession) RequestPlugged(pl *Plug, dir Dir, p *Permit, conf Confirmer, usr []byte, buf *Buffer, off, n int) error {
	if s.closed.Load() {
		return ErrClosed
	}
	if p == nil || p.sess != s || !p.held.Load() {
		return errors.New("rtrs: request on a permit not held")
	}
	if conf == nil {
		return errors.New("rtrs: request without a confirmer")
	}
	hdrLen := RDMAWriteSize
	if dir == Read {
		hdrLen = RDMAReadSize + SGDescSize
	}
	if len(usr)+hdrLen > s.hdrSlot || len(usr) > 0xffff {
		return ErrMsgSize
	}
	if n < 0 || n > s.MaxIOSize() {
		return ErrMsgSize
	}
	if n > 0 {
		if buf == nil || buf.sess != s || off < 0 || off > len(buf.b) || n > len(buf.b)-off {
			return errors.New("rtrs: data outside the registered buffer")
		}
	}
	r := &p.req
	r.dir, r.conf, r.buf, r.off, r.n = dir, conf, buf, off, n
	r.usrLen = copy(p.hdr, usr)
	r.start = time.Now()
	_, err := s.submit(p, pl)
	return err
}

// submit tries the paths in the policy's order and posts p on the first
// connected one that takes it, held in pl if not nil.
func (s *CltSession) submit(p *Permit, pl *Plug) (*CltPath, error) {
	var it pathIter
	it.init(s, *s.pathsSnap.Load())
	tooBig := false
	for path := it.next(); path != nil; path = it.next() {
		err := path.post(p, pl)
		if err == nil {
			return path, nil
		}
		// Paths may run to servers of different limits: one too
		// small is no reason not to try the next.
		tooBig = tooBig || errors.Is(err, ErrMsgSize)
	}
	if tooBig {
		return nil, ErrMsgSize
	}
	return nil, ErrNoPath
}

// post sends request pm on this path if it is connected
// (rtrs_clt_write_req / rtrs_clt_read_req), held in pl if not nil.
func (p *CltPath) post(pm *Permit, pl *Plug) error {
	p.submitMu.RLock()
	defer p.submitMu.RUnlock()
	if p.State() != CltPathConnected {
		return errPathDown
	}
	res := p.res
	r := &pm.req
	hdrLen := RDMAWriteSize
	if r.dir == Read {
		hdrLen = RDMAReadSize
		if r.n > 0 {
			hdrLen += SGDescSize
		}
	}
	if r.usrLen+hdrLen > res.maxHdrSize || hdrLen+r.n+r.usrLen > res.chunkSize {
		return ErrMsgSize
	}
	mrs := *res.mrs.Load()
	hdrMR := mrs[0]
	var dataMR fabric.MR
	if r.n > 0 {
		if r.buf.idx >= len(mrs) || mrs[r.buf.idx] == nil {
			return errors.New("rtrs: buffer not registered")
		}
		dataMR = mrs[r.buf.idx]
	}
	con := res.conns[0]
	if pm.conType == IOCon && len(res.conns) > 1 {
		con = res.conns[1+int(pm.id)%(len(res.conns)-1)]
	}
	rb := &res.rbufs[pm.id]
	pr := &res.reqs[pm.id]
	wr := &pr.wr
	*wr = fabric.SendWR{ID: wrIO | uint64(pm.id), Op: fabric.OpWriteImm, RKey: rb.rkey.Load()}
	if r.dir == Write {
		(&RDMAWrite{UsrLen: uint16(r.usrLen)}).Encode(pm.hdr[r.usrLen:])
		hdr := fabric.SGE{Buf: pm.hdr[:r.usrLen+RDMAWriteSize], LKey: hdrMR.LKey()}
		if r.n > 0 {
			wr.SG[0] = fabric.SGE{Buf: r.buf.b[r.off : r.off+r.n], LKey: dataMR.LKey()}
			wr.SG[1] = hdr
			wr.NumSGE = 2
		} else {
			wr.SG[0], wr.NumSGE = hdr, 1
		}
		wr.RemoteAddr = rb.addr
	} else {
		msg := RDMARead{UsrLen: uint16(r.usrLen)}
		if r.n > 0 {
			msg.SGCnt = 1
			msg.Desc = SGDesc{Addr: dataMR.Addr() + uint64(r.off), Key: dataMR.RKey(), Len: uint32(r.n)}
		}
		msg.Encode(pm.hdr[r.usrLen:])
		wr.SG[0] = fabric.SGE{Buf: pm.hdr[:r.usrLen+msg.Size()], LKey: hdrMR.LKey()}
		wr.NumSGE = 1
		// The message goes after the room for the data, so the server
		// finds it where a write's would be.
		wr.RemoteAddr = rb.addr + uint64(r.n)
	}
	wr.Imm = ToImm(ImmIOReq, pm.memOff+uint32(r.n+r.usrLen))
	wr.Signaled = con.wrCnt.Add(1)%res.sigIntv == 0
	if pl != nil {
		pl.hold(con.qp, wr)
	}
	pr.inUse.Store(true)
	p.stats.update(r.dir, r.usrLen+r.n)
	if err := con.qp.PostSend(wr); err != nil {
		if !pr.inUse.CompareAndSwap(true, false) {
			// The connection failed after taking the request and its
			// completion (or the failover of it) already ran.
			return nil
		}
		p.stats.inflight.Add(-1)
		p.postRL.Log(p.lg().WithError(err), log.WarnLevel, "posting a request failed")
		return err
	}
	return nil
}

// processIORsp completes the request msgID (process_io_rsp) in burst b
// (nil: none).
func (res *pathRes) processIORsp(msgID uint32, errno syscall.Errno, b *Burst) error {
	if int(msgID) >= res.queueDepth {
		return fmt.Errorf("response for msg_id %d >= queue depth %d: %w", msgID, res.queueDepth, syscall.EPROTO)
	}
	p := res.path
	if !res.reqs[msgID].inUse.CompareAndSwap(true, false) {
		p.rl.Log(p.lg().WithField("msg_id", msgID), log.WarnLevel, "response for a request not in flight: ignored")
		return nil
	}
	p.stats.inflight.Add(-1)
	pm := &p.sess.permits[msgID]
	p.stats.observeLatency(pm.req.dir, time.Since(pm.req.start))
	var err error
	if errno != 0 {
		err = errno
	}
	if bc, ok := pm.req.conf.(BurstConfirmer); ok {
		bc.ConfirmBurst(err, b)
	} else {
		pm.req.conf.Confirm(err)
	}
	return nil
}

// failover re-issues a request whose path, from, failed on another
// connected path (rtrs_clt_failover_req); without one it fails with
// ErrNoPath. It is counted on both: the path that took it (failover_cnt,
// as the kernel counts) and the one it left (FailedOverCount).
func (s *CltSession) failover(from *CltPath, p *Permit) {
	if s.closed.Load() {
		p.req.conf.Confirm(ErrClosed)
		return
	}
	path, err := s.submit(p, nil)
	if err == nil {
		path.stats.failoverCnt.Add(1)
		from.stats.failedOver.Add(1)
		return
	}
	p.req.conf.Confirm(err)
}

// chanConfirmer delivers a result on a channel.
type chanConfirmer chan error

func (c chanConfirmer) Confirm(err error) { c <- err }

// Do runs one request synchronously: it takes a permit, sends, waits and
// returns the permit. It is for admin messages and tools; the IO path
// should use Request with its own Confirmer. If ctx ends first, Do
// returns ErrAbandoned with ctx's error at once; the request stays in
// flight, its permit is returned when it completes or fails (a path
// failure, the session's close), and until then the server may still
// write into buf: the caller must not reuse buf's range.
func (s *CltSession) Do(ctx context.Context, t ConType, dir Dir, usr []byte, buf *Buffer, off, n int) error {
	p, err := s.GetPermit(ctx, t)
	if err != nil {
		return err
	}
	done := make(chanConfirmer, 1)
	if err := s.Request(dir, p, done, usr, buf, off, n); err != nil {
		s.PutPermit(p)
		return err
	}
	select {
	case err = <-done:
		s.PutPermit(p)
		return err
	case <-ctx.Done():
		go func() {
			<-done
			s.PutPermit(p)
		}()
		return fmt.Errorf("%w: %w", ErrAbandoned, ctx.Err())
	}
}
