// Package uring is a minimal io_uring over raw system calls: enough for
// ublk (IORING_OP_URING_CMD with 128-byte SQEs) and for waking a ring
// from another goroutine (IORING_OP_READ of an eventfd, POLL_ADD).
//
// A Ring is not safe for concurrent use: one goroutine prepares SQEs,
// submits and reaps. For kernel objects that bind to the submitting task
// (ublk before UBLK_F_PER_IO_DAEMON), that goroutine must also hold
// runtime.LockOSThread for the life of the ring.
package uring

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Opcodes (enum io_uring_op in include/uapi/linux/io_uring.h).
const (
	OpNop      = 0
	OpPollAdd  = 6
	OpTimeout  = 11
	OpRead     = 22
	OpWrite    = 23
	OpURingCmd = 46
)

// Setup flags (io_uring_setup(2)).
const (
	SetupCQSize = 1 << 3
	SetupSQE128 = 1 << 10
	SetupCQE32  = 1 << 11
)

const (
	enterGetEvents = 1 << 0
	enterExtArg    = 1 << 3

	featSingleMmap = 1 << 0
	featExtArg     = 1 << 8

	offSQRing = 0
	offCQRing = 0x8000000
	offSQEs   = 0x10000000
)

// ErrUnavailable wraps the error of io_uring_setup when the kernel has
// no io_uring or refuses it (kernel.io_uring_disabled, seccomp).
var ErrUnavailable = errors.New("io_uring is not available")

// sqringOffsets is struct io_sqring_offsets.
type sqringOffsets struct {
	Head, Tail, RingMask, RingEntries, Flags, Dropped, Array, Resv1 uint32
	UserAddr                                                        uint64
}

// cqringOffsets is struct io_cqring_offsets.
type cqringOffsets struct {
	Head, Tail, RingMask, RingEntries, Overflow, Cqes, Flags, Resv1 uint32
	UserAddr                                                        uint64
}

// params is struct io_uring_params (120 bytes).
type params struct {
	SQEntries, CQEntries, Flags, SQThreadCPU, SQThreadIdle, Features, WQFd uint32
	Resv                                                                   [3]uint32
	SQOff                                                                  sqringOffsets
	CQOff                                                                  cqringOffsets
}

// SQE is the first 64 bytes of struct io_uring_sqe. With SetupSQE128 the
// command area continues for another 64 bytes; Cmd gives all of it.
type SQE struct {
	Opcode      uint8
	Flags       uint8
	Ioprio      uint16
	Fd          int32
	Off         uint64 // also addr2; low 32 bits are cmd_op for URING_CMD
	Addr        uint64
	Len         uint32
	OpFlags     uint32 // rw_flags, poll32_events, timeout_flags, uring_cmd_flags…
	UserData    uint64
	BufIndex    uint16
	Personality uint16
	SpliceFdIn  int32
	Addr3       uint64 // the command area starts here (offset 48)
	Pad2        uint64
}

// CQE is a completion: the SQE's user_data, its result and flags.
type CQE struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

// Options for New.
type Options struct {
	// SQE128 makes every SQE 128 bytes (80 bytes of command data), as
	// URING_CMD for ublk's control device needs.
	SQE128 bool
	// CQEntries sets the completion ring size (default: twice the SQ).
	CQEntries uint32
}

// Ring is one io_uring instance. It is not safe for concurrent use (see
// the package doc): one goroutine prepares, submits and reaps.
type Ring struct {
	fd       int
	sqeSize  uintptr
	features uint32

	sqRing, cqRing, sqeMem []byte
	cqShared               bool

	sqHead, sqTail, sqMask *uint32
	sqEntries              uint32
	sqTailLocal            uint32 // next SQE to hand out; published on Submit

	cqHead, cqTail, cqMask *uint32
	cqEntries              uint32
	cqes                   unsafe.Pointer
}

