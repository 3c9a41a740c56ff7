package ublk

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/frontend/ublk/internal/uring"
)

// wakeTag is the user_data of the eventfd READ; tags are below 4096.
const wakeTag = 1 << 32

type completion struct {
	tag    uint16
	result int32
}

// queue is one hardware queue: its ring, descriptors and tag buffers are
// used only by the goroutine in run, locked to its OS thread as the
// kernel requires (all of a queue's commands come from one task). That
// goroutine ends with the thread still locked, so the thread exits with
// it: the kernel ties the queue to that task, and recovery wants it gone.
type queue struct {
	d     *Device
	id    int
	depth int
	maxIO int

	ring  *uring.Ring
	descs []byte // mmapped descriptor array, read only
	bufs  []byte // depth × maxIO: the BufferProvider's, or mmapped anonymous
	bp    BufferProvider
	bat   Batcher // the backend, if it is one
	efd   int
	wbuf  *uint64 // eventfd READ target (heap: does not move)
	reqs  []Request
	owned []atomic.Bool // the backend holds the tag

	mu sync.Mutex // guards done, closed and the eventfd's life
	// done is what the backend finished, to commit.
	// +checklocks:mu
	done      []completion
	closed    bool
	wakeArmed atomic.Bool // an eventfd write is on its way
	stopping  atomic.Bool
	detaching atomic.Bool // stopping without STOP_DEV: new requests stay with the kernel
	inBackend atomic.Int64
	exited    chan struct{}
	err       error

	doneFn  func(*Request, error)
	commits []completion // to commit on this turn (queue goroutine only)
	live    int          // tags whose FETCH/COMMIT is with the kernel
}

func newQueue(d *Device, id, depth int) *queue {
	q := &queue{d: d, id: id, depth: depth, maxIO: d.opts.MaxIOBytes, efd: -1,
		exited: make(chan struct{}), wbuf: new(uint64)}
	q.doneFn = q.complete
	q.bat, _ = d.be.(Batcher)
	q.reqs = make([]Request, depth)
	q.owned = make([]atomic.Bool, depth)
	for i := range q.reqs {
		q.reqs[i].q = q
		q.reqs[i].tag = uint16(i)
	}
	return q
}

func (q *queue) setup() error {
	page := os.Getpagesize()
	var err error
	q.descs, err = unix.Mmap(int(q.d.cdev.Fd()), descAreaOffset(q.id, page), descAreaSize(q.depth, page),
		unix.PROT_READ, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fmt.Errorf("ublk: queue %d: mmap descriptors: %w", q.id, err)
	}
	n := q.depth * q.maxIO
	if bp, ok := q.d.be.(BufferProvider); ok {
		b, err := bp.QueueBuffers(q.id, n)
		if err != nil {
			return fmt.Errorf("ublk: queue %d: buffers: %w", q.id, err)
		}
		if len(b) < n {
			bp.ReleaseQueueBuffers(q.id, b)
			return fmt.Errorf("ublk: queue %d: buffers: %d bytes, want %d", q.id, len(b), n)
		}
		q.bufs, q.bp = b[:n:n], bp
	} else if q.bufs, err = unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		return fmt.Errorf("ublk: queue %d: mmap buffers: %w", q.id, err)
	}
	if q.efd, err = unix.Eventfd(0, unix.EFD_CLOEXEC); err != nil {
		return fmt.Errorf("ublk: queue %d: eventfd: %w", q.id, err)
	}
	// Every tag has at most one command with the kernel, plus the
	// eventfd read.
	q.ring, err = uring.New(uint32(q.depth+2), uring.Options{CQEntries: uint32(2 * (q.depth + 2))})
	if err != nil {
		return fmt.Errorf("ublk: queue %d: ring: %w", q.id, err)
	}
	return nil
}

func (q *queue) cleanup() {
	if q.ring != nil {
		q.ring.Close() // cancels what is still with the kernel
		q.ring = nil
	}
	if q.descs != nil {
		unix.Munmap(q.descs)
		q.descs = nil
	}
	if q.bufs != nil && q.inBackend.Load() == 0 {
		if q.bp != nil {
			q.bp.ReleaseQueueBuffers(q.id, q.bufs)
		} else {
			unix.Munmap(q.bufs)
		}
		q.bufs = nil
	}
	q.mu.Lock()
	q.closed = true
	if q.efd >= 0 {
		unix.Close(q.efd)
		q.efd = -1
	}
	q.mu.Unlock()
}

