// Package ublk serves a Linux ublk block device (/dev/ublkbN) from a
// Backend, asynchronously: every queue has one goroutine locked to an OS
// thread that owns the queue's io_uring and talks to the kernel, while
// the IO itself is handed to the Backend, which may keep as many requests
// in flight as the queue depth allows and complete them from any
// goroutine.
//
// Data moves through per-tag buffers the kernel copies into (WRITE) and
// out of (READ); no UBLK_F_USER_COPY or zero copy, so any kernel with
// ublk (6.0+) works. Control commands use the ioctl-encoded opcodes
// when the kernel reports UBLK_F_CMD_IOCTL_ENCODE, the legacy ones
// otherwise.
package ublk

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/internal/uring"
)

// ErrNoUblk means the kernel offers no ublk: /dev/ublk-control is missing
// (ublk_drv not loaded or not built) or io_uring is unavailable.
var ErrNoUblk = errors.New("ublk: kernel has no ublk support")

// ControlPath is the ublk control device.
const ControlPath = "/dev/ublk-control"

// Op is a ublk IO operation (UBLK_IO_OP_*).
type Op uint8

const (
	OpRead        Op = 0
	OpWrite       Op = 1
	OpFlush       Op = 2
	OpDiscard     Op = 3
	OpWriteSame   Op = 4
	OpWriteZeroes Op = 5
)

func (o Op) String() string {
	switch o {
	case OpRead:
		return "read"
	case OpWrite:
		return "write"
	case OpFlush:
		return "flush"
	case OpDiscard:
		return "discard"
	case OpWriteSame:
		return "write-same"
	case OpWriteZeroes:
		return "write-zeroes"
	}
	return fmt.Sprintf("op%d", uint8(o))
}

// Request is one IO of the block device. It belongs to the Backend from
// Submit until done is called; after that neither it nor Data may be
// touched.
type Request struct {
	Op     Op
	Offset int64 // bytes; 0 for OpFlush
	Len    int   // bytes; 0 for OpFlush
	// FUA: the write must be durable when done is called.
	FUA bool
	// NoUnmap: for WRITE_ZEROES, the range must stay allocated.
	NoUnmap bool
	// Data is the tag's buffer, Len bytes, for READ (to fill) and WRITE
	// (to store); nil otherwise.
	Data []byte

	q   *queue
	tag uint16
}

// Queue and Tag identify the request's slot (for tracing).
func (r *Request) Queue() int { return r.q.id }
func (r *Request) Tag() int   { return int(r.tag) }

// Backend performs IO. Submit must not block for long (it runs on the
// queue's thread); done may be called from any goroutine, exactly once,
// also from within Submit. A nil error completes the whole request; an
// error is reported to the kernel as -errno (a syscall.Errno found with
// errors.As, else EIO).
type Backend interface {
	Submit(r *Request, done func(*Request, error))
}

// Options describe the device.
type Options struct {
	// Size in bytes, a multiple of LogicalBlockSize.
	Size int64
	// LogicalBlockSize (default 512) and PhysicalBlockSize (default
	// 4096, at least LogicalBlockSize): powers of two, 512 to page size.
	LogicalBlockSize, PhysicalBlockSize int
	// Queues (default runtime.NumCPU(); the kernel caps it at the CPU
	// count) and QueueDepth (default 128, at most 4096).
	Queues, QueueDepth int
	// MaxIOBytes is the largest single request (default 512 KiB, a
	// multiple of the page size, at most 32 MiB). Every tag has a buffer
	// this big.
	MaxIOBytes int
	// What the backend can do: the kernel only sends the ops enabled here.
	Discard, WriteZeroes, VolatileCache, FUA, ReadOnly bool
}