// New sets up a ring with at least entries submission slots.
func New(entries uint32, o Options) (*Ring, error) {
	var p params
	if o.SQE128 {
		p.Flags |= SetupSQE128
	}
	if o.CQEntries > 0 {
		p.Flags |= SetupCQSize
		p.CQEntries = o.CQEntries
	}
	fd, _, errno := unix.RawSyscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		err := os.NewSyscallError("io_uring_setup", errno)
		switch errno {
		case unix.ENOSYS, unix.EPERM, unix.EACCES:
			return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
		return nil, err
	}
	r := &Ring{fd: int(fd), features: p.Features, sqeSize: 64}
	if o.SQE128 {
		r.sqeSize = 128
	}
	if err := r.mmap(&p); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

func ptr32(b []byte, off uint32) *uint32 { return (*uint32)(unsafe.Pointer(&b[off])) }

func (r *Ring) mmap(p *params) error {
	sqSize := int(p.SQOff.Array + p.SQEntries*4)
	cqSize := int(p.CQOff.Cqes + p.CQEntries*16)
	if p.Flags&SetupCQE32 != 0 {
		cqSize = int(p.CQOff.Cqes + p.CQEntries*32)
	}
	single := p.Features&featSingleMmap != 0
	if single && cqSize > sqSize {
		sqSize = cqSize
	}
	var err error
	flags := unix.MAP_SHARED | unix.MAP_POPULATE
	prot := unix.PROT_READ | unix.PROT_WRITE
	if r.sqRing, err = unix.Mmap(r.fd, offSQRing, sqSize, prot, flags); err != nil {
		return os.NewSyscallError("mmap sq ring", err)
	}
	if single {
		r.cqRing, r.cqShared = r.sqRing, true
	} else if r.cqRing, err = unix.Mmap(r.fd, offCQRing, cqSize, prot, flags); err != nil {
		return os.NewSyscallError("mmap cq ring", err)
	}
	if r.sqeMem, err = unix.Mmap(r.fd, offSQEs, int(p.SQEntries)*int(r.sqeSize), prot, flags); err != nil {
		return os.NewSyscallError("mmap sqes", err)
	}
	r.sqHead = ptr32(r.sqRing, p.SQOff.Head)
	r.sqTail = ptr32(r.sqRing, p.SQOff.Tail)
	r.sqMask = ptr32(r.sqRing, p.SQOff.RingMask)
	r.sqEntries = *ptr32(r.sqRing, p.SQOff.RingEntries)
	r.sqTailLocal = atomic.LoadUint32(r.sqTail)
	// The index array maps ring slots to SQEs one to one.
	for i := uint32(0); i < r.sqEntries; i++ {
		*ptr32(r.sqRing, p.SQOff.Array+4*i) = i
	}
	r.cqHead = ptr32(r.cqRing, p.CQOff.Head)
	r.cqTail = ptr32(r.cqRing, p.CQOff.Tail)
	r.cqMask = ptr32(r.cqRing, p.CQOff.RingMask)
	r.cqEntries = *ptr32(r.cqRing, p.CQOff.RingEntries)
	r.cqes = unsafe.Pointer(&r.cqRing[p.CQOff.Cqes])
	return nil
}

// Fd is the ring's file descriptor.
func (r *Ring) Fd() int { return r.fd }

// SQEntries and CQEntries are the ring sizes the kernel chose.
func (r *Ring) SQEntries() uint32 { return r.sqEntries }
func (r *Ring) CQEntries() uint32 { return r.cqEntries }

// Close unmaps and closes the ring. Requests still in flight are
// cancelled by the kernel.
func (r *Ring) Close() error {
	if r.sqeMem != nil {
		unix.Munmap(r.sqeMem)
		r.sqeMem = nil
	}
	if r.cqRing != nil && !r.cqShared {
		unix.Munmap(r.cqRing)
	}
	r.cqRing = nil
	if r.sqRing != nil {
		unix.Munmap(r.sqRing)
		r.sqRing = nil
	}
	if r.fd >= 0 {
		err := unix.Close(r.fd)
		r.fd = -1
		return err
	}
	return nil
}

// GetSQE returns a zeroed free SQE, or nil when the submission ring is
// full (Submit first).
func (r *Ring) GetSQE() *SQE {
	head := atomic.LoadUint32(r.sqHead)
	if r.sqTailLocal-head >= r.sqEntries {
		return nil
	}
	idx := r.sqTailLocal & *r.sqMask
	r.sqTailLocal++
	off := uintptr(idx) * r.sqeSize
	b := r.sqeMem[off : off+r.sqeSize]
	clear(b)
	return (*SQE)(unsafe.Pointer(&b[0]))
}

// Pending is the number of SQEs prepared but not yet taken by the kernel.
func (r *Ring) Pending() uint32 { return r.sqTailLocal - atomic.LoadUint32(r.sqHead) }

// Cmd is the SQE's command area (offset 48): 16 bytes, or 80 with SQE128.
// Only valid for SQEs of this ring.
func (r *Ring) Cmd(s *SQE) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(&s.Addr3)), int(r.sqeSize)-48)
}

// PrepNop prepares a no-op.
func (s *SQE) PrepNop(userData uint64) {
	s.Opcode = OpNop
	s.UserData = userData
}

// PrepRead prepares a read of n bytes at buf (memory that must stay put
// until the completion, e.g. from mmap or a pinned heap object).
func (s *SQE) PrepRead(fd int, buf unsafe.Pointer, n uint32, off uint64, userData uint64) {
	s.Opcode = OpRead
	s.Fd = int32(fd)
	s.Addr = uint64(uintptr(buf))
	s.Len = n
	s.Off = off
	s.UserData = userData
}

// PrepPollAdd prepares a one-shot poll for events (POLLIN…).
func (s *SQE) PrepPollAdd(fd int, events uint32, userData uint64) {
	s.Opcode = OpPollAdd
	s.Fd = int32(fd)
	s.OpFlags = events
	s.UserData = userData
}

