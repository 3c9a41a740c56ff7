package rtrs

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"syscall"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// cltConn is one connection of a client path (struct rtrs_clt_con) and the
// handler of its completions.
type cltConn struct {
	path  *CltPath
	res   *pathRes
	cid   int
	qp    fabric.Conn
	wrCnt atomic.Uint32

	// IUs receive RKEY_RSP messages when the server rotates rkeys.
	iuMem fabric.Memory
	iuMR  fabric.MR
	nIU   int

	// Scratch work requests: rwr and hbAck are used only by the receive
	// completion goroutine, hbMsg only by heartbeat ticks.
	rwr   [2]fabric.RecvWR
	hbAck fabric.SendWR
	hbMsg fabric.SendWR

	// burst: the completions of one read, when the fabric ends them
	// with BurstEnd (bursts); docs/rtrs.md, "Batching".
	burst  Burst
	bursts bool
}

func (c *cltConn) recvQueueSize() int {
	if c.cid == 0 {
		return 2 * ServiceConQueueDepth
	}
	// x2 for read responses plus the invalidations that precede them
	return 2 * c.res.queueDepth
}

func (c *cltConn) allocIUs() error {
	if c.res.flags&MsgNewRkeyF == 0 {
		return nil
	}
	n := c.recvQueueSize()
	mem, err := c.path.sess.cfg.Fabric.AllocMemory(n * RkeyRspSize)
	if err != nil {
		return err
	}
	mr, err := c.res.pd.RegisterMR(mem.Bytes(), fabric.AccessLocalWrite)
	if err != nil {
		mem.Free()
		return err
	}
	c.iuMem, c.iuMR, c.nIU = mem, mr, n
	return nil
}

func (c *cltConn) freeIUs() {
	if c.iuMR != nil {
		c.iuMR.Close()
		c.iuMem.Free()
		c.iuMR, c.iuMem = nil, nil
	}
}

func (c *cltConn) iu(i int) []byte {
	return c.iuMem.Bytes()[i*RkeyRspSize : (i+1)*RkeyRspSize]
}

// postRecvs posts the connection's receives once the path info is known
// (post_recv_io): IUs when the server sends new rkeys, else empty ones.
func (c *cltConn) postRecvs() error {
	// Not the scratch rwr: this runs on cid 0's receive goroutine while
	// c's own may already be reposting.
	r := &fabric.RecvWR{ID: wrEmpty}
	for i := 0; i < c.recvQueueSize(); i++ {
		if c.nIU > 0 {
			*r = fabric.RecvWR{ID: wrIU | uint64(i), Buf: c.iu(i), LKey: c.iuMR.LKey()}
		}
		if err := c.qp.PostRecv(r); err != nil {
			return err
		}
	}
	return nil
}

// repost posts receive IU i, or an empty receive when rkeys are fixed.
func (c *cltConn) repost(i int) error {
	if c.nIU > 0 {
		c.rwr[0] = fabric.RecvWR{ID: wrIU | uint64(i), Buf: c.iu(i), LKey: c.iuMR.LKey()}
	} else {
		c.rwr[0] = fabric.RecvWR{ID: wrEmpty}
	}
	return c.qp.PostRecv(&c.rwr[0])
}

func (c *cltConn) postEmpty(n int) error {
	c.rwr[0] = fabric.RecvWR{ID: wrEmpty}
	c.rwr[1] = fabric.RecvWR{ID: wrEmpty}
	if n == 2 {
		c.rwr[0].Next = &c.rwr[1]
	}
	return c.qp.PostRecv(&c.rwr[0])
}

// postHB posts an empty write with a heartbeat immediate.
func (c *cltConn) postHB(imm uint32) error {
	wr := &c.hbMsg
	if imm == ImmHBAck {
		wr = &c.hbAck
	}
	*wr = fabric.SendWR{ID: wrHB, Op: fabric.OpWriteImm, Imm: ToImm(imm, 0)}
	wr.Signaled = c.wrCnt.Add(1)%c.res.sigIntv == 0
	return c.qp.PostSend(wr)
}

// fail is a failure of the connection: it is logged, at a level that
// depends on what the path is doing, and the path recovers
// (errorRecovery). srvConn.fail is the server's.
func (c *cltConn) fail(msg string, err error) {
	p := c.path
	e := p.lg().WithFields(log.Fields{"cid": c.cid}).WithError(err)
	switch st := p.State(); {
	case st == CltPathClosing || st == CltPathClosed || st == CltPathDead || p.curRes() != c.res:
		// We are closing and the peer closed the rest (the kernel's
		// server closes a whole path when one connection goes), or it
		// is a stale attempt's connection: nothing is lost.
		e.Debug(msg + " while the path closes")
	case st == CltPathReconnecting || st == CltPathConnectingErr:
		// Another connection of the path failed first and said so.
		e.Debug(msg + " while the path recovers")
	case errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ECONNRESET):
		// The peer hung up: the path recovers, and says so.
		p.rl.Log(e, log.WarnLevel, msg)
	default:
		p.rl.Log(e, log.ErrorLevel, msg)
	}
	p.errorRecovery(c.res)
}

