package nbd

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/internal/rawio"
)

// conn is one connection in transmission.
type conn struct {
	s      *Server
	exp    *Export
	nc     net.Conn
	sio    *rawio.Conn // nc's reads and writes, if it has a descriptor
	ctx    context.Context
	cancel context.CancelFunc
	plug   Plug          // the backend's, or nil
	free   chan *Request // the in-flight limit: a request is taken per command
	done   chan struct{}

	mu sync.Mutex
	// +checklocks:mu
	ready []*Request // completed, waiting for their reply's write
	// +checklocks:mu
	inflight int // taken from free and not yet retired
	// +checklocks:mu
	readerDone bool
	// writing: a goroutine (the writer, or a completer flushing at the
	// end of its burst) writes replies; it owns fbatch. handoff: what a
	// completer's write left because the socket was full. broken: a
	// write failed, replies are dropped.
	// +checklocks:mu
	writing bool
	// +checklocks:mu
	handoff *replyBatch
	// +checklocks:mu
	broken    bool
	fbatch    *replyBatch
	wake      chan struct{} // cap 1: the writer has work
	closeOnce sync.Once
}

// replyBatch is replies being written, and their iovec.
type replyBatch struct {
	reqs []*Request
	hdrs []byte
	bufs net.Buffers
	rest [][]byte // what a non-blocking write left
}

func newReplyBatch(n int) *replyBatch {
	return &replyBatch{hdrs: make([]byte, replySize*n), bufs: make(net.Buffers, 0, 2*n)}
}

// build lays out the replies of b.reqs in b.bufs.
func (b *replyBatch) build() {
	b.bufs = b.bufs[:0]
	for i, r := range b.reqs {
		h := b.hdrs[i*replySize : (i+1)*replySize]
		binary.BigEndian.PutUint32(h[0:], magicReply)
		binary.BigEndian.PutUint32(h[4:], r.errno)
		binary.BigEndian.PutUint64(h[8:], r.cookie)
		b.bufs = append(b.bufs, h)
		if r.Cmd == CmdRead && r.errno == 0 && r.Length > 0 {
			b.bufs = append(b.bufs, r.Data)
		}
	}
}

func (s *Server) transmit(nc net.Conn, e *Export) {
	c := &conn{s: s, exp: e, nc: nc, sio: rawio.New(nc), done: make(chan struct{}), wake: make(chan struct{}, 1),
		free: make(chan *Request, s.opts.MaxInflight), fbatch: newReplyBatch(s.opts.MaxInflight)}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	if p, ok := e.Backend.(Plugger); ok {
		c.plug = p.NewPlug()
		c.ctx = context.WithValue(c.ctx, plugKey{}, c.plug)
	}
	for i := 0; i < s.opts.MaxInflight; i++ {
		c.free <- &Request{c: c}
	}
	s.mu.Lock()
	if s.closed || s.exports[e.key()] != e {
		s.mu.Unlock()
		return
	}
	s.conns[c] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		c.cancel()
		close(c.done)
	}()
	wdone := make(chan struct{})
	go func() {
		defer close(wdone)
		c.writer()
	}()
	if err := c.reader(); err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
		s.log.WithError(err).WithField("export", e.Name).Warn("nbd: closing the connection")
		c.close()
	}
	c.mu.Lock()
	c.readerDone = true
	c.mu.Unlock()
	c.signal()
	<-wdone
}

func (c *conn) close() {
	c.closeOnce.Do(func() {
		c.cancel()
		c.nc.Close()
	})
}

func (c *conn) signal() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

var errProtocol = errors.New("nbd: protocol violation")