// PrepTimeout prepares a timeout that completes with -ETIME after ts
// (which must stay put until the completion).
func (s *SQE) PrepTimeout(ts *unix.Timespec, userData uint64) {
	s.Opcode = OpTimeout
	s.Fd = -1
	s.Addr = uint64(uintptr(unsafe.Pointer(ts)))
	s.Len = 1
	s.UserData = userData
}

// PrepURingCmd prepares IORING_OP_URING_CMD with cmd_op; the caller fills
// the command area through Ring.Cmd.
func (s *SQE) PrepURingCmd(fd int, cmdOp uint32, userData uint64) {
	s.Opcode = OpURingCmd
	s.Fd = int32(fd)
	s.Off = uint64(cmdOp) // cmd_op is the low half of the off union, __pad1 = 0
	s.UserData = userData
}

func (r *Ring) enter(toSubmit, minComplete, flags uint32, arg unsafe.Pointer, argSize uintptr) (int, error) {
	n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(toSubmit),
		uintptr(minComplete), uintptr(flags), uintptr(arg), argSize)
	if errno != 0 {
		return int(n), errno
	}
	return int(n), nil
}

// Submit hands the prepared SQEs to the kernel and returns how many it took.
func (r *Ring) Submit() (int, error) { return r.SubmitAndWait(0) }

// SubmitAndWait submits and then waits until at least waitNr completions
// are in the CQ ring. EINTR (Go's preemption signals) is retried.
func (r *Ring) SubmitAndWait(waitNr uint32) (int, error) {
	atomic.StoreUint32(r.sqTail, r.sqTailLocal)
	total := 0
	for {
		pending := r.Pending()
		var flags uint32
		if waitNr > 0 && r.Ready() < waitNr {
			flags = enterGetEvents
		}
		if pending == 0 && flags == 0 {
			return total, nil
		}
		n, err := r.enter(pending, waitNr, flags, nil, 0)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return total, os.NewSyscallError("io_uring_enter", err)
		}
		total += n
		if flags == 0 && r.Pending() > 0 && n == 0 {
			return total, os.NewSyscallError("io_uring_enter", syscall.EBUSY)
		}
		if r.Pending() == 0 && (waitNr == 0 || r.Ready() >= waitNr) {
			return total, nil
		}
	}
}

// getEventsArg is struct io_uring_getevents_arg.
type getEventsArg struct {
	Sigmask   uint64
	SigmaskSz uint32
	MinWait   uint32
	Ts        uint64
}

// WaitTimeout submits what is prepared and waits up to d for at least
// one completion. It returns syscall.ETIME when none arrived in time.
func (r *Ring) WaitTimeout(d time.Duration) error {
	if _, err := r.Submit(); err != nil {
		return err
	}
	if r.Ready() > 0 {
		return nil
	}
	if r.features&featExtArg == 0 {
		return errors.New("io_uring: kernel lacks IORING_FEAT_EXT_ARG")
	}
	deadline := time.Now().Add(d)
	// Heap objects do not move: the kernel reads ts through arg.Ts.
	ts := new(unix.Timespec)
	arg := new(getEventsArg)
	for r.Ready() == 0 {
		left := time.Until(deadline)
		if left <= 0 {
			return syscall.ETIME
		}
		*ts = unix.NsecToTimespec(left.Nanoseconds())
		arg.Ts = uint64(uintptr(unsafe.Pointer(ts)))
		_, err := r.enter(0, 1, enterGetEvents|enterExtArg, unsafe.Pointer(arg), unsafe.Sizeof(*arg))
		switch err {
		case nil, syscall.EINTR:
		case syscall.ETIME:
			if r.Ready() == 0 {
				return syscall.ETIME
			}
		default:
			return os.NewSyscallError("io_uring_enter", err)
		}
	}
	return nil
}

// Ready is the number of completions waiting in the CQ ring.
func (r *Ring) Ready() uint32 {
	return atomic.LoadUint32(r.cqTail) - atomic.LoadUint32(r.cqHead)
}

// PeekCQE returns the oldest completion without consuming it.
func (r *Ring) PeekCQE() (CQE, bool) {
	head := atomic.LoadUint32(r.cqHead)
	if head == atomic.LoadUint32(r.cqTail) {
		return CQE{}, false
	}
	return *(*CQE)(unsafe.Add(r.cqes, uintptr(head&*r.cqMask)*16)), true
}

// SeenCQE consumes the oldest completion.
func (r *Ring) SeenCQE() { atomic.AddUint32(r.cqHead, 1) }

// Reap calls fn for every completion in the CQ ring and consumes them.
// It returns how many it saw.
func (r *Ring) Reap(fn func(CQE)) int {
	n := 0
	for {
		c, ok := r.PeekCQE()
		if !ok {
			return n
		}
		r.SeenCQE()
		n++
		fn(c)
	}
}
