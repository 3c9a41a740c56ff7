package nbdnl

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The nbd ioctls (include/uapi/linux/nbd.h): the fallback for kernels
// without the netlink family. One socket only, and NBD_DO_IT blocks a
// thread for as long as the device is connected.
const (
	ioctlSetSock      = 0xab00
	ioctlSetBlksize   = 0xab01
	ioctlDoIt         = 0xab03
	ioctlClearSock    = 0xab04
	ioctlClearQue     = 0xab05
	ioctlSetSizeBlock = 0xab07
	ioctlDisconnect   = 0xab08
	ioctlSetTimeout   = 0xab09
	ioctlSetFlags     = 0xab0a
)

// IoctlDev is a /dev/nbdN attached with ioctls.
type IoctlDev struct {
	f    *os.File
	done chan struct{}
	err  error
	once sync.Once
}

// AttachIoctl attaches devPath (/dev/nbdN) to sock and starts serving it:
// NBD_DO_IT runs on a thread of its own until Disconnect.
func AttachIoctl(devPath string, sock *os.File, cfg Config) (*IoctlDev, error) {
	f, err := os.OpenFile(devPath, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: %w", err)
	}
	fd := int(f.Fd())
	ioctl := func(name string, req, arg uintptr) error {
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, arg); e != 0 {
			return fmt.Errorf("nbdnl: %s %s: %w", devPath, name, e)
		}
		return nil
	}
	bs := cfg.BlockSize
	if bs == 0 {
		bs = 512
	}
	steps := []struct {
		name     string
		req, arg uintptr
	}{
		{"NBD_CLEAR_SOCK", ioctlClearSock, 0},
		{"NBD_SET_BLKSIZE", ioctlSetBlksize, uintptr(bs)},
		{"NBD_SET_SIZE_BLOCKS", ioctlSetSizeBlock, uintptr(cfg.SizeBytes / bs)},
		{"NBD_SET_TIMEOUT", ioctlSetTimeout, uintptr(secs(cfg.Timeout))},
		{"NBD_SET_FLAGS", ioctlSetFlags, uintptr(cfg.ServerFlags)},
		{"NBD_SET_SOCK", ioctlSetSock, sock.Fd()},
	}
	for _, s := range steps {
		if err := ioctl(s.name, s.req, s.arg); err != nil {
			ioctl("NBD_CLEAR_SOCK", ioctlClearSock, 0)
			f.Close()
			return nil, err
		}
	}
	d := &IoctlDev{f: f, done: make(chan struct{})}
	go func() {
		runtime.LockOSThread() // NBD_DO_IT holds its thread
		defer runtime.UnlockOSThread()
		err := ioctl("NBD_DO_IT", ioctlDoIt, 0)
		ioctl("NBD_CLEAR_QUE", ioctlClearQue, 0)
		ioctl("NBD_CLEAR_SOCK", ioctlClearSock, 0)
		d.err = err
		close(d.done)
	}()
	return d, nil
}

// Disconnect asks the kernel to disconnect and waits up to timeout for
// NBD_DO_IT to return.
func (d *IoctlDev) Disconnect(timeout time.Duration) error {
	var err error
	d.once.Do(func() {
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, d.f.Fd(), ioctlDisconnect, 0); e != 0 {
			err = fmt.Errorf("nbdnl: NBD_DISCONNECT: %w", e)
		}
	})
	if err != nil {
		return err
	}
	select {
	case <-d.done:
	case <-time.After(timeout):
		return errors.New("nbdnl: the device did not disconnect in time")
	}
	return d.f.Close()
}

// Done is closed when the device stopped serving; Err then tells why.
func (d *IoctlDev) Done() <-chan struct{} { return d.done }

// Err is what NBD_DO_IT returned (nil for a clean disconnect).
func (d *IoctlDev) Err() error {
	<-d.done
	return d.err
}