// reader parses requests and hands them on; it returns at DISC, at the
// end of the stream, or at a violation that leaves the stream unusable.
func (c *conn) reader() error {
	var src io.Reader = c.nc
	if c.sio != nil {
		src = c.sio
	}
	if c.plug != nil {
		// The burst ends where the buffer runs dry: what it carried
		// goes out before the reader waits for more, or stops.
		src = &unplugReader{pl: c.plug, src: src}
		defer c.plug.Unplug()
	}
	br := bufio.NewReaderSize(src, 128<<10)
	e := c.exp
	var h [requestSize]byte
	for {
		if _, err := io.ReadFull(br, h[:]); err != nil {
			return err
		}
		if binary.BigEndian.Uint32(h[0:]) != magicRequest {
			return errProtocol
		}
		flags := binary.BigEndian.Uint16(h[4:])
		typ := binary.BigEndian.Uint16(h[6:])
		cookie := binary.BigEndian.Uint64(h[8:])
		off := binary.BigEndian.Uint64(h[16:])
		n := binary.BigEndian.Uint32(h[24:])
		if typ == cmdDisc {
			return nil
		}
		var r *Request
		select {
		case r = <-c.free:
		default:
			if c.plug != nil {
				// The plug may hold what frees a request.
				c.plug.Unplug()
			}
			select {
			case r = <-c.free:
			case <-c.ctx.Done():
				return net.ErrClosed
			}
		}
		c.mu.Lock()
		c.inflight++
		c.mu.Unlock()
		*r = Request{Cmd: Cmd(typ), FUA: flags&cmdFlagFUA != 0, NoHole: flags&cmdFlagNoHole != 0,
			Offset: int64(off), Length: n, Plug: c.plug, cookie: cookie, c: c}
		errno := c.check(r, flags)
		if r.Cmd == CmdWrite && n > e.MaxPayload {
			// The payload cannot be skipped safely at any size.
			c.retire(r)
			return errProtocol
		}
		if errno != 0 {
			if r.Cmd == CmdWrite {
				if _, err := io.CopyN(io.Discard, br, int64(n)); err != nil {
					c.retire(r)
					return err
				}
			}
			c.complete(r, errno)
			continue
		}
		if (r.Cmd == CmdRead || r.Cmd == CmdWrite) && n == 0 {
			c.complete(r, 0)
			continue
		}
		if r.Cmd == CmdRead || r.Cmd == CmdWrite {
			buf, err := e.Backend.Buffer(c.ctx, int(n))
			if err != nil {
				if r.Cmd == CmdWrite {
					io.CopyN(io.Discard, br, int64(n))
				}
				c.complete(r, syscall.ENOMEM)
				continue
			}
			r.buf, r.Data = buf, buf.Bytes()
			if r.Cmd == CmdWrite {
				if _, err := io.ReadFull(br, r.Data); err != nil {
					c.retire(r)
					return err
				}
			}
		}
		e.Backend.Submit(r, doneFunc)
	}
}

// unplugReader unplugs before every read of the connection.
type unplugReader struct {
	pl  Plug
	src io.Reader
}

func (r *unplugReader) Read(p []byte) (int, error) {
	r.pl.Unplug()
	return r.src.Read(p)
}

// check validates a request against the export; 0 means go ahead.
func (c *conn) check(r *Request, flags uint16) syscall.Errno {
	e := c.exp
	if flags&^(cmdFlagFUA|cmdFlagNoHole) != 0 {
		return syscall.EINVAL
	}
	write := false
	switch r.Cmd {
	case CmdRead:
		if r.Length > e.MaxPayload {
			return syscall.EINVAL
		}
	case CmdWrite:
		write = true
	case CmdFlush:
		if !e.Flush {
			return syscall.EINVAL
		}
		return 0
	case CmdTrim:
		if !e.Trim {
			return syscall.EINVAL
		}
		write = true
	case CmdWriteZeroes:
		if !e.WriteZeroes {
			return syscall.EINVAL
		}
		write = true
	default:
		return syscall.EINVAL
	}
	if r.NoHole && r.Cmd != CmdWriteZeroes {
		return syscall.EINVAL
	}
	if r.FUA && !(r.Cmd == CmdWrite || r.Cmd == CmdWriteZeroes || r.Cmd == CmdTrim) {
		return syscall.EINVAL
	}
	if write && e.ReadOnly {
		return syscall.EPERM
	}
	if size := uint64(e.size()); uint64(r.Offset) > size || uint64(r.Length) > size-uint64(r.Offset) {
		if write {
			return syscall.ENOSPC
		}
		return syscall.EINVAL
	}
	if e.MinBlock > 1 && (uint64(r.Offset)%uint64(e.MinBlock) != 0 || r.Length%e.MinBlock != 0) {
		return syscall.EINVAL
	}
	return 0
}

// doneFunc is the completion every request is submitted with: one
// function value, so submitting allocates nothing.
var doneFunc = func(r *Request, err error) { r.c.complete(r, toErrno(err)) }

// toErrno maps an error to the NBD error values.
func toErrno(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		switch e {
		case syscall.EPERM, syscall.EROFS, syscall.EACCES:
			return syscall.EPERM
		case syscall.EIO, syscall.ENOMEM, syscall.EINVAL, syscall.ENOSPC, syscall.EOVERFLOW, syscall.ESHUTDOWN:
			return e
		case syscall.EOPNOTSUPP:
			return syscall.EOPNOTSUPP
		case syscall.EFBIG:
			return syscall.ENOSPC
		}
	}
	return syscall.EIO
}

// nbdErrno is the protocol's value of an errno (the NBD values are the
// Linux ones except ENOTSUP).
func nbdErrno(e syscall.Errno) uint32 {
	if e == syscall.EOPNOTSUPP {
		return 95
	}
	return uint32(e)
}

// complete queues r's reply: written at the end of the completer's burst
// if r came with a Batch, else by the writer goroutine.
func (c *conn) complete(r *Request, errno syscall.Errno) {
	r.errno = nbdErrno(errno)
	batch := r.Batch
	r.Batch = nil
	c.mu.Lock()
	c.ready = append(c.ready, r)
	c.mu.Unlock()
	if batch != nil && c.sio != nil {
		batch.Defer(c)
		return
	}
	c.signal()
}