// Attached learns the connection before it can complete anything.
func (c *cltConn) Attached(qp fabric.Conn) {
	c.qp = qp
	_, c.bursts = qp.(fabric.Flusher)
}

// BurstEnd flushes what the burst's completions deferred.
func (c *cltConn) BurstEnd() { c.burst.end() }

// curBurst is the burst completions are delivered in, or nil.
func (c *cltConn) curBurst() *Burst {
	if c.bursts {
		return &c.burst
	}
	return nil
}

// Disconnected is a connection error: recover the path.
func (c *cltConn) Disconnected(err error) {
	c.fail("connection lost", err)
}

// Completion is rtrs_clt_rdma_done.
func (c *cltConn) Completion(wc *fabric.WC) {
	p, res := c.path, c.res
	if wc.Status != fabric.WCSuccess {
		c.fail("work request failed", fmt.Errorf("status %d", wc.Status))
		return
	}
	switch wrKind(wc.ID) {
	case wrInfoRsp:
		err := res.processInfoRsp(wc)
		select {
		case res.infoDone <- err:
		default:
		}
		return
	case wrInfoReq, wrIO, wrHB:
		return // signaled send completions
	}
	switch wc.Opcode {
	case fabric.WCRecvRDMAWithImm:
		p.hb.alive()
		typ, payload := FromImm(wc.Imm)
		wInv := false
		switch typ {
		case ImmIORsp, ImmIORspWInv:
			wInv = typ == ImmIORspWInv
			msgID, errno := FromIORspImm(payload)
			if err := res.processIORsp(msgID, errno, c.curBurst()); err != nil {
				c.fail("malformed IO response", err)
				return
			}
		case ImmHBMsg:
			if err := c.postHB(ImmHBAck); err != nil {
				c.fail("sending heartbeat ack failed", err)
				return
			}
		case ImmHBAck:
			p.hb.ack()
		default:
			p.rl.Log(p.lg().WithField("imm_type", typ), log.WarnLevel, "unknown immediate type")
		}
		var err error
		if wrKind(wc.ID) == wrIU {
			err = c.repost(int(wc.ID & wrIndexMask))
		} else if wInv {
			// one for this write, one for the SEND_WITH_INV before it
			err = c.postEmpty(2)
		} else {
			err = c.postEmpty(1)
		}
		if err != nil {
			c.fail("posting a receive failed", err)
		}
	case fabric.WCRecv:
		p.hb.alive()
		if c.nIU == 0 {
			return // a SEND_WITH_INV; the response after it reposts
		}
		i := int(wc.ID & wrIndexMask)
		if wrKind(wc.ID) != wrIU || i >= c.nIU {
			c.fail("receive completion for an unknown buffer", syscall.EPROTO)
			return
		}
		if wc.Flags&fabric.WCWithInv == 0 {
			if err := c.rkeyRspDone(wc, c.iu(i)); err != nil {
				c.fail("malformed rkey response", err)
				return
			}
		}
		if err := c.repost(i); err != nil {
			c.fail("posting a receive failed", err)
		}
	}
}

// rkeyRspDone takes the chunk's new rkey, then completes the request
// (rtrs_clt_rkey_rsp_done).
func (c *cltConn) rkeyRspDone(wc *fabric.WC, buf []byte) error {
	res := c.res
	var msg RkeyRsp
	if wc.ByteLen < RkeyRspSize {
		return fmt.Errorf("rkey response of %d bytes: %w", wc.ByteLen, syscall.EPROTO)
	}
	if err := msg.Decode(buf); err != nil {
		return fmt.Errorf("%v: %w", err, syscall.EPROTO)
	}
	if int(msg.BufID) >= res.queueDepth || wc.Flags&fabric.WCWithImm == 0 {
		return fmt.Errorf("rkey response for buf_id %d: %w", msg.BufID, syscall.EPROTO)
	}
	typ, payload := FromImm(wc.Imm)
	if typ != ImmIORsp && typ != ImmIORspWInv {
		return nil
	}
	msgID, errno := FromIORspImm(payload)
	if msgID != uint32(msg.BufID) {
		return fmt.Errorf("rkey response for buf_id %d with msg_id %d: %w", msg.BufID, msgID, syscall.EPROTO)
	}
	res.rbufs[msg.BufID].rkey.Store(msg.RKey)
	return res.processIORsp(msgID, errno, c.curBurst())
}
