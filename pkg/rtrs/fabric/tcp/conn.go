package tcp

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/rnbd/rnbd/pkg/internal/rawio"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Frame header of one work request on the wire, little-endian, 24 bytes:
//
//	off 0  u8   opcode (fabric.Opcode)
//	off 1  u8   flags (0)
//	off 2  u16  reserved (0)
//	off 4  u32  payload length
//	off 8  u32  immediate data
//	off 12 u32  rkey (writes) or the rkey to invalidate (SEND_WITH_INV)
//	off 16 u64  remote address (writes)
//
// The payload follows. A write lands in the registered region named by
// (rkey, remote address) after the receiver checked key and bounds.
const frameHdrSize = 24

// maxFrameLen bounds one frame's payload; the largest legitimate one is a
// chunk (at most 2^28 bytes can be addressed by an immediate).
const maxFrameLen = 1 << 28

var errProtocol = errors.New("tcp fabric: protocol violation")

// conn emulates an RC queue pair over a byte stream. One goroutine reads
// frames and turns them into remote writes and receive completions; what
// the handlers post meanwhile it writes itself, in one writev per burst
// of frames (run to completion, corked as the block layer's plug). A
// writer goroutine writes the send queue in batches when the reader is
// not in a burst (requests posted from other goroutines) and when the
// socket has no room for the reader's write.
type conn struct {
	nc     net.Conn    // in TLS if the fabric has it
	raw    net.Conn    // the TCP connection under nc: closed without a TLS goodbye
	sio    *rawio.Conn // nc's reads and writes, if it has a descriptor
	dev    *device
	pd     *pd
	h      fabric.Handler
	local  netip.AddrPort
	remote netip.AddrPort

	// sqMu guards the send queue ring.
	sqMu sync.Mutex
	// +checklocks:sqMu
	sq []fabric.SendWR
	// +checklocks:sqMu
	sqHead int
	// +checklocks:sqMu
	sqLen int
	wake  chan struct{} // cap 1: send queue has work
	// writing: a goroutine (the writer, or the reader ending its burst)
	// is writing the socket; handoff: what the reader's write left.
	// +checklocks:sqMu
	writing bool
	// +checklocks:sqMu
	handoff *sendBatch
	// +checklocks:sqMu
	rbatch *sendBatch // the reader's, made at its first flush
	// burst: the reader is processing what it read; what is posted
	// meanwhile goes out when it next reads (flushBurst).
	burst atomic.Bool

	// rqMu guards the receive queue ring; rqCond waits for a posted
	// receive (RNR wait) or close.
	rqMu sync.Mutex
	// +checklocks:rqMu
	rqCond sync.Cond
	// +checklocks:rqMu
	rq []fabric.RecvWR
	// +checklocks:rqMu
	rqHead int
	// +checklocks:rqMu
	rqLen int

	// watchIdx and watchName are the interface the fabric's linkWatch
	// watches for the connection (0: none); set under its mu.
	watchIdx  int
	watchName string

	closed     atomic.Bool   // no more posts; goroutines stopping
	userClosed atomic.Bool   // Close was called: do not report Disconnected
	closeCh    chan struct{} // closed by fail
	failOnce   sync.Once
	wg         sync.WaitGroup
}