func (o *Options) setDefaults() error {
	if o.LogicalBlockSize == 0 {
		o.LogicalBlockSize = 512
	}
	if o.PhysicalBlockSize == 0 {
		o.PhysicalBlockSize = max(4096, o.LogicalBlockSize)
	}
	if o.Queues == 0 {
		o.Queues = runtime.NumCPU()
	}
	if o.QueueDepth == 0 {
		o.QueueDepth = 128
	}
	if o.MaxIOBytes == 0 {
		o.MaxIOBytes = 512 << 10
	}
	page := os.Getpagesize()
	pow2 := func(n int) bool { return n > 0 && n&(n-1) == 0 }
	switch {
	case !pow2(o.LogicalBlockSize) || o.LogicalBlockSize < 512 || o.LogicalBlockSize > page:
		return fmt.Errorf("ublk: logical block size %d: want a power of two from 512 to %d", o.LogicalBlockSize, page)
	case !pow2(o.PhysicalBlockSize) || o.PhysicalBlockSize < o.LogicalBlockSize || o.PhysicalBlockSize > 1<<20:
		return fmt.Errorf("ublk: physical block size %d: want a power of two from the logical block size to 1 MiB", o.PhysicalBlockSize)
	case o.Size <= 0 || o.Size%int64(o.LogicalBlockSize) != 0:
		return fmt.Errorf("ublk: size %d: want a positive multiple of %d", o.Size, o.LogicalBlockSize)
	case o.Queues < 1 || o.Queues > maxNrQueues:
		return fmt.Errorf("ublk: %d queues: want 1 to %d", o.Queues, maxNrQueues)
	case o.QueueDepth < 1 || o.QueueDepth > maxQueueDepth:
		return fmt.Errorf("ublk: queue depth %d: want 1 to %d", o.QueueDepth, maxQueueDepth)
	case o.MaxIOBytes < page || o.MaxIOBytes%page != 0 || o.MaxIOBytes > maxIOBufBytes:
		return fmt.Errorf("ublk: max IO %d bytes: want a multiple of %d up to %d", o.MaxIOBytes, page, maxIOBufBytes)
	}
	return nil
}

// buildParams is what SET_PARAMS sends for o.
func buildParams(o *Options) params {
	shift := func(n int) uint8 {
		s := uint8(0)
		for 1<<s < n {
			s++
		}
		return s
	}
	p := params{Types: paramTypeBasic}
	p.Basic = paramBasic{
		LogicalBSShift:  shift(o.LogicalBlockSize),
		PhysicalBSShift: shift(o.PhysicalBlockSize),
		IOOptShift:      shift(o.PhysicalBlockSize),
		IOMinShift:      shift(o.PhysicalBlockSize),
		MaxSectors:      uint32(o.MaxIOBytes >> 9),
		DevSectors:      uint64(o.Size >> 9),
	}
	if o.ReadOnly {
		p.Basic.Attrs |= attrReadOnly
	}
	if o.VolatileCache {
		p.Basic.Attrs |= attrVolatileCch
	}
	if o.FUA {
		p.Basic.Attrs |= attrFUA
	}
	if (o.Discard || o.WriteZeroes) && !o.ReadOnly {
		p.Types |= paramTypeDisc
		// The kernel wants a granularity whenever the part is present
		// and supports only single-segment discards.
		p.Discard.Granularity = uint32(o.PhysicalBlockSize)
		p.Discard.MaxDiscardSegments = 1
		// Bounded so that a request's byte length fits an int32 result.
		const maxSectors = 1 << 22 // 2 GiB
		if o.Discard {
			p.Discard.MaxDiscardSectors = maxSectors
		}
		if o.WriteZeroes {
			p.Discard.MaxWriteZeroesSectors = maxSectors
		}
	}
	return p
}

// Device is a running ublk device.
type Device struct {
	opts     Options
	be       Backend
	id       uint32
	info     devInfo
	features uint64
	ioctlEnc bool

	ctrlMu   sync.Mutex
	ctrlFd   int
	ctrlRing *uring.Ring
	scratch  []byte // mmapped: what control commands point the kernel at
	ctrlBad  error  // a command timed out: its memory may still be in use

	cdev   *os.File
	queues []*queue

	stopOnce sync.Once
	stopErr  error
}

// Scratch layout.
const (
	scratchDevInfo  = 0
	scratchParams   = 128
	scratchFeatures = 512
)

// ctrlTimeout bounds one control command.
var ctrlTimeout = 30 * time.Second

// Probe reports the UBLK_F_* features of the running kernel, or an error
// wrapping ErrNoUblk.
func Probe() (uint64, error) {
	d := &Device{ctrlFd: -1}
	if err := d.openControl(); err != nil {
		return 0, err
	}
	defer d.closeControl()
	return d.features, nil
}

func (d *Device) openControl() error {
	fd, err := unix.Open(ControlPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO) {
			return fmt.Errorf("%w: %s: %w (is ublk_drv loaded?)", ErrNoUblk, ControlPath, err)
		}
		return fmt.Errorf("ublk: open %s: %w", ControlPath, err)
	}
	d.ctrlFd = fd
	d.ctrlRing, err = uring.New(4, uring.Options{SQE128: true})
	if err != nil {
		d.closeControl()
		if errors.Is(err, uring.ErrUnavailable) {
			return fmt.Errorf("%w: %w", ErrNoUblk, err)
		}
		return fmt.Errorf("ublk: control ring: %w", err)
	}
	d.scratch, err = unix.Mmap(-1, 0, os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		d.closeControl()
		return fmt.Errorf("ublk: mmap: %w", err)
	}
	// GET_FEATURES exists only ioctl-encoded (6.5+); a kernel without it
	// gets the legacy opcodes and no optional features.
	res, err := d.ctrl(cmdGetFeatures, true, ctrlCmd{DevID: ^uint32(0), QueueID: 0xffff, Len: 8,
		Addr: d.scratchAddr(scratchFeatures)})
	if err != nil {
		d.closeControl()
		return err
	}
	if res >= 0 {
		d.features = ne.Uint64(d.scratch[scratchFeatures:])
	}
	d.ioctlEnc = d.features&FlagCmdIoctlEncode != 0
	return nil
}

