// Package ublk serves a Linux ublk block device (/dev/ublkbN) from a
// Backend, asynchronously: every queue has one goroutine locked to an OS
// thread that owns the queue's io_uring and talks to the kernel, while
// the IO itself is handed to the Backend, which may keep as many requests
// in flight as the queue depth allows and complete them from any
// goroutine.
//
// Data moves through per-tag buffers the kernel copies into (WRITE) and
// out of (READ); no UBLK_F_USER_COPY or zero copy, so any kernel with
// ublk (6.0+) works. A Backend that implements BufferProvider supplies
// that memory itself (registered transport memory), so the data needs no
// further copy. Control commands use the ioctl-encoded opcodes when the
// kernel reports UBLK_F_CMD_IOCTL_ENCODE, the legacy ones otherwise.
//
// A device made with Options.Recovery outlives the process serving it
// (UBLK_F_USER_RECOVERY with UBLK_F_USER_RECOVERY_REISSUE): when that
// process exits, crashes or calls Detach, the kernel quiesces the device,
// holds its IO and requeues what the server had not completed; the next
// server takes it over with Recover and the held IO runs there. Nothing
// fails in between, however long it takes.
//
// Lock order (outermost first; a sync.Once counts, as Do holds it while
// its function runs):
//
//	Device.stopOnce (Stop, Detach: teardown)
//	  Device.ctrlMu (control commands)
//	  queue.mu (stopping the queues)
//
// Device.ctrlMu and queue.mu are never held together, and nothing else is
// taken under either: ctrlMu is held for one control command on the
// control ring, queue.mu for a queue's completions and its eventfd.
package ublk

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/frontend/ublk/internal/uring"
)

// ErrNoUblk means the kernel offers no ublk: /dev/ublk-control is missing
// (ublk_drv not loaded or not built) or io_uring is unavailable.
var ErrNoUblk = errors.New("ublk: kernel has no ublk support")

// ErrNoDevice means there is no ublk device with the number asked for.
var ErrNoDevice = errors.New("ublk: no such device")

// ErrNotRecoverable means Recover cannot take the device over: it was made
// without recovery, it is stopped, another live process serves it, or its
// cookie says it serves something else.
var ErrNotRecoverable = errors.New("ublk: device cannot be recovered")

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

// BufferOffset is where Data starts in its queue's buffer (the memory a
// BufferProvider gave): Tag × MaxIOBytes.
func (r *Request) BufferOffset() int { return int(r.tag) * r.q.maxIO }

// Backend performs IO. Submit must not block for long (it runs on the
// queue's thread); done may be called from any goroutine, exactly once,
// also from within Submit. A nil error completes the whole request; an
// error is reported to the kernel as -errno (a syscall.Errno found with
// errors.As, else EIO).
type Backend interface {
	Submit(r *Request, done func(*Request, error))
}

// Batcher is a Backend told where each batch of requests a queue submits
// ends: after the requests of one pass over the queue's ring, before the
// queue commits their completions and waits for more. A backend may hold
// what a batch submits (a plug) and send it there. BatchEnd runs on the
// queue's goroutine, which also called Submit for the batch.
type Batcher interface {
	Backend
	BatchEnd(q int)
}

