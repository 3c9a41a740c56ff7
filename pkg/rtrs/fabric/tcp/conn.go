package tcp

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rnbd/rnbd/internal/rawio"
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
	sqMu   sync.Mutex
	sq     []fabric.SendWR
	sqHead int
	sqLen  int
	wake   chan struct{} // cap 1: send queue has work
	// writing: a goroutine (the writer, or the reader ending its burst)
	// is writing the socket; handoff: what the reader's write left.
	writing bool
	handoff *sendBatch
	rbatch  *sendBatch // the reader's
	// burst: the reader is processing what it read; what is posted
	// meanwhile goes out when it next reads (flushBurst).
	burst atomic.Bool

	// rqMu guards the receive queue ring; rqCond waits for a posted
	// receive (RNR wait) or close.
	rqMu   sync.Mutex
	rqCond sync.Cond
	rq     []fabric.RecvWR
	rqHead int
	rqLen  int

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
		rbatch:  newSendBatch(sqCap),
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

// sendBatch is what one write of the send queue uses: the work requests
// taken from the queue, their frame headers and the iovec.
type sendBatch struct {
	wrs   []fabric.SendWR
	n     int
	hdrs  []byte
	iov   [][]byte
	rest  [][]byte    // a hand-off: what the socket had no room for
	bufs  net.Buffers // for WriteTo: escapes, so it lives here
	wc    fabric.WC   // a send completion: handed to the handler, so it escapes too
	stage []byte      // TLS: the frames gathered into records of up to its size
}

func newSendBatch(n int) *sendBatch {
	return &sendBatch{wrs: make([]fabric.SendWR, n), hdrs: make([]byte, n*frameHdrSize),
		iov: make([][]byte, 0, n*(1+fabric.MaxSGE))}
}

// take moves the send queue into b and, if it held anything, makes the
// caller the socket's writer. sqMu is held.
func (c *conn) take(b *sendBatch) int {
	n := c.sqLen
	for i := 0; i < n; i++ {
		j := (c.sqHead + i) % len(c.sq)
		b.wrs[i] = c.sq[j]
		c.sq[j] = fabric.SendWR{}
	}
	c.sqHead = (c.sqHead + n) % len(c.sq)
	c.sqLen = 0
	b.n = n
	if n > 0 {
		c.writing = true
	}
	return n
}

// frames lays out b's work requests as frames in b.iov.
func (b *sendBatch) frames() {
	b.iov = b.iov[:0]
	for i := 0; i < b.n; i++ {
		w := &b.wrs[i]
		if w.Op == opUnbind {
			continue
		}
		h := b.hdrs[i*frameHdrSize : (i+1)*frameHdrSize]
		putFrameHdr(h, w)
		b.iov = append(b.iov, h)
		for s := 0; s < w.NumSGE; s++ {
			if len(w.SG[s].Buf) > 0 {
				b.iov = append(b.iov, w.SG[s].Buf)
			}
		}
	}
}

// sent delivers the send completions of b's work requests, in order, and
// forgets them and the buffers written.
func (c *conn) sent(b *sendBatch) {
	wc := &b.wc
	for i := 0; i < b.n; i++ {
		w := &b.wrs[i]
		if w.Signaled {
			op := fabric.WCSend
			switch w.Op {
			case fabric.OpWrite, fabric.OpWriteImm:
				op = fabric.WCWrite
			case opUnbind:
				op = fabric.WCBind
			}
			*wc = fabric.WC{ID: w.ID, Opcode: op, ByteLen: uint32(w.Len())}
			c.h.Completion(wc)
		}
		*w = fabric.SendWR{}
	}
	b.n = 0
	clear(b.iov) // drop the references to the buffers written (frames fills from 0)
	b.iov, b.rest = b.iov[:0], nil
}

// stallStep is how much of a write must go out within the stall timeout:
// a peer that takes less than that in StallTimeout is taken for stalled.
const stallStep = 4 << 20

// writeAll writes iov, waiting for room as long as the peer takes
// stallStep bytes per stall timeout: each step of the iovec gets a
// deadline of its own.
func (c *conn) writeAll(iov [][]byte, b *sendBatch) error {
	var err error
	for len(iov) > 0 && err == nil {
		n := rawio.Step(iov, stallStep)
		c.nc.SetWriteDeadline(time.Now().Add(c.dev.fab.opts.StallTimeout))
		err = c.writeVec(iov[:n], b)
		iov = iov[n:]
	}
	// Cleared: an expired deadline would fail the reader's flushes,
	// which never wait, as well.
	c.nc.SetWriteDeadline(time.Time{})
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("tcp fabric: the peer took less than %d bytes in %v: %w", stallStep, c.dev.fab.opts.StallTimeout, err)
	}
	return err
}