func (q *queue) bufAddr(tag uint16) uint64 {
	return uint64(uintptr(unsafe.Pointer(&q.bufs[int(tag)*q.maxIO])))
}

// sqe returns a free SQE, submitting what is queued if the ring is full.
func (q *queue) sqe() (*uring.SQE, error) {
	if s := q.ring.GetSQE(); s != nil {
		return s, nil
	}
	if _, err := q.ring.Submit(); err != nil {
		return nil, err
	}
	if s := q.ring.GetSQE(); s != nil {
		return s, nil
	}
	return nil, errors.New("submission ring full")
}

func (q *queue) prepIO(nr uint32, tag uint16, result int32) error {
	s, err := q.sqe()
	if err != nil {
		return err
	}
	s.PrepURingCmd(int(q.d.cdev.Fd()), ioOp(nr, q.d.ioctlEnc), uint64(tag))
	c := ioCmd{QID: uint16(q.id), Tag: tag, Result: result, Addr: q.bufAddr(tag)}
	c.encode(q.ring.Cmd(s))
	q.live++
	return nil
}

func (q *queue) armWake() error {
	s, err := q.sqe()
	if err != nil {
		return err
	}
	s.PrepRead(q.efd, unsafe.Pointer(q.wbuf), 8, 0, wakeTag)
	return nil
}

// wakeLocked makes the queue goroutine look at q.done and q.stopping.
// q.mu is held, so the eventfd cannot be closed under it.
func (q *queue) wakeLocked() {
	if q.closed || q.wakeArmed.Swap(true) {
		return
	}
	var one = [8]byte{1}
	for {
		_, err := unix.Write(q.efd, one[:])
		if err != unix.EINTR {
			return
		}
	}
}

// stop makes the queue goroutine finish what the backend holds and exit.
// With detach, requests that arrive meanwhile are left to the kernel,
// which requeues them for the next server, instead of served.
func (q *queue) stop(detach bool) {
	q.detaching.Store(detach)
	q.stopping.Store(true)
	q.mu.Lock()
	q.wakeArmed.Store(false)
	q.wakeLocked()
	q.mu.Unlock()
}

// complete is the done callback handed to the backend.
func (q *queue) complete(r *Request, err error) {
	if r.q != q || !q.owned[r.tag].CompareAndSwap(true, false) {
		panic("ublk: request completed twice or by the wrong queue")
	}
	res := int32(r.Len)
	if r.Op != OpRead && r.Op != OpWrite {
		res = 0
	}
	if err != nil {
		res = errnoResult(err)
	}
	q.mu.Lock()
	q.done = append(q.done, completion{tag: r.tag, result: res})
	q.wakeLocked()
	q.mu.Unlock()
}

// errnoResult maps a backend error to the negative errno the kernel gets.
func errnoResult(err error) int32 {
	if err == nil {
		return 0
	}
	var e syscall.Errno
	if errors.As(err, &e) && e != 0 {
		return -int32(e)
	}
	return -int32(syscall.EIO)
}

// run is the queue goroutine. It never unlocks its thread, which
// therefore exits with it.
func (q *queue) run(ready chan<- error) {
	runtime.LockOSThread()
	defer close(q.exited)
	if err := q.setup(); err != nil {
		q.cleanup()
		ready <- err
		return
	}
	err := q.start()
	if err != nil {
		q.err = err
		q.cleanup()
		ready <- err
		return
	}
	ready <- nil
	q.err = q.loop()
	q.cleanup()
}