// retire ends a request that gets no reply, or whose reply was written.
func (c *conn) retire(r *Request) {
	if r.buf != nil {
		r.buf.Release()
		r.buf, r.Data = nil, nil
	}
	c.mu.Lock()
	c.inflight--
	last := c.readerDone && c.inflight == 0
	c.mu.Unlock()
	c.free <- r
	if last {
		c.signal() // the writer may exit
	}
}

// retireAll retires the requests of b.
func (c *conn) retireAll(b *replyBatch) {
	for i, r := range b.reqs {
		c.retire(r)
		b.reqs[i] = nil
	}
	b.reqs = b.reqs[:0]
	clear(b.bufs) // drop the references to the data written (build fills from 0)
	b.bufs, b.rest = b.bufs[:0], nil
}

// takeReady moves the ready replies into b and makes the caller the
// writer, if there are any and no one else writes. c.mu is held.
// +checklocks:c.mu
func (c *conn) takeReady(b *replyBatch) bool {
	if c.writing || len(c.ready) == 0 {
		return false
	}
	b.reqs, c.ready = c.ready, b.reqs[:0]
	c.writing = true
	return true
}

// doneWriting gives up writing; the writer goroutine is woken if there is
// work it would otherwise miss.
func (c *conn) doneWriting() {
	c.mu.Lock()
	c.writing = false
	work := len(c.ready) > 0 || c.readerDone && c.inflight == 0
	c.mu.Unlock()
	if work {
		c.signal()
	}
}

// setBroken records a failed write: the connection closes, and replies
// from now on are dropped.
func (c *conn) setBroken() {
	c.mu.Lock()
	c.broken = true
	c.mu.Unlock()
	c.close()
}

// Flush writes the ready replies from the calling goroutine, at the end of
// its burst (Batch), as far as the socket takes them without waiting; the
// writer goroutine writes the rest.
func (c *conn) Flush() {
	b := c.fbatch
	c.mu.Lock()
	if !c.takeReady(b) {
		// Nothing, or the goroutine writing takes them after its write.
		c.mu.Unlock()
		return
	}
	broken := c.broken
	c.mu.Unlock()
	if !broken {
		b.build()
		rest, err := c.sio.TryWritev(b.bufs)
		switch {
		case err != nil:
			c.setBroken()
		case len(rest) > 0:
			c.mu.Lock()
			b.rest = rest
			c.handoff = b
			c.mu.Unlock()
			c.signal()
			return
		}
	}
	c.retireAll(b)
	c.doneWriting()
}

// stallStep is how many bytes of replies a client must read within the
// stall timeout.
const stallStep = 4 << 20

// writeStalled writes iov, each step of up to stallStep bytes within the
// server's stall timeout; wb is the net.Buffers a connection without a
// descriptor writes through (it escapes: the caller's, declared once).
func (c *conn) writeStalled(iov [][]byte, wb *net.Buffers) error {
	var err error
	for len(iov) > 0 && err == nil {
		n := rawio.Step(iov, stallStep)
		c.nc.SetWriteDeadline(time.Now().Add(c.s.opts.StallTimeout))
		if c.sio != nil {
			err = c.sio.Writev(iov[:n])
		} else {
			*wb = iov[:n]
			_, err = wb.WriteTo(c.nc)
		}
		iov = iov[n:]
	}
	// Cleared: an expired deadline would fail the completers' flushes,
	// which never wait, as well.
	c.nc.SetWriteDeadline(time.Time{})
	if errors.Is(err, os.ErrDeadlineExceeded) {
		c.s.log.WithError(err).Warnf("nbd: the client read less than %d bytes of replies in %v: closing its connection", stallStep, c.s.opts.StallTimeout)
	}
	return err
}

// writer writes the replies no completer's burst writes, and what a
// completer's write left. After a write error it keeps retiring requests
// so that the reader and the backend can finish.
func (c *conn) writer() {
	b := newReplyBatch(c.s.opts.MaxInflight)
	var wb net.Buffers // escapes into WriteTo: declared once
	for {
		c.mu.Lock()
		h := c.handoff
		c.handoff = nil
		took := h == nil && c.takeReady(b)
		exit := h == nil && !took && !c.writing && len(c.ready) == 0 && c.readerDone && c.inflight == 0
		broken := c.broken
		c.mu.Unlock()
		switch {
		case exit:
			return
		case h != nil:
			// Writing stays ours: a completer's write left this.
			if !broken {
				if err := c.writeStalled(h.rest, &wb); err != nil {
					c.setBroken()
				}
			}
			c.retireAll(h)
			c.doneWriting()
		case took:
			if !broken {
				b.build()
				if err := c.writeStalled(b.bufs, &wb); err != nil {
					c.setBroken()
				}
			}
			c.retireAll(b)
			c.doneWriting()
		default:
			<-c.wake
		}
	}
}
