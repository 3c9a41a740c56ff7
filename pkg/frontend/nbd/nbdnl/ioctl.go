package nbdnl

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The nbd ioctls (include/uapi/linux/nbd.h, _IO(0xab, n)): the fallback
// for kernels without the netlink family. They take one socket only, and
// NBD_DO_IT blocks its thread for as long as the device is connected.
const (
	ioctlSetSock       = 0xab00 // NBD_SET_SOCK
	ioctlSetBlksize    = 0xab01 // NBD_SET_BLKSIZE
	ioctlSetSize       = 0xab02 // NBD_SET_SIZE, bytes
	ioctlDoIt          = 0xab03 // NBD_DO_IT
	ioctlClearSock     = 0xab04 // NBD_CLEAR_SOCK
	ioctlClearQue      = 0xab05 // NBD_CLEAR_QUE (a no-op on current kernels)
	ioctlSetSizeBlocks = 0xab07 // NBD_SET_SIZE_BLOCKS
	ioctlDisconnect    = 0xab08 // NBD_DISCONNECT
	ioctlSetTimeout    = 0xab09 // NBD_SET_TIMEOUT, seconds
	ioctlSetFlags      = 0xab0a // NBD_SET_FLAGS
)

// IoctlDev is a /dev/nbdN attached with the ioctls. A goroutine locked
// to its own thread sits in NBD_DO_IT while the device is connected.
type IoctlDev struct {
	path string
	done chan struct{}
	err  error // NBD_DO_IT's result; written before done is closed

	mu sync.Mutex
	fd int // the device's descriptor; -1 once closed
	// +checklocks:mu
	disconnecting bool
}

// ioctlStep is one ioctl of the setup.
type ioctlStep struct {
	name     string
	req, arg uintptr
}

// ioctl calls request req with argument arg on fd; the error wraps the
// errno.
func ioctl(fd int, name string, req, arg uintptr) error {
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, arg); e != 0 {
		return fmt.Errorf("%s: %w", name, e)
	}
	return nil
}

// AttachIoctl attaches devPath (/dev/nbdN) to sock, a socket already in
// the NBD transmission phase, and starts serving it: size bytes of
// blockSize (0: the kernel's default) with the NBD transmission flags
// (Flag*) and per-request timeout (0: none set, whole seconds otherwise).
// NBD_DO_IT then runs on a thread of its own, with asynchronous signals
// blocked (a signal would make the kernel drop the device), until
// Disconnect or until the server hangs up; Wait returns its result.
//
// The kernel takes its own reference to sock; the caller may close it.
// A device that is already connected (it has /sys/block/nbdN/pid) is
// refused with EBUSY, because the size ioctls would resize it live.
func AttachIoctl(devPath string, sock *os.File, size, blockSize uint64, flags uint64, timeout time.Duration) (*IoctlDev, error) {
	if sock == nil {
		return nil, fmt.Errorf("nbdnl: %s: no socket: %w", devPath, unix.EBADF)
	}
	steps, err := ioctlSteps(size, blockSize, flags, timeout)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: %s: %w", devPath, err)
	}
	if connected(devPath) {
		return nil, fmt.Errorf("nbdnl: %s is already connected: %w", devPath, unix.EBUSY)
	}
	fd, err := unix.Open(devPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: open %s: %w", devPath, err)
	}
	steps = append(steps, ioctlStep{"NBD_SET_SOCK", ioctlSetSock, sock.Fd()})
	d := &IoctlDev{path: devPath, fd: fd, done: make(chan struct{})}
	ready := make(chan error, 1)
	go d.serve(steps, sock, ready)
	if err := <-ready; err != nil {
		return nil, err
	}
	return d, nil
}

// ioctlSteps lays out the setup ioctls before NBD_SET_SOCK.
func ioctlSteps(size, blockSize, flags uint64, timeout time.Duration) ([]ioctlStep, error) {
	const maxArg = uint64(^uintptr(0))
	var steps []ioctlStep
	if blockSize != 0 {
		if blockSize < 512 || blockSize&(blockSize-1) != 0 || blockSize > math.MaxUint32 {
			return nil, fmt.Errorf("block size %d is not a power of two from 512: %w", blockSize, unix.EINVAL)
		}
		steps = append(steps, ioctlStep{"NBD_SET_BLKSIZE", ioctlSetBlksize, uintptr(blockSize)})
	}
	switch {
	case blockSize != 0 && size%blockSize == 0 && size/blockSize <= maxArg:
		// In blocks, as nbd-client does: this fits an unsigned long on
		// 32-bit machines too.
		steps = append(steps, ioctlStep{"NBD_SET_SIZE_BLOCKS", ioctlSetSizeBlocks, uintptr(size / blockSize)})
	case size <= maxArg:
		steps = append(steps, ioctlStep{"NBD_SET_SIZE", ioctlSetSize, uintptr(size)})
	default:
		return nil, fmt.Errorf("size %d does not fit the ioctl: %w", size, unix.EOVERFLOW)
	}
	if flags > maxArg {
		return nil, fmt.Errorf("flags %#x do not fit the ioctl: %w", flags, unix.EOVERFLOW)
	}
	steps = append(steps, ioctlStep{"NBD_SET_FLAGS", ioctlSetFlags, uintptr(flags)})
	if timeout > 0 {
		steps = append(steps, ioctlStep{"NBD_SET_TIMEOUT", ioctlSetTimeout, uintptr(secs(timeout))})
	}
	return steps, nil
}

