// The send side of a connection: the send queue taken in batches, laid
// out as frames and written in one writev, by the reader ending its burst
// or by the writer goroutine, and the send completions.

package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/rnbd/rnbd/pkg/internal/rawio"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

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
// +checklocks:c.sqMu
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
	var b *sendBatch // made at the first wake: a connection that never writes (a churned path's) costs none
	for {
		select {
		case <-c.wake:
		case <-c.closeCh:
			return
		}
		if b == nil {
			b = newSendBatch(len(c.sq)) // +checklocksignore: the ring's length is fixed
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
	if b == nil {
		b = newSendBatch(len(c.sq)) // at the first: a connection that never writes costs none
		c.rbatch = b
	}
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
