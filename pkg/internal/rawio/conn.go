// Package rawio does system calls that cannot sleep without the Go
// runtime's accounting of blocking system calls.
//
// syscall.Syscall, under every net.Conn read and write and os.File
// ReadAt, marks the goroutine's P as in a system call. A write on TCP
// loopback runs the receiver's whole network stack inline and takes
// 10–20 µs, long enough for the runtime's monitor thread (sysmon, polling
// every 20 µs while it finds such Ps) to hand the P to another thread and
// wake one: in the daemons' CPU profiles at 4 KiB QD32 that monitoring
// and the thread wake-ups it caused were 10–20 % of all CPU time. A call
// that cannot sleep — a socket in non-blocking mode returns EAGAIN
// instead, a read with RWF_NOWAIT likewise, a copy from or to tmpfs never
// waits — can hold its P like any other computation, as
// syscall.RawSyscall does. For sockets the poller still waits for
// readiness when there is nothing to read or no room to write
// (syscall.RawConn), so deadlines and Close work as with net.Conn.
package rawio

import (
	"io"
	"net"
	"syscall"
	"unsafe"
)

// maxIov is IOV_MAX: the most buffers one writev takes.
const maxIov = 1024

// Conn does the reads and writes of one socket. One goroutine may read
// while another writes; two writes must not overlap.
type Conn struct {
	rc      syscall.RawConn
	iov     []syscall.Iovec
	iovUsed int // the most entries of iov a write used: what to clear

	// Arguments and results of the callbacks, kept here so that the
	// closures passed to RawConn are allocated once.
	rbuf     []byte
	rn       int
	rerr     error
	wbufs    [][]byte
	werr     error
	rest     [][]byte // TryWritev's result
	noWait   bool     // TryWritev: return at EAGAIN instead of waiting
	readFn   func(fd uintptr) bool
	writevFn func(fd uintptr) bool
}

// New returns a Conn for nc, or nil if nc has no file descriptor (a pipe
// of net.Pipe, an in-memory connection): the caller then uses nc itself.
func New(nc net.Conn) *Conn {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	c := &Conn{rc: rc, iov: make([]syscall.Iovec, 0, 64)}
	c.readFn = c.read
	c.writevFn = c.writev
	return c
}

// Read reads into p what the socket has, waiting only if it has nothing.
// It returns io.EOF at the end of the stream.
func (c *Conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.rbuf, c.rn, c.rerr = p, 0, nil
	if err := c.rc.Read(c.readFn); err != nil {
		c.rbuf = nil
		return 0, err
	}
	c.rbuf = nil
	return c.rn, c.rerr
}

func (c *Conn) read(fd uintptr) bool {
	for {
		n, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&c.rbuf[0])), uintptr(len(c.rbuf)))
		switch {
		case e == syscall.EINTR:
			continue
		case e == syscall.EAGAIN:
			return false // wait for the poller
		case e != 0:
			c.rerr = e
		case n == 0:
			c.rerr = io.EOF
		default:
			c.rn = int(n)
		}
		return true
	}
}

// Writev writes all of bufs, waiting for room in the socket only when it
// has none. bufs is consumed: its slices are advanced past what was
// written.
func (c *Conn) Writev(bufs [][]byte) error {
	c.wbufs, c.werr = bufs, nil
	for len(c.wbufs) > 0 && len(c.wbufs[0]) == 0 {
		c.wbufs = c.wbufs[1:]
	}
	if len(c.wbufs) == 0 {
		return nil
	}
	err := c.rc.Write(c.writevFn)
	c.wbufs = nil
	clear(c.iov[:c.iovUsed]) // no references to the buffers written
	c.iovUsed = 0
	if err != nil {
		return err
	}
	return c.werr
}

// TryWritev writes what the socket takes of bufs now, without waiting for
// room, and returns what is left (a tail of bufs, its first slice advanced
// past what was written; empty when all was written).
func (c *Conn) TryWritev(bufs [][]byte) ([][]byte, error) {
	c.noWait = true
	err := c.Writev(bufs)
	c.noWait = false
	rest := c.rest
	c.rest = nil
	return rest, err
}

func (c *Conn) writev(fd uintptr) bool {
	for len(c.wbufs) > 0 {
		c.iov = c.iov[:0]
		for _, b := range c.wbufs {
			if len(c.iov) == maxIov {
				break
			}
			if len(b) > 0 {
				v := syscall.Iovec{Base: &b[0]}
				v.SetLen(len(b))
				c.iov = append(c.iov, v)
			}
		}
		c.iovUsed = max(c.iovUsed, len(c.iov))
		n, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&c.iov[0])), uintptr(len(c.iov)))
		switch {
		case e == syscall.EINTR:
			continue
		case e == syscall.EAGAIN:
			if c.noWait {
				c.rest = c.wbufs
				return true
			}
			return false // wait for room
		case e != 0:
			c.werr = e
			return true
		}
		c.advance(int(n))
	}
	return true
}

// advance drops n written bytes from the front of wbufs.
func (c *Conn) advance(n int) {
	for n > 0 && len(c.wbufs) > 0 {
		if n < len(c.wbufs[0]) {
			c.wbufs[0] = c.wbufs[0][n:]
			return
		}
		n -= len(c.wbufs[0])
		c.wbufs = c.wbufs[1:]
	}
	for len(c.wbufs) > 0 && len(c.wbufs[0]) == 0 {
		c.wbufs = c.wbufs[1:]
	}
}

// Step is how many buffers at the head of iov, at least one, hold at most
// max bytes together: one step of a long write that must make progress
// within a bound (a write deadline per step).
func Step(iov [][]byte, max int) int {
	n, size := 0, 0
	for n < len(iov) && (n == 0 || size+len(iov[n]) <= max) {
		size += len(iov[n])
		n++
	}
	return n
}
