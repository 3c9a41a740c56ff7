package rtrs

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// srvConn is one connection of a server path and its completion handler.
type srvConn struct {
	path     *SrvPath
	cid      int
	qp       fabric.Conn
	attached atomic.Bool
	// anySource: qp may send from any memory (fabric.AnySource), asked
	// once, not per IO.
	anySource bool

	// sendMu guards the send queue accounting: work requests are
	// credited back when a signaled one completes, which retires every
	// request posted before it (sq_wr_avail, rsp_wr_wait_list).
	sendMu sync.Mutex
	// +checklocks:sendMu
	sqAvail int
	// +checklocks:sendMu
	unsig int
	// +checklocks:sendMu
	sigIntv int
	// +checklocks:sendMu
	waiting []*SrvOp
	// +checklocks:sendMu
	closed bool // set by takeWaiting: nothing is parked after it
	// posted counts the work requests posted, sent those known to be
	// out (a signaled one completed); holds are the Holds of answers
	// sent from memory of the user's (RespondFrom), each released once
	// sent reaches the count at its post.
	// +checklocks:sendMu
	posted uint64
	// +checklocks:sendMu
	sent uint64
	// +checklocks:sendMu
	holds []heldSend

	rwr    fabric.RecvWR // scratch for reposting (receive goroutine only)
	hbWR   [2]fabric.SendWR
	infoWR fabric.SendWR
}

// Attached learns the connection. It runs on the accepting goroutine; the
// flag publishes qp to the other connections' goroutines.
func (c *srvConn) Attached(qp fabric.Conn) {
	c.qp = qp
	a, ok := qp.(fabric.AnySource)
	c.anySource = ok && a.AnySource()
	c.attached.Store(true)
}

func (c *srvConn) postRecvs() error {
	n := c.path.sess.queueDepth
	if c.cid == 0 {
		n = ServiceConQueueDepth
	}
	// Not the scratch rwr: this runs on cid 0's receive goroutine while
	// c's own may already be reposting.
	r := &fabric.RecvWR{ID: wrEmpty}
	for i := 0; i < n; i++ {
		if err := c.qp.PostRecv(r); err != nil {
			return err
		}
	}
	return nil
}

// post posts a chain of n work requests, or parks op until the send queue
// has room and reports that (op nil: the caller does not retry and gets
// ErrQueueFull). An op posted is opAnswering: the client may have its
// answer before post returns. The caller finishes an op not parked.
func (c *srvConn) post(wr *fabric.SendWR, n int, op *SrvOp) (parked bool, err error) {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	if c.closed {
		return false, ErrClosed
	}
	if c.sqAvail < n {
		if op == nil {
			return false, fabric.ErrQueueFull
		}
		c.waiting = append(c.waiting, op)
		return true, nil
	}
	last := wr
	for last.Next != nil {
		last = last.Next
	}
	held := op != nil && op.hold != nil
	unsig := c.unsig
	c.unsig += n
	// An answer sent from the user's memory is signaled, so that its
	// hold is released as soon as it is out.
	if c.unsig >= c.sigIntv || held {
		last.Signaled = true
		last.ID = wrRsp | uint64(c.unsig)
		c.unsig = 0
	}
	if op != nil {
		op.state.Store(opAnswering)
	}
	if err := c.qp.PostSend(wr); err != nil {
		// Not posted: the counts stay those of what was, so that no
		// completion is taken for more than it retires.
		c.unsig, last.Signaled = unsig, false
		return false, err
	}
	c.sqAvail -= n
	c.posted += uint64(n)
	if held {
		c.holds = append(c.holds, heldSend{c.posted, op.hold})
		op.hold = nil
	}
	return false, nil
}

// heldSend is an answer's Hold and the posted count that sends it.
type heldSend struct {
	seq  uint64
	hold Hold
}

// releaseSent releases the holds of what has been sent, one at a time
// outside sendMu: the last hold of a mapping unmaps it, which is not
// to be done with the connection's posts waiting.
func (c *srvConn) releaseSent() {
	for {
		c.sendMu.Lock()
		if len(c.holds) == 0 || c.holds[0].seq > c.sent {
			c.sendMu.Unlock()
			return
		}
		h := c.holds[0].hold
		n := copy(c.holds, c.holds[1:])
		c.holds[n] = heldSend{}
		c.holds = c.holds[:n]
		c.sendMu.Unlock()
		h.Release()
	}
}

// releaseHolds releases every hold once the connection is closed: its
// answers are sent or dropped, and no buffer is read any more.
func (c *srvConn) releaseHolds() {
	c.sendMu.Lock()
	c.sent = c.posted
	c.sendMu.Unlock()
	c.releaseSent()
}

// takeWaiting closes the connection for posting and returns the ops that
// were parked on it: the closing path finishes them, and a response
// arriving after this fails at once instead of being parked for ever.
func (c *srvConn) takeWaiting() []*SrvOp {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	c.closed = true
	w := c.waiting
	c.waiting = nil
	return w
}