func (d *Device) closeControl() {
	if d.ctrlRing != nil && d.ctrlBad == nil {
		d.ctrlRing.Close()
		if d.scratch != nil {
			unix.Munmap(d.scratch)
		}
	}
	d.ctrlRing, d.scratch = nil, nil
	if d.ctrlFd >= 0 {
		unix.Close(d.ctrlFd)
		d.ctrlFd = -1
	}
}

func (d *Device) scratchAddr(off int) uint64 { return uint64(uintptr(unsafe.Pointer(&d.scratch[off]))) }

// ctrl runs one control command and returns the kernel's result
// (negative errno) or an error if the ring failed or timed out.
func (d *Device) ctrl(nr uint32, ioctlEnc bool, c ctrlCmd) (int32, error) {
	d.ctrlMu.Lock()
	defer d.ctrlMu.Unlock()
	if d.ctrlBad != nil {
		return 0, d.ctrlBad
	}
	// The command may finish in an io-wq worker, which posts it through
	// task work to the submitting thread: submit and wait on one thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r := d.ctrlRing
	s := r.GetSQE()
	if s == nil {
		return 0, errors.New("ublk: control ring full")
	}
	s.PrepURingCmd(d.ctrlFd, ctrlOp(nr, ioctlEnc), uint64(nr))
	c.encode(r.Cmd(s))
	if err := r.WaitTimeout(ctrlTimeout); err != nil {
		if err == syscall.ETIME {
			d.ctrlBad = fmt.Errorf("ublk: control command %#x timed out after %v", nr, ctrlTimeout)
			return 0, d.ctrlBad
		}
		return 0, fmt.Errorf("ublk: control command %#x: %w", nr, err)
	}
	cqe, _ := r.PeekCQE()
	r.SeenCQE()
	return cqe.Res, nil
}

// ctrlErr turns a control command's result into an error.
func ctrlErr(name string, res int32, err error) error {
	if err != nil {
		return err
	}
	if res < 0 {
		return fmt.Errorf("ublk: %s: %w", name, syscall.Errno(-res))
	}
	return nil
}

func (d *Device) devCmd(name string, nr uint32, c ctrlCmd) error {
	c.DevID = d.id
	c.QueueID = 0xffff
	res, err := d.ctrl(nr, d.ioctlEnc, c)
	return ctrlErr(name, res, err)
}

// New creates, configures and starts a ublk device served by be. It
// returns once /dev/ublkbN exists.
func New(opts Options, be Backend) (*Device, error) {
	if err := opts.setDefaults(); err != nil {
		return nil, err
	}
	d := &Device{opts: opts, be: be, ctrlFd: -1}
	if err := d.openControl(); err != nil {
		return nil, err
	}
	flags := uint64(0)
	if d.ioctlEnc {
		flags |= FlagCmdIoctlEncode
	}
	// Not UBLK_F_USER_RECOVERY: START/END_USER_RECOVERY are not written
	// yet, and with the flag a daemon that dies leaves the device
	// quiesced with its IO held, which nothing could then recover. Without
	// it the kernel fails the device's IO when the daemon dies.
	info := devInfo{
		NrHWQueues:    uint16(opts.Queues),
		QueueDepth:    uint16(opts.QueueDepth),
		MaxIOBufBytes: uint32(opts.MaxIOBytes),
		DevID:         ^uint32(0),
		SrvPID:        int32(os.Getpid()),
		Flags:         flags,
	}
	info.encode(d.scratch[scratchDevInfo:])
	res, err := d.ctrl(cmdAddDev, d.ioctlEnc, ctrlCmd{DevID: ^uint32(0), QueueID: 0xffff,
		Len: sizeDevInfo, Addr: d.scratchAddr(scratchDevInfo)})
	if err = ctrlErr("ADD_DEV", res, err); err != nil {
		d.closeControl()
		return nil, err
	}
	d.info = decodeDevInfo(d.scratch[scratchDevInfo:])
	d.id = d.info.DevID
	if err := d.setup(); err != nil {
		d.teardown(false)
		return nil, err
	}
	return d, nil
}

