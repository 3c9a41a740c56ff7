package rawio

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The file calls below pass the offset as one register: 64-bit Linux.
const is64 = unsafe.Sizeof(uintptr(0)) == 8

// Pread reads into p at off from a file whose reads cannot sleep (tmpfs,
// ramfs, a RAM disk). It may return less than len(p), as pread does.
func Pread(fd int, p []byte, off int64) (int, error) {
	if !is64 {
		return unix.Pread(fd, p, off)
	}
	return positional(syscall.SYS_PREAD64, fd, p, off)
}

// Pwrite writes p at off to a file whose writes cannot sleep. It may
// write less than len(p), as pwrite does.
func Pwrite(fd int, p []byte, off int64) (int, error) {
	if !is64 {
		return unix.Pwrite(fd, p, off)
	}
	return positional(syscall.SYS_PWRITE64, fd, p, off)
}

// positional is pread64 or pwrite64 as a raw system call.
func positional(trap uintptr, fd int, p []byte, off int64) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for {
		n, _, e := syscall.RawSyscall6(trap, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)), uintptr(off), 0, 0)
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			return 0, e
		}
		return int(n), nil
	}
}

// PreadNowait is preadv2(RWF_NOWAIT): it reads into p at off what the page
// cache holds, or fails with EAGAIN where the read would have to wait.
func PreadNowait(fd int, p []byte, off int64) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if !is64 {
		return unix.Preadv2(fd, [][]byte{p}, off, unix.RWF_NOWAIT)
	}
	iov := syscall.Iovec{Base: &p[0]}
	iov.SetLen(len(p))
	for {
		n, _, e := syscall.RawSyscall6(unix.SYS_PREADV2, uintptr(fd), uintptr(unsafe.Pointer(&iov)), 1, uintptr(off), 0, unix.RWF_NOWAIT)
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			return 0, e
		}
		return int(n), nil
	}
}