// connected reports whether the kernel shows devPath as connected: the
// pid attribute exists from start to disconnect, whichever interface
// attached the device.
func connected(devPath string) bool {
	p, err := filepath.EvalSymlinks(devPath)
	if err != nil {
		return false
	}
	_, err = os.Stat(filepath.Join("/sys/block", filepath.Base(p), "pid"))
	return err == nil
}

// serve runs the setup and then NBD_DO_IT, all on one locked thread (the
// kernel ties the ioctl setup to the task doing it), reporting the
// setup's result on ready.
func (d *IoctlDev) serve(steps []ioctlStep, sock *os.File, ready chan<- error) {
	runtime.LockOSThread()
	var old unix.Sigset_t
	block := asyncSignals()
	if err := unix.PthreadSigmask(unix.SIG_BLOCK, &block, &old); err != nil {
		runtime.UnlockOSThread()
		d.close()
		ready <- fmt.Errorf("nbdnl: %s: block signals: %w", d.path, err)
		close(d.done)
		return
	}
	defer func() {
		// Hand the thread back to the scheduler only with its signal
		// mask restored; else it ends with this goroutine.
		if unix.PthreadSigmask(unix.SIG_SETMASK, &old, nil) == nil {
			runtime.UnlockOSThread()
		}
	}()

	for _, s := range steps {
		if err := ioctl(d.fd, s.name, s.req, s.arg); err != nil {
			runtime.KeepAlive(sock)
			d.close() // the last close frees the config, sizes and all
			ready <- fmt.Errorf("nbdnl: %s: %w", d.path, err)
			close(d.done)
			return
		}
	}
	runtime.KeepAlive(sock)
	ready <- nil

	err := ioctl(d.fd, "NBD_DO_IT", ioctlDoIt, 0)
	d.mu.Lock()
	// Drop the socket and requests left, as nbd-client does; then the
	// device is free for the next attach.
	ioctl(d.fd, "NBD_CLEAR_QUE", ioctlClearQue, 0)
	ioctl(d.fd, "NBD_CLEAR_SOCK", ioctlClearSock, 0)
	d.mu.Unlock()
	d.close()
	if err != nil {
		d.err = fmt.Errorf("nbdnl: %s: %w", d.path, err)
	}
	close(d.done)
}

// close closes the device's descriptor once.
func (d *IoctlDev) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.fd >= 0 {
		unix.Close(d.fd)
		d.fd = -1
	}
}

// asyncSignals is every signal except the synchronous ones, which the Go
// runtime needs (nil dereferences arrive as SIGSEGV) and which the
// kernel would otherwise turn into a kill.
func asyncSignals() unix.Sigset_t {
	var set unix.Sigset_t
	for i := range set.Val {
		set.Val[i] = ^set.Val[i]
	}
	bits := uint(unsafe.Sizeof(set.Val[0]) * 8)
	for _, s := range []unix.Signal{unix.SIGSEGV, unix.SIGBUS, unix.SIGFPE, unix.SIGILL, unix.SIGTRAP, unix.SIGSYS} {
		n := uint(s) - 1
		set.Val[n/bits] &^= 1 << (n % bits)
	}
	return set
}

// sigsetHas reports whether sig is in set.
func sigsetHas(set *unix.Sigset_t, sig unix.Signal) bool {
	bits := uint(unsafe.Sizeof(set.Val[0]) * 8)
	n := uint(sig) - 1
	return set.Val[n/bits]&(1<<(n%bits)) != 0
}

// Path is the device, as given to AttachIoctl.
func (d *IoctlDev) Path() string { return d.path }

// Disconnect asks the kernel to disconnect the device (NBD_DISCONNECT):
// it sends NBD_CMD_DISC to the server, and NBD_DO_IT returns once the
// server hung up. It does not wait for that: Wait does. Calling it again,
// or after the device stopped, does nothing.
func (d *IoctlDev) Disconnect() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.fd < 0 || d.disconnecting {
		return nil
	}
	if err := ioctl(d.fd, "NBD_DISCONNECT", ioctlDisconnect, 0); err != nil {
		return fmt.Errorf("nbdnl: %s: %w", d.path, err)
	}
	d.disconnecting = true
	return nil
}

// Wait blocks until the device stopped serving and returns what
// NBD_DO_IT returned: nil after a Disconnect, else the errno of the
// failure (a dead socket, a timeout: ETIMEDOUT).
func (d *IoctlDev) Wait() error {
	<-d.done
	return d.err
}

// Done is closed when the device stopped serving.
func (d *IoctlDev) Done() <-chan struct{} { return d.done }