// BufferProvider is implemented by a Backend that supplies the tag
// buffers: QueueBuffers returns n bytes (the queue's depth × MaxIOBytes,
// page aligned) for queue q, which the kernel copies request data into
// and out of; each Request's Data lies in it at BufferOffset. The memory
// is handed back with ReleaseQueueBuffers once no request uses it. A
// Backend without it gets anonymous memory.
type BufferProvider interface {
	QueueBuffers(q, n int) ([]byte, error)
	ReleaseQueueBuffers(q int, b []byte)
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
	// Recovery makes the device outlive its server (see the package
	// doc), where the kernel offers UBLK_F_USER_RECOVERY and
	// UBLK_F_USER_RECOVERY_REISSUE; Device.Recoverable tells.
	Recovery bool
	// Cookie is kept with the device in the kernel (ublksrv_flags, which
	// the driver stores and never reads): Recover takes over only a
	// device whose cookie matches, so a device is never served with
	// another backend's data.
	Cookie uint64
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

// Device is a running ublk device. It is safe for concurrent use: its
// accessors read what New or Recover set, control commands are serialized
// (ctrlMu), and Stop and Detach tear down once between them.
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

// DevState is a device's state in the kernel (UBLK_S_DEV_*).
type DevState uint16

const (
	StateDead     DevState = devStateDead     // not started, or stopped
	StateLive     DevState = devStateLive     // served
	StateQuiesced DevState = devStateQuiesced // its server is gone; IO held for recovery
	StateFailIO   DevState = devStateFailIO   // its server is gone; IO fails until recovery
)

func (s DevState) String() string {
	switch s {
	case StateDead:
		return "dead"
	case StateLive:
		return "live"
	case StateQuiesced:
		return "quiesced"
	case StateFailIO:
		return "fail-io"
	}
	return fmt.Sprintf("state%d", uint16(s))
}

// Info is what the kernel reports of a device (GET_DEV_INFO).
type Info struct {
	ID                             int
	State                          DevState
	Queues, QueueDepth, MaxIOBytes int
	Flags                          uint64 // UBLK_F_*
	Cookie                         uint64
	ServerPID                      int
}

func infoOf(d devInfo) Info {
	return Info{ID: int(d.DevID), State: DevState(d.State), Queues: int(d.NrHWQueues), QueueDepth: int(d.QueueDepth),
		MaxIOBytes: int(d.MaxIOBufBytes), Flags: d.Flags, Cookie: d.SrvFlags, ServerPID: int(d.SrvPID)}
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
	// Recovery needs both flags: USER_RECOVERY alone would fail the IO
	// the dead server had taken instead of handing it to the next one.
	const recovery = FlagUserRecovery | FlagUserRecoveryReiss
	if opts.Recovery && d.features&recovery == recovery {
		flags |= recovery
	}
	info := devInfo{
		NrHWQueues:    uint16(opts.Queues),
		QueueDepth:    uint16(opts.QueueDepth),
		MaxIOBufBytes: uint32(opts.MaxIOBytes),
		DevID:         ^uint32(0),
		SrvPID:        int32(os.Getpid()),
		Flags:         flags,
		SrvFlags:      opts.Cookie,
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
		d.teardown(false, false)
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
	if err := d.startQueues(); err != nil {
		return err
	}
	// START_DEV waits until every tag has been fetched, then adds the
	// disk, which reads the partition table through the queues.
	return d.devCmd("START_DEV", cmdStartDev, ctrlCmd{Data: uint64(os.Getpid())})
}

// startQueues opens /dev/ublkcN and starts a goroutine per queue, each of
// which fetches every tag of its queue before startQueues returns.
func (d *Device) startQueues() error {
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
	return errors.Join(errs...)
}

// recoverWait bounds how long Recover waits for the previous server to
// be gone (its queues cancelled, /dev/ublkcN released, the device
// quiesced).
var recoverWait = 15 * time.Second

// Recover takes over device id, left quiesced by a server that exited:
// START_USER_RECOVERY, new queues fetching every tag, END_USER_RECOVERY;
// the IO the kernel held then runs on be. The device keeps what it was
// made with (queues, depth, request size, parameters); of opts only the
// Cookie, which must match the device's, counts. An error wraps
// ErrNoDevice or ErrNotRecoverable when the device cannot be had; the
// device is then left as it was.
func Recover(id int, opts Options, be Backend) (*Device, error) {
	d := &Device{be: be, ctrlFd: -1, id: uint32(id)}
	if err := d.openControl(); err != nil {
		return nil, err
	}
	fail := func(err error) (*Device, error) {
		d.closeControl()
		return nil, err
	}
	info, err := d.getInfo()
	if err != nil {
		return fail(err)
	}
	name := fmt.Sprintf("/dev/ublkb%d", id)
	switch {
	case info.Flags&FlagUserRecovery == 0:
		return fail(fmt.Errorf("%w: %s was made without user recovery", ErrNotRecoverable, name))
	case info.SrvFlags != opts.Cookie:
		return fail(fmt.Errorf("%w: %s serves something else (cookie %#x, want %#x)", ErrNotRecoverable, name, info.SrvFlags, opts.Cookie))
	case info.State == devStateDead:
		return fail(fmt.Errorf("%w: %s is stopped", ErrNotRecoverable, name))
	case info.State == devStateLive && int(info.SrvPID) != os.Getpid() && processAlive(int(info.SrvPID)):
		return fail(fmt.Errorf("%w: %s is served by running process %d", ErrNotRecoverable, name, info.SrvPID))
	}
	basic, err := d.getParams()
	if err != nil {
		return fail(err)
	}
	d.info = info
	d.opts = opts
	d.opts.Queues, d.opts.QueueDepth, d.opts.MaxIOBytes = int(info.NrHWQueues), int(info.QueueDepth), int(info.MaxIOBufBytes)
	d.opts.Size = int64(basic.DevSectors) << 9
	d.opts.LogicalBlockSize, d.opts.PhysicalBlockSize = 1<<basic.LogicalBSShift, 1<<basic.PhysicalBSShift
	d.opts.ReadOnly = basic.Attrs&attrReadOnly != 0
	// START_USER_RECOVERY answers EBUSY until the old server's queues are
	// cancelled and its /dev/ublkcN is closed: its exit may still be
	// under way.
	deadline := time.Now().Add(recoverWait)
	for {
		res, err := d.ctrl(cmdStartUserRecov, d.ioctlEnc, ctrlCmd{DevID: d.id, QueueID: 0xffff})
		if err == nil && res == -int32(syscall.EBUSY) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
			continue
		}
		if err == nil && res == -int32(syscall.EBUSY) {
			st := info.State
			if i, err := d.getInfo(); err == nil {
				st = i.State
			}
			return fail(fmt.Errorf("%w: %s is still %v after %v (its server has not let go)",
				ErrNotRecoverable, name, DevState(st), recoverWait))
		}
		if err := ctrlErr("START_USER_RECOVERY", res, err); err != nil {
			return fail(err)
		}
		break
	}
	// From here the device waits for a server: if ours cannot start, it
	// stays quiesced for the next attempt.
	if err := d.startQueues(); err != nil {
		d.teardown(false, true)
		return nil, err
	}
	if err := d.devCmd("END_USER_RECOVERY", cmdEndUserRecov, ctrlCmd{Data: uint64(os.Getpid())}); err != nil {
		d.teardown(false, true)
		return nil, err
	}
	d.info.State = devStateLive
	d.info.SrvPID = int32(os.Getpid())
	return d, nil
}

// processAlive reports whether pid is a running (not exited, not zombie)
// process.
func processAlive(pid int) bool {
	if pid <= 0 || unix.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) S …: the state follows the last ')'.
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || (b[i+2] != 'Z' && b[i+2] != 'X')
}