func (c *conn) writeVec(iov [][]byte, b *sendBatch) error {
	if c.sio != nil {
		return c.sio.Writev(iov)
	}
	if c.nc != c.raw {
		return c.writeStaged(iov, b)
	}
	b.bufs = iov
	_, err := b.bufs.WriteTo(c.nc)
	b.bufs = nil
	return err
}

// stageSize bounds the bytes gathered for one TLS write: a few records
// (16 KiB each) per system call instead of one per buffer of the iovec.
const stageSize = 256 << 10

// writeStaged writes iov to the TLS connection gathered into b.stage:
// tls.Conn makes at least one record, and one write, per Write.
func (c *conn) writeStaged(iov [][]byte, b *sendBatch) error {
	if b.stage == nil {
		b.stage = make([]byte, 0, stageSize)
	}
	st := b.stage[:0]
	for _, v := range iov {
		for len(v) > 0 {
			n := min(len(v), cap(st)-len(st))
			st = append(st, v[:n]...)
			v = v[n:]
			if len(st) == cap(st) {
				if _, err := c.nc.Write(st); err != nil {
					return err
				}
				st = st[:0]
			}
		}
	}
	if len(st) > 0 {
		if _, err := c.nc.Write(st); err != nil {
			return err
		}
	}
	return nil
}

func (c *conn) kick() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// writeOn writes b and then whatever was posted meanwhile, until the
// queue is empty; then it gives up the socket.
func (c *conn) writeOn(b *sendBatch) error {
	for {
		b.frames()
		if err := c.writeAll(b.iov, b); err != nil {
			return err
		}
		c.sent(b)
		if c.next(b) == 0 {
			return nil
		}
	}
}

// next takes what was posted during a write into b, or, if nothing was,
// gives up the socket.
func (c *conn) next(b *sendBatch) int {
	c.sqMu.Lock()
	defer c.sqMu.Unlock()
	n := c.take(b)
	if n == 0 {
		c.writing = false
	}
	return n
}

// writer writes the send queue when the reader does not: work requests
// posted while the reader is not in a burst (from other goroutines), and
// what the reader's write left because the socket was full.
func (c *conn) writer() {
	defer c.wg.Done()
	b := newSendBatch(len(c.sq))
	for {
		select {
		case <-c.wake:
		case <-c.closeCh:
			return
		}
		c.sqMu.Lock()
		h := c.handoff
		c.handoff = nil
		if h == nil && (c.writing || c.take(b) == 0) {
			// The reader is writing (it wakes us if it leaves
			// anything), or there is nothing to write.
			c.sqMu.Unlock()
			continue
		}
		c.sqMu.Unlock()
		if h != nil {
			if err := c.writeAll(h.rest, h); err != nil {
				c.fail(err)
				return
			}
			c.sent(h)
			if c.next(b) == 0 {
				continue
			}
		}
		if err := c.writeOn(b); err != nil {
			c.fail(err)
			return
		}
	}
}

// Flush writes what was posted with More (fabric.Flusher).
func (c *conn) Flush() { c.flush(false) }

// flushBurst ends the reader's burst: the handler is told (BurstEnd), and
// what the handlers posted while it processed the frames it had read goes
// out in one writev from the reader itself. It runs before every read of the socket and before the
// reader waits for a posted receive, so nothing posted is held while the
// reader sleeps.
func (c *conn) flushBurst() {
	c.burstEnd()
	c.flush(true)
}

// burstEnd tells the handler that a burst of completions ended; the
// reader also calls it when it stops, so nothing deferred is left.
func (c *conn) burstEnd() {
	if bh, ok := c.h.(fabric.BurstHandler); ok {
		bh.BurstEnd()
	}
}

// flush writes the send queue from the calling goroutine, as far as the
// socket takes it without waiting; the rest goes to the writer goroutine.
// Whoever holds c.writing owns c.rbatch, so any goroutine may flush.
func (c *conn) flush(endBurst bool) {
	c.sqMu.Lock()
	if endBurst {
		c.burst.Store(false)
	}
	if c.writing || c.sqLen == 0 || c.closed.Load() {
		// Empty, or another goroutine has the socket and takes the
		// queue when its write is done.
		c.sqMu.Unlock()
		return
	}
	if c.sio == nil {
		c.sqMu.Unlock()
		c.kick()
		return
	}
	b := c.rbatch
	c.take(b)
	c.sqMu.Unlock()
	b.frames()
	rest, err := c.sio.TryWritev(b.iov)
	if err != nil {
		c.fail(err)
		return
	}
	if len(rest) > 0 {
		// The socket is full: the writer goroutine waits for room.
		c.sqMu.Lock()
		b.rest = rest
		c.handoff = b
		c.sqMu.Unlock()
		c.kick()
		return
	}
	c.sent(b)
	c.sqMu.Lock()
	c.writing = false
	more := c.sqLen > 0 // posted by others meanwhile: they woke the writer in vain
	c.sqMu.Unlock()
	if more {
		c.kick()
	}
}