func newConn(nc, raw net.Conn, dev *device, p *pd, attr fabric.ConnAttr) (*conn, error) {
	if attr.Handler == nil {
		return nil, errors.New("tcp fabric: connection needs a handler")
	}
	if p == nil || p.dev != dev {
		return nil, errors.New("tcp fabric: protection domain of another device")
	}
	sqCap, rqCap := queueCaps(attr.MaxSendWR, attr.MaxRecvWR)
	c := &conn{
		nc:      nc,
		raw:     raw,
		sio:     rawio.New(nc),
		dev:     dev,
		pd:      p,
		h:       attr.Handler,
		local:   addrPortOf(nc.LocalAddr()),
		remote:  addrPortOf(nc.RemoteAddr()),
		sq:      make([]fabric.SendWR, sqCap),
		rq:      make([]fabric.RecvWR, rqCap),
		wake:    make(chan struct{}, 1),
		closeCh: make(chan struct{}),
	}
	c.rqCond.L = &c.rqMu
	c.h.Attached(c)
	for i := range attr.Recvs {
		r := attr.Recvs[i]
		r.Next = nil
		if err := c.PostRecv(&r); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// queueCaps are the sizes of a connection's send and receive queues for
// the sizes asked: 64 each unless set.
func queueCaps(maxSendWR, maxRecvWR int) (sqCap, rqCap int) {
	sqCap, rqCap = maxSendWR, maxRecvWR
	if sqCap <= 0 {
		sqCap = 64
	}
	if rqCap <= 0 {
		rqCap = 64
	}
	return sqCap, rqCap
}

func (c *conn) start() {
	c.wg.Add(2)
	go c.writer()
	go c.reader()
}

func (c *conn) LocalAddr() netip.AddrPort  { return c.local }
func (c *conn) RemoteAddr() netip.AddrPort { return c.remote }

// opUnbind is a window's unbind in the send queue (windowMR): no frame,
// only its completion, in order.
const opUnbind fabric.Opcode = 0xff

// PostSend queues a chain of work requests. It never blocks on the network.
func (c *conn) PostSend(wr *fabric.SendWR) error {
	n := 0
	for w := wr; w != nil; w = w.Next {
		if err := checkSendWR(w); err != nil {
			return err
		}
		n++
	}
	return c.post(wr, n)
}

// post queues the n work requests of a checked chain.
func (c *conn) post(wr *fabric.SendWR, n int) error {
	c.sqMu.Lock()
	if c.closed.Load() {
		c.sqMu.Unlock()
		return fabric.ErrClosed
	}
	if c.sqLen+n > len(c.sq) {
		c.sqMu.Unlock()
		return fabric.ErrQueueFull
	}
	more := true
	for w := wr; w != nil; w = w.Next {
		i := (c.sqHead + c.sqLen) % len(c.sq)
		c.sq[i] = *w
		c.sq[i].Next = nil
		c.sqLen++
		more = more && w.More
	}
	// In the reader's burst, the reader writes it when the burst ends;
	// posted with More, the poster's Flush does.
	wake := !c.burst.Load() && !more
	c.sqMu.Unlock()
	if wake {
		c.kick()
	}
	return nil
}

func checkSendWR(w *fabric.SendWR) error {
	if w.NumSGE < 0 || w.NumSGE > fabric.MaxSGE {
		return fmt.Errorf("tcp fabric: %d SGEs: %w", w.NumSGE, errProtocol)
	}
	switch w.Op {
	case fabric.OpWrite, fabric.OpWriteImm, fabric.OpSend, fabric.OpSendImm, fabric.OpSendInv:
	default:
		return fmt.Errorf("tcp fabric: unknown opcode %v", w.Op)
	}
	return nil
}

// AnySource says whether the connection's sends may name any memory
// (fabric.AnySource): without TLS, where a send is a writev of its
// buffers, read when the frame is written (by the reader or the writer
// goroutine, which Close waits for, or by a Flush of the user's). Not
// with TLS: its records are gathered and sealed by Go code, where a
// fault of a file mapping would take the process down. (Over a stream
// without a descriptor — fabrictest's pipes — the copy is Go's too:
// tests lend them heap memory only.)
func (c *conn) AnySource() bool { return c.nc == c.raw }

// PostRecv queues a chain of receive work requests.
func (c *conn) PostRecv(wr *fabric.RecvWR) error {
	c.rqMu.Lock()
	defer c.rqMu.Unlock()
	if c.closed.Load() {
		return fabric.ErrClosed
	}
	for w := wr; w != nil; w = w.Next {
		if c.rqLen == len(c.rq) {
			return fabric.ErrQueueFull
		}
		i := (c.rqHead + c.rqLen) % len(c.rq)
		c.rq[i] = *w
		c.rq[i].Next = nil
		c.rqLen++
	}
	c.rqCond.Signal()
	return nil
}

// popRecv takes the oldest posted receive, waiting for one if none is
// posted (RNR with infinite retry). It fails once the connection closes.
func (c *conn) popRecv() (fabric.RecvWR, bool) {
	c.rqMu.Lock()
	defer c.rqMu.Unlock()
	if c.rqLen == 0 {
		// Waiting (RNR): send what was posted before, first.
		c.rqMu.Unlock()
		c.flushBurst()
		c.rqMu.Lock()
	}
	for c.rqLen == 0 {
		if c.closed.Load() {
			return fabric.RecvWR{}, false
		}
		c.rqCond.Wait()
	}
	r := c.rq[c.rqHead]
	c.rq[c.rqHead] = fabric.RecvWR{}
	c.rqHead = (c.rqHead + 1) % len(c.rq)
	c.rqLen--
	return r, true
}

// fail kills the connection once: close the stream, wake the goroutines,
// and report to the handler unless the user closed it.
func (c *conn) fail(err error) {
	c.failOnce.Do(func() {
		c.sqMu.Lock()
		c.closed.Store(true)
		c.sqMu.Unlock()
		// The TCP connection, not TLS's: its close_notify would wait
		// for a peer that may have stopped reading.
		c.raw.Close()
		close(c.closeCh)
		c.rqMu.Lock()
		c.rqCond.Broadcast()
		c.rqMu.Unlock()
		c.dev.fab.links.remove(c)
		if !c.userClosed.Load() {
			c.h.Disconnected(err)
		}
	})
}

// Close disconnects and waits until no more completions can be delivered.
func (c *conn) Close() error {
	c.userClosed.Store(true)
	c.fail(fabric.ErrClosed)
	c.wg.Wait()
	return nil
}

func addrPortOf(a net.Addr) netip.AddrPort {
	switch a := a.(type) {
	case *net.TCPAddr:
		return a.AddrPort()
	case interface{ AddrPort() netip.AddrPort }:
		return a.AddrPort()
	}
	if a == nil {
		return netip.AddrPort{}
	}
	ap, _ := netip.ParseAddrPort(a.String())
	return ap
}
