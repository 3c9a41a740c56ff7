// A connection: its QP, CQ and channels, the goroutines that poll the CQ
// and turn CM events into Disconnected, work requests posted (held for one
// post per batch of completions), and Close.

package rdma

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// conn is one RC connection: QP, CQ, completion channel, CM ID and event
// channel, and the two goroutines that serve them.
type conn struct {
	ch *ibverbs.EventChannel
	id *ibverbs.CMID
	cc *ibverbs.CompChannel
	cq *ibverbs.CQ
	qp *ibverbs.QP
	h  fabric.Handler
	bh fabric.BurstHandler // h, if it is one

	local  netip.AddrPort
	remote netip.AddrPort

	closing   atomic.Bool
	failed    atomic.Bool // Disconnected was reported
	closeOnce sync.Once
	wg        sync.WaitGroup

	// Work requests held for one ibv_post_send (fabric.Flusher): those
	// posted during a batch of completions, until the batch is
	// delivered, and those posted with More, until Flush. On a device
	// whose doorbell is a system call (rxe), that is one call per batch.
	heldMu sync.Mutex
	// +checklocks:heldMu
	held [ibverbs.MaxChain]ibverbs.SendWR
	// +checklocks:heldMu
	nHeld int
	// +checklocks:heldMu
	inBurst bool // the poll loop is delivering a batch
}

// setup makes the CQ and QP and posts the first receives; the handler
// learns the connection before anything can complete.
func (c *conn) setup(p *pd, attr fabric.ConnAttr) error {
	x := p.dev.x
	var err error
	if c.cc, err = x.NewCompChannel(); err != nil {
		return err
	}
	if c.cq, err = x.NewCQ(attr.MaxSendWR+attr.MaxRecvWR, c.cc); err != nil {
		return err
	}
	if c.qp, err = c.id.CreateQP(p.p, c.cq, ibverbs.QPCaps{MaxSendWR: attr.MaxSendWR, MaxRecvWR: attr.MaxRecvWR}); err != nil {
		return err
	}
	c.bh, _ = c.h.(fabric.BurstHandler)
	attr.Handler.Attached(c)
	for i := range attr.Recvs {
		r := attr.Recvs[i]
		r.Next = nil
		if err := c.PostRecv(&r); err != nil {
			return err
		}
	}
	return nil
}

// start runs the completion and CM event goroutines.
func (c *conn) start() {
	c.wg.Add(2)
	go c.pollLoop()
	go c.eventLoop()
}

// fail reports the connection's failure once, unless it is being closed.
func (c *conn) fail(err error) {
	if c.closing.Load() || !c.failed.CompareAndSwap(false, true) {
		return
	}
	c.h.Disconnected(err)
}

func (c *conn) pollLoop() {
	defer c.wg.Done()
	wcs := make([]ibverbs.WC, ibverbs.MaxPoll)
	var fwc fabric.WC
	for {
		if err := c.cq.ReqNotify(); err != nil {
			c.fail(err)
			return
		}
		// Everything that completed before the notification was armed,
		// and what completes while a batch is delivered: the poll is
		// done in user space, the wait and the re-arm are system calls.
		for {
			n, err := c.cq.Poll(wcs)
			if err != nil {
				c.fail(err)
				return
			}
			if n == 0 {
				break
			}
			c.burst(true)
			for i := 0; i < n; i++ {
				c.deliver(&wcs[i], &fwc)
			}
			c.burst(false)
		}
		if _, err := c.cc.Wait(); err != nil {
			return // interrupted by Close
		}
	}
}

// WCError is a work request that failed on the device.
type WCError struct {
	Status    ibverbs.WCStatus
	VendorErr uint32
}

func (e *WCError) Error() string {
	return fmt.Sprintf("rdma fabric: work request failed: %v (vendor error %#x)", e.Status, e.VendorErr)
}

func (e *WCError) Unwrap() error {
	switch e.Status {
	case ibverbs.WCRemAccessErr, ibverbs.WCLocProtErr:
		return syscall.EACCES
	case ibverbs.WCLocLenErr:
		return syscall.EMSGSIZE
	case ibverbs.WCRetryExcErr, ibverbs.WCRNRRetryExc:
		return syscall.ETIMEDOUT
	}
	return syscall.EIO
}