// burstReader is the reader's source: every read of the socket (when the
// reader's buffer has run dry) first ends the burst, and the data read
// starts the next one.
type burstReader struct {
	c   *conn
	src io.Reader
}

func (r *burstReader) Read(p []byte) (int, error) {
	r.c.flushBurst()
	n, err := r.src.Read(p)
	if n > 0 {
		r.c.burst.Store(true)
	}
	return n, err
}

func putFrameHdr(h []byte, w *fabric.SendWR) {
	h[0] = byte(w.Op)
	h[1] = 0
	binary.LittleEndian.PutUint16(h[2:], 0)
	binary.LittleEndian.PutUint32(h[4:], uint32(w.Len()))
	binary.LittleEndian.PutUint32(h[8:], w.Imm)
	rkey := w.RKey
	if w.Op == fabric.OpSendInv {
		rkey = w.InvRKey
	}
	binary.LittleEndian.PutUint32(h[12:], rkey)
	binary.LittleEndian.PutUint64(h[16:], w.RemoteAddr)
}

func (c *conn) reader() {
	defer c.wg.Done()
	defer c.burstEnd()
	var src io.Reader = c.nc
	if c.sio != nil {
		src = c.sio
	}
	br := bufio.NewReaderSize(&burstReader{c: c, src: src}, readBufSize)
	var hdr [frameHdrSize]byte
	var wc fabric.WC
	for {
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			c.fail(err)
			return
		}
		op := fabric.Opcode(hdr[0])
		n := binary.LittleEndian.Uint32(hdr[4:])
		imm := binary.LittleEndian.Uint32(hdr[8:])
		rkey := binary.LittleEndian.Uint32(hdr[12:])
		raddr := binary.LittleEndian.Uint64(hdr[16:])
		if hdr[1] != 0 || hdr[2] != 0 || hdr[3] != 0 || n > maxFrameLen {
			c.fail(fmt.Errorf("bad frame header: %w", errProtocol))
			return
		}
		switch op {
		case fabric.OpWrite, fabric.OpWriteImm:
			if n > 0 {
				dst, e, st, err := c.dev.mrs.lookup(rkey, c.pd, raddr, int(n))
				if err != nil {
					c.fail(fmt.Errorf("%v of %d bytes at %#x rkey %#x: %w", op, n, raddr, rkey, err))
					return
				}
				if _, err := io.ReadFull(br, dst); err != nil {
					c.fail(err)
					return
				}
				if e.state.Load() != st {
					c.fail(errChangedMR)
					return
				}
			}
			if op == fabric.OpWrite {
				continue
			}
			r, ok := c.popRecv()
			if !ok {
				return
			}
			wc = fabric.WC{ID: r.ID, Opcode: fabric.WCRecvRDMAWithImm, Flags: fabric.WCWithImm, ByteLen: n, Imm: imm}
			c.h.Completion(&wc)
		case fabric.OpSend, fabric.OpSendImm, fabric.OpSendInv:
			r, ok := c.popRecv()
			if !ok {
				return
			}
			if int(n) > len(r.Buf) {
				c.fail(fmt.Errorf("%v of %d bytes into a %d-byte receive: local length error", op, n, len(r.Buf)))
				return
			}
			if _, err := io.ReadFull(br, r.Buf[:n]); err != nil {
				c.fail(err)
				return
			}
			wc = fabric.WC{ID: r.ID, Opcode: fabric.WCRecv, ByteLen: n}
			switch op {
			case fabric.OpSendImm:
				wc.Flags, wc.Imm = fabric.WCWithImm, imm
			case fabric.OpSendInv:
				if err := c.dev.mrs.invalidate(rkey, c.pd); err != nil {
					c.fail(fmt.Errorf("send with invalidate of rkey %#x: %w", rkey, err))
					return
				}
				wc.Flags, wc.InvRKey = fabric.WCWithInv, rkey
			}
			c.h.Completion(&wc)
		default:
			c.fail(fmt.Errorf("unknown opcode %d: %w", op, errProtocol))
			return
		}
	}
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
