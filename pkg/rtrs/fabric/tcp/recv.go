// The receive side of a connection: the reader goroutine, which reads
// frames, lands remote writes in their regions and delivers receive
// completions.

package tcp

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

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

func (c *conn) reader() {
	defer c.wg.Done()
	defer c.burstEnd()
	var src io.Reader = c.nc
	if c.sio != nil {
		src = c.sio
	}
	bsrc := &burstReader{c: c, src: src}
	var hdr [frameHdrSize]byte
	// The first frame's header is read on its own, and the read buffer
	// made only then: a connection that goes before it sends a frame
	// (what a peer churning paths leaves) costs none.
	if _, err := io.ReadFull(bsrc, hdr[:]); err != nil {
		c.fail(err)
		return
	}
	br := bufio.NewReaderSize(bsrc, readBufSize)
	var wc fabric.WC
	for first := true; ; first = false {
		if !first {
			if _, err := io.ReadFull(br, hdr[:]); err != nil {
				c.fail(err)
				return
			}
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