func (c *conn) deliver(w *ibverbs.WC, out *fabric.WC) {
	if c.failed.Load() || c.closing.Load() {
		return // what follows an error is flushed
	}
	if w.Status == ibverbs.WCWRFlushErr {
		// Flushed before anything failed: the QP was moved to the error
		// state from outside (the peer's or the CM's disconnect).
		c.fail(fmt.Errorf("rdma fabric: work requests flushed: %w", ErrDisconnected))
		return
	}
	if w.Status != ibverbs.WCSuccess {
		c.fail(&WCError{Status: w.Status, VendorErr: w.VendorErr})
		return
	}
	*out = fabric.WC{ID: w.ID, Status: fabric.WCSuccess, ByteLen: w.ByteLen, Imm: w.Imm, InvRKey: w.InvRKey}
	switch w.Opcode {
	case ibverbs.WCSend:
		out.Opcode = fabric.WCSend
	case ibverbs.WCRDMAWrite:
		out.Opcode = fabric.WCWrite
	case ibverbs.WCRecv:
		out.Opcode = fabric.WCRecv
	case ibverbs.WCRecvRDMAWithImm:
		out.Opcode = fabric.WCRecvRDMAWithImm
	case ibverbs.WCBindMW:
		out.Opcode = fabric.WCBind
	default:
		return // a local invalidate of our own
	}
	if w.Flags&ibverbs.WCFlagWithImm != 0 {
		out.Flags |= fabric.WCWithImm
	}
	if w.Flags&ibverbs.WCFlagWithInv != 0 {
		out.Flags |= fabric.WCWithInv
	}
	c.h.Completion(out)
}

// ErrDisconnected is what Handler.Disconnected gets when the peer (or
// the network) ended the connection.
var ErrDisconnected = fmt.Errorf("rdma fabric: disconnected: %w", syscall.ECONNRESET)

// disconnectGrace is how long a disconnect from the peer waits for a
// work completion that explains it: a peer that tears the connection down
// because of our remote access error sends its DREQ about when the NAK
// reaches our CQ, and the error says more than "disconnected".
const disconnectGrace = 100 * time.Millisecond

// peerGone reports err once the CQ had a moment to report something
// better.
func (c *conn) peerGone(err error) {
	for end := time.Now().Add(disconnectGrace); !c.failed.Load() && time.Now().Before(end); {
		time.Sleep(5 * time.Millisecond)
	}
	c.fail(err)
}

func (c *conn) eventLoop() {
	defer c.wg.Done()
	for {
		ev, err := c.ch.Next()
		if err != nil {
			return // interrupted by Close
		}
		switch ev.Type {
		case ibverbs.EventEstablished, ibverbs.EventTimewaitExit:
		case ibverbs.EventDisconnected:
			c.peerGone(ErrDisconnected)
		case ibverbs.EventRejected, ibverbs.EventConnectError, ibverbs.EventUnreachable:
			// The peer (or the CM on its behalf) ended a connection its
			// side had not seen established yet: a REJ, not a DREQ.
			c.peerGone(fmt.Errorf("rdma fabric: %v: %w", ev.Type, ErrDisconnected))
		case ibverbs.EventDeviceRemoval:
			c.fail(fmt.Errorf("rdma fabric: device removed: %w", syscall.ENODEV))
		case ibverbs.EventAddrChange:
			c.fail(fmt.Errorf("rdma fabric: address changed: %w", syscall.EADDRNOTAVAIL))
		default:
			c.fail(fmt.Errorf("rdma fabric: %v: %w", ev.Type, cmErrno(ev)))
		}
	}
}

func sendOpcode(op fabric.Opcode) (ibverbs.WROpcode, error) {
	switch op {
	case fabric.OpWrite:
		return ibverbs.WRRDMAWrite, nil
	case fabric.OpWriteImm:
		return ibverbs.WRRDMAWriteWithImm, nil
	case fabric.OpSend:
		return ibverbs.WRSend, nil
	case fabric.OpSendImm:
		return ibverbs.WRSendWithImm, nil
	case fabric.OpSendInv:
		return ibverbs.WRSendWithInv, nil
	}
	return 0, fmt.Errorf("rdma fabric: opcode %v: %w", op, syscall.EINVAL)
}

func sge(b []byte, lkey uint32) ibverbs.SGE {
	if len(b) == 0 {
		return ibverbs.SGE{}
	}
	return ibverbs.SGE{Addr: uint64(uintptr(unsafe.Pointer(&b[0]))), Length: uint32(len(b)), LKey: lkey}
}