func (c *srvConn) postHB(imm uint32) error {
	wr := &c.hbWR[0]
	if imm == ImmHBAck {
		wr = &c.hbWR[1]
	}
	*wr = fabric.SendWR{ID: wrHB, Op: fabric.OpWriteImm, Imm: ToImm(imm, 0)}
	_, err := c.post(wr, 1, nil)
	return err
}

// fail is a failure of the connection, or a violation of the protocol by
// the client: it is logged and the whole path closes (cltConn.fail is the
// client's).
func (c *srvConn) fail(msg string, err error) {
	p := c.path
	e := p.lg().WithField("cid", c.cid)
	if err != nil {
		e = e.WithError(err)
	}
	p.rl.Log(e, log.ErrorLevel, msg)
	p.close(msg)
}

func (c *srvConn) Disconnected(err error) {
	// A peer hanging up is routine; anything else (a remote access
	// violation, a protocol error) is worth a warning.
	level := log.WarnLevel
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ECONNRESET) {
		level = log.InfoLevel
	}
	rl := &c.path.rl
	if c.path.State() == SrvPathConnecting {
		rl = &c.path.sess.srv.unprovenRL // as close logs it: a churner's paths are many
	}
	rl.Log(c.path.lg().WithField("cid", c.cid).WithError(err), level, "connection lost")
	c.path.close("connection lost")
}

// Completion is rtrs_srv_rdma_done.
func (c *srvConn) Completion(wc *fabric.WC) {
	p := c.path
	if wc.Status != fabric.WCSuccess {
		c.fail("work request failed", fmt.Errorf("status %d", wc.Status))
		return
	}
	switch wc.Opcode {
	case fabric.WCRecv:
		if wrKind(wc.ID) != wrInfoReq {
			c.fail("unexpected send from the client", nil)
			return
		}
		if err := p.processInfoReq(c, wc); err != nil {
			c.fail("path info request refused", err)
		}
	case fabric.WCRecvRDMAWithImm:
		p.hb.alive()
		c.rwr = fabric.RecvWR{ID: wrEmpty}
		if err := c.qp.PostRecv(&c.rwr); err != nil {
			c.fail("posting a receive failed", err)
			return
		}
		typ, payload := FromImm(wc.Imm)
		switch typ {
		case ImmIOReq:
			if p.State() != SrvPathConnected {
				// No chunks yet (they come with INFO_REQ), or the
				// path is closing. Seeing it CONNECTED (an atomic)
				// also makes the chunks allocChunks made visible here.
				p.rl.Log(p.lg(), log.WarnLevel, "request on a path that is not connected: dropped")
				return
			}
			x := p.sess
			msgID, off := payload>>p.memBits, payload&(1<<p.memBits-1)
			if int(msgID) >= x.queueDepth || int(off) >= x.chunkSize {
				c.fail("request with a wrong msg_id or offset", fmt.Errorf("msg_id %d off %d", msgID, off))
				return
			}
			if p.wins != nil {
				// The request is processed when the window is
				// gone (the kernel waits for its LOCAL_INV).
				p.winOff[msgID] = off
				if err := p.wins[msgID].Unbind(c.qp, wrUnbind|uint64(msgID)); err != nil {
					c.fail("unbinding a chunk's window failed", err)
				}
				return
			}
			if p.sess.srv.cfg.AlwaysInvalidate {
				if err := p.mrs[msgID].Invalidate(); err != nil {
					c.fail("invalidating a chunk failed", err)
					return
				}
			}
			if err := p.processIOReq(c, msgID, off); err != nil {
				c.fail("malformed request", err)
			}
		case ImmHBMsg:
			if err := c.postHB(ImmHBAck); err != nil {
				c.fail("sending heartbeat ack failed", err)
			}
		case ImmHBAck:
		default:
			p.rl.Log(p.lg().WithField("imm_type", typ), log.WarnLevel, "unknown immediate type")
		}
	case fabric.WCBind:
		msgID := uint32(wc.ID & wrIndexMask)
		if wrKind(wc.ID) != wrUnbind || int(msgID) >= len(p.winOff) {
			return
		}
		if err := p.processIOReq(c, msgID, p.winOff[msgID]); err != nil {
			c.fail("malformed request", err)
		}
	case fabric.WCSend, fabric.WCWrite:
		if wrKind(wc.ID) != wrRsp {
			return
		}
		c.sendMu.Lock()
		c.sqAvail += int(wc.ID & wrIndexMask)
		c.sent += wc.ID & wrIndexMask
		held := len(c.holds) > 0
		waiting := c.waiting
		c.waiting = nil
		c.sendMu.Unlock()
		if held {
			c.releaseSent()
		}
		for i, op := range waiting {
			parked, err := c.post(&op.wrs[0], op.nwr, op)
			if err != nil {
				c.fail("posting a response failed", err)
				for _, op := range waiting[i:] {
					op.finish()
				}
				return
			}
			if !parked {
				op.finish()
			}
		}
	}
}