func (q *queue) start() error {
	for t := 0; t < q.depth; t++ {
		if err := q.prepIO(ioFetchReq, uint16(t), 0); err != nil {
			return fmt.Errorf("ublk: queue %d: %w", q.id, err)
		}
	}
	if err := q.armWake(); err != nil {
		return fmt.Errorf("ublk: queue %d: %w", q.id, err)
	}
	if _, err := q.ring.Submit(); err != nil {
		return fmt.Errorf("ublk: queue %d: FETCH_REQ: %w", q.id, err)
	}
	// A FETCH the kernel refused completes at once with an error.
	var bad error
	q.ring.Reap(func(c uring.CQE) {
		if c.UserData == wakeTag {
			q.handle(c)
		} else if c.Res < 0 {
			q.live--
			if bad == nil {
				bad = fmt.Errorf("ublk: queue %d: FETCH_REQ tag %d: %w", q.id, c.UserData, syscall.Errno(-c.Res))
			}
		}
	})
	return bad
}

func (q *queue) loop() error {
	var firstErr error
	for {
		if (q.stopping.Load() || q.live == 0) && q.inBackend.Load() == 0 {
			// Stopped, or every tag was aborted (the device is gone).
			// The last commits go to the kernel before the ring closes.
			if _, err := q.ring.Submit(); err != nil && firstErr == nil {
				firstErr = fmt.Errorf("ublk: queue %d: %w", q.id, err)
			}
			return firstErr
		}
		if _, err := q.ring.SubmitAndWait(1); err != nil {
			return fmt.Errorf("ublk: queue %d: %w", q.id, err)
		}
		q.ring.Reap(func(c uring.CQE) {
			if err := q.handle(c); err != nil && firstErr == nil {
				firstErr = err
			}
		})
		if q.bat != nil {
			q.bat.BatchEnd(q.id)
		}
		q.mu.Lock()
		q.commits = append(q.commits, q.done...)
		q.done = q.done[:0]
		q.mu.Unlock()
		for _, c := range q.commits {
			q.inBackend.Add(-1)
			if q.stopping.Load() && q.live == 0 {
				continue // nothing to commit to any more
			}
			if err := q.prepIO(ioCommitAndFetchReq, c.tag, c.result); err != nil {
				return fmt.Errorf("ublk: queue %d: %w", q.id, err)
			}
		}
		q.commits = q.commits[:0]
	}
}

// handle processes one completion of the queue's ring.
func (q *queue) handle(c uring.CQE) error {
	if c.UserData == wakeTag {
		q.wakeArmed.Store(false)
		if c.Res < 0 && c.Res != -int32(unix.EINTR) && c.Res != -int32(unix.EAGAIN) {
			return fmt.Errorf("ublk: queue %d: eventfd read: %w", q.id, syscall.Errno(-c.Res))
		}
		return q.armWake() // also when stopping: the backend may still finish

	}
	tag := uint16(c.UserData)
	if int(tag) >= q.depth {
		return fmt.Errorf("ublk: queue %d: completion for unknown tag %d", q.id, c.UserData)
	}
	q.live--
	switch c.Res {
	case ioResOK:
	case ioResAbort:
		return nil // the device is stopping: this tag is done
	default:
		return fmt.Errorf("ublk: queue %d tag %d: command failed: %w", q.id, tag, syscall.Errno(-c.Res))
	}
	if q.detaching.Load() {
		// Left with the kernel: it requeues the request when the ring
		// closes and the next server gets it.
		return nil
	}
	off := int(tag) * sizeIODesc
	desc := decodeIODesc(q.descs[off : off+sizeIODesc])
	r := &q.reqs[tag]
	r.Op = Op(desc.op())
	r.Offset = int64(desc.StartSector) << 9
	r.Len = int(desc.NrSectors) << 9
	r.FUA = desc.OpFlags&ioFlagFUA != 0
	r.NoUnmap = desc.OpFlags&ioFlagNoUnmap != 0
	r.Data = nil
	q.inBackend.Add(1)
	q.owned[tag].Store(true)
	switch r.Op {
	case OpRead, OpWrite:
		if r.Len > q.maxIO {
			q.complete(r, syscall.EIO)
			return nil
		}
		b := int(tag) * q.maxIO
		r.Data = q.bufs[b : b+r.Len : b+r.Len]
	case OpFlush:
		// A flush has no range; the kernel leaves whatever was there.
		r.Offset, r.Len = 0, 0
	case OpDiscard, OpWriteZeroes:
	default:
		q.complete(r, syscall.EOPNOTSUPP)
		return nil
	}
	q.d.be.Submit(r, q.doneFn)
	return nil
}