func postErr(err error) error {
	if errors.Is(err, syscall.ENOMEM) {
		return fmt.Errorf("%w: %w", fabric.ErrQueueFull, err)
	}
	if errors.Is(err, ibverbs.ErrClosed) {
		return fabric.ErrClosed
	}
	return err
}

// PostSend posts the chain, held until the end of the batch of
// completions being delivered or, with More, until Flush; held or not,
// at most ibverbs.MaxChain work requests go to the QP in one call.
// Windows' binds and unbinds are posted at once, ahead of what is held:
// a bind need only precede the answer that publishes its key, which is
// posted after it.
func (c *conn) PostSend(wr *fabric.SendWR) error {
	more := true
	for w := wr; w != nil; w = w.Next {
		if _, err := sendOpcode(w.Op); err != nil {
			return err
		}
		more = more && w.More
	}
	c.heldMu.Lock()
	defer c.heldMu.Unlock()
	for ; wr != nil; wr = wr.Next {
		if c.nHeld == len(c.held) {
			if err := c.postHeld(); err != nil {
				return err
			}
		}
		op, _ := sendOpcode(wr.Op)
		b := &c.held[c.nHeld]
		*b = ibverbs.SendWR{ID: wr.ID, Opcode: op, RemoteAddr: wr.RemoteAddr, RKey: wr.RKey,
			Imm: wr.Imm, InvRKey: wr.InvRKey}
		if wr.Signaled {
			b.Flags = ibverbs.SendSignaled
		}
		for i := 0; i < wr.NumSGE && i < fabric.MaxSGE; i++ {
			if len(wr.SG[i].Buf) == 0 {
				continue
			}
			b.SG[b.NumSGE] = sge(wr.SG[i].Buf, wr.SG[i].LKey)
			b.NumSGE++
		}
		c.nHeld++
	}
	if c.inBurst || more {
		return nil
	}
	return c.postHeld()
}

// postHeld posts what is held; c.heldMu is held. On an error nothing
// stays held: the connection has failed or is failing.
// +checklocks:c.heldMu
func (c *conn) postHeld() error {
	n := c.nHeld
	if n == 0 {
		return nil
	}
	c.nHeld = 0
	return postErr(c.qp.PostSend(c.held[:n]))
}

// Flush posts what was posted with More (fabric.Flusher).
func (c *conn) Flush() {
	c.heldMu.Lock()
	err := c.postHeld()
	c.heldMu.Unlock()
	if err != nil {
		c.fail(err)
	}
}

// burst marks the start (true) or the end of a batch of completions. At
// the end the handler is told (fabric.BurstHandler) and what the batch
// posted goes to the QP in one call.
func (c *conn) burst(start bool) {
	if !start && c.bh != nil {
		c.bh.BurstEnd()
	}
	c.heldMu.Lock()
	c.inBurst = start
	var err error
	if !start {
		err = c.postHeld()
	}
	c.heldMu.Unlock()
	if err != nil {
		c.fail(err)
	}
}

// PostRecv posts the chain in batches of up to ibverbs.MaxChain.
func (c *conn) PostRecv(wr *fabric.RecvWR) error {
	var batch [ibverbs.MaxChain]ibverbs.RecvWR
	for wr != nil {
		n := 0
		for ; wr != nil && n < len(batch); wr = wr.Next {
			batch[n] = ibverbs.RecvWR{ID: wr.ID}
			if len(wr.Buf) > 0 {
				batch[n].SG, batch[n].NumSGE = sge(wr.Buf, wr.LKey), 1
			}
			n++
		}
		if err := c.qp.PostRecv(batch[:n]); err != nil {
			return postErr(err)
		}
	}
	return nil
}

func (c *conn) LocalAddr() netip.AddrPort  { return c.local }
func (c *conn) RemoteAddr() netip.AddrPort { return c.remote }

// Close disconnects, stops both goroutines and destroys the QP, the ID,
// the CQ and the channels. No handler call follows it.
func (c *conn) Close() error {
	c.closeOnce.Do(func() {
		c.closing.Store(true)
		c.id.Disconnect()
		c.destroy()
	})
	return nil
}

// destroy interrupts and waits for the goroutines (if started), then
// frees everything in reverse order of construction.
func (c *conn) destroy() {
	if c.cc != nil {
		c.cc.Interrupt()
	}
	c.ch.Interrupt()
	c.wg.Wait()
	c.ch.Close() // the ID and its QP
	if c.cc != nil {
		c.cc.Close() // the CQ
	}
}