func (d *Device) setup() error {
	// The kernel may have lowered what we asked for.
	if int(d.info.MaxIOBufBytes) < d.opts.MaxIOBytes {
		d.opts.MaxIOBytes = int(d.info.MaxIOBufBytes)
	}
	p := buildParams(&d.opts)
	p.encode(d.scratch[scratchParams:])
	if err := d.devCmd("SET_PARAMS", cmdSetParams, ctrlCmd{Len: sizeParams, Addr: d.scratchAddr(scratchParams)}); err != nil {
		return err
	}
	cpath := fmt.Sprintf("/dev/ublkc%d", d.id)
	var err error
	for i := 0; i < 200; i++ { // udev or devtmpfs may lag behind ADD_DEV
		if d.cdev, err = os.OpenFile(cpath, os.O_RDWR, 0); err == nil || !errors.Is(err, os.ErrNotExist) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		return fmt.Errorf("ublk: %w", err)
	}
	nq := int(d.info.NrHWQueues)
	depth := int(d.info.QueueDepth)
	ready := make(chan error, nq)
	for i := 0; i < nq; i++ {
		q := newQueue(d, i, depth)
		d.queues = append(d.queues, q)
		go q.run(ready)
	}
	var errs []error
	for i := 0; i < nq; i++ {
		if err := <-ready; err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	// START_DEV waits until every tag has been fetched, then adds the
	// disk, which reads the partition table through the queues.
	return d.devCmd("START_DEV", cmdStartDev, ctrlCmd{Data: uint64(os.Getpid())})
}

// Path is the block device, /dev/ublkbN.
func (d *Device) Path() string { return fmt.Sprintf("/dev/ublkb%d", d.id) }

// ID is the device number N.
func (d *Device) ID() int { return int(d.id) }

// Features are the kernel's UBLK_F_* flags (from GET_FEATURES).
func (d *Device) Features() uint64 { return d.features }

// Flags are the UBLK_F_* flags the device was created with.
func (d *Device) Flags() uint64 { return d.info.Flags }

// Queues and QueueDepth are what the kernel granted.
func (d *Device) Queues() int     { return int(d.info.NrHWQueues) }
func (d *Device) QueueDepth() int { return int(d.info.QueueDepth) }

// Stop takes the device down: STOP_DEV (the kernel removes the disk,
// waits for the requests in flight and aborts the fetches), waits for the
// queues to finish what the backend still holds, then DEL_DEV_ASYNC (or
// DEL_DEV on kernels before 6.9, which waits for every opener of
// /dev/ublkbN to close it).
func (d *Device) Stop() error {
	d.stopOnce.Do(func() { d.stopErr = d.teardown(true) })
	return d.stopErr
}

// queueExitTimeout bounds how long Stop waits for the queues.
var queueExitTimeout = 30 * time.Second

func (d *Device) teardown(started bool) error {
	var errs []error
	if started {
		if err := d.devCmd("STOP_DEV", cmdStopDev, ctrlCmd{}); err != nil {
			errs = append(errs, err)
		}
	}
	for _, q := range d.queues {
		q.stop()
	}
	deadline := time.After(queueExitTimeout)
	clean := true
	for _, q := range d.queues {
		select {
		case <-q.exited:
			if q.err != nil {
				errs = append(errs, q.err)
			}
		case <-deadline:
			clean = false
			errs = append(errs, fmt.Errorf("ublk: queue %d did not stop within %v (%d requests in the backend)",
				q.id, queueExitTimeout, q.inBackend.Load()))
		}
	}
	if d.cdev != nil && clean {
		d.cdev.Close()
		d.cdev = nil
	}
	// DEL_DEV waits until the device is released: /dev/ublkcN with its
	// mappings (closed above) but also every opener of /dev/ublkbN.
	// DEL_DEV_ASYNC (6.9+) removes the nodes at once and lets the last
	// opener free the number, so a lingering reader cannot hang Stop.
	if clean {
		nr := uint32(cmdDelDevAsync)
		if !d.ioctlEnc {
			nr = cmdDelDev
		}
		res, err := d.ctrl(nr, d.ioctlEnc, ctrlCmd{DevID: d.id, QueueID: 0xffff})
		if err == nil && nr == cmdDelDevAsync && (res == -int32(syscall.EOPNOTSUPP) || res == -int32(syscall.EINVAL)) {
			res, err = d.ctrl(cmdDelDev, d.ioctlEnc, ctrlCmd{DevID: d.id, QueueID: 0xffff})
		}
		if err := ctrlErr("DEL_DEV", res, err); err != nil {
			errs = append(errs, err)
		}
	}
	d.closeControl()
	return errors.Join(errs...)
}