// Path is the block device, /dev/ublkbN.
func (d *Device) Path() string { return fmt.Sprintf("/dev/ublkb%d", d.id) }

// ID is the device number N.
func (d *Device) ID() int { return int(d.id) }

// Size is the device's size in bytes.
func (d *Device) Size() int64 { return d.opts.Size }

// Features are the kernel's UBLK_F_* flags (from GET_FEATURES).
func (d *Device) Features() uint64 { return d.features }

// Flags are the UBLK_F_* flags the device was created with.
func (d *Device) Flags() uint64 { return d.info.Flags }

// Recoverable reports whether the device outlives its server: it was made
// with user recovery (and reissue).
func (d *Device) Recoverable() bool {
	return d.info.Flags&(FlagUserRecovery|FlagUserRecoveryReiss) == FlagUserRecovery|FlagUserRecoveryReiss
}

// Queues and QueueDepth are what the kernel granted.
func (d *Device) Queues() int     { return int(d.info.NrHWQueues) }
func (d *Device) QueueDepth() int { return int(d.info.QueueDepth) }

// Stop takes the device down: STOP_DEV (the kernel removes the disk,
// waits for the requests in flight and aborts the fetches), waits for the
// queues to finish what the backend still holds, then DEL_DEV_ASYNC (or
// DEL_DEV on kernels before 6.9, which waits for every opener of
// /dev/ublkbN to close it). Stop and Detach are each done once; the
// first of them decides.
func (d *Device) Stop() error {
	d.stopOnce.Do(func() { d.stopErr = d.teardown(true, false) })
	return d.stopErr
}

// Detach stops serving but leaves a Recoverable device in the kernel for
// the next server (see Recover): what the backend holds is completed,
// requests not yet handed to it stay with the kernel, which requeues
// them, and /dev/ublkbN keeps its openers and mounts, their IO waiting.
// A device that is not Recoverable is stopped as by Stop.
func (d *Device) Detach() error {
	d.stopOnce.Do(func() { d.stopErr = d.teardown(d.started(), d.Recoverable()) })
	return d.stopErr
}

func (d *Device) started() bool { return len(d.queues) > 0 }

// queueExitTimeout bounds how long Stop waits for the queues.
var queueExitTimeout = 30 * time.Second

// teardown stops the queues and releases the device: STOP_DEV first if it
// was started, DEL_DEV last unless detach leaves it to a later server.
func (d *Device) teardown(started, detach bool) error {
	var errs []error
	if started && !detach {
		if err := d.devCmd("STOP_DEV", cmdStopDev, ctrlCmd{}); err != nil {
			errs = append(errs, err)
		}
	}
	for _, q := range d.queues {
		q.stop(detach)
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
	if clean && !detach {
		if err := d.delDev(); err != nil {
			errs = append(errs, err)
		}
	}
	d.closeControl()
	return errors.Join(errs...)
}

// delDev deletes the device. DEL_DEV waits until it is released:
// /dev/ublkcN with its mappings but also every opener of /dev/ublkbN.
// DEL_DEV_ASYNC (6.9+) removes the nodes at once and lets the last opener
// free the number, so a lingering reader cannot hang us.
func (d *Device) delDev() error {
	nr := uint32(cmdDelDevAsync)
	if !d.ioctlEnc {
		nr = cmdDelDev
	}
	res, err := d.ctrl(nr, d.ioctlEnc, ctrlCmd{DevID: d.id, QueueID: 0xffff})
	if err == nil && nr == cmdDelDevAsync && (res == -int32(syscall.EOPNOTSUPP) || res == -int32(syscall.EINVAL)) {
		res, err = d.ctrl(cmdDelDev, d.ioctlEnc, ctrlCmd{DevID: d.id, QueueID: 0xffff})
	}
	return ctrlErr("DEL_DEV", res, err)
}
