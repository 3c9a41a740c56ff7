// IO: the range check, reads and writes (FUA, write-through), flush,
// discard, write-zeroes and secure erase, and the ioctls they use.

package blockdev

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// check is an IO's range check: one atomic load, of where IO ends.
func (b *Backend) check(off, n int64, write bool) error {
	if end := b.end.Load(); off < 0 || n < 0 || off > end || n > end-off {
		return b.outside(off, n, end, write)
	}
	if write && b.ro {
		return fmt.Errorf("blockdev: %s is read-only: %w", b.path, syscall.EROFS)
	}
	return nil
}

// outside is the error of IO of n bytes at off past end.
func (b *Backend) outside(off, n, end int64, write bool) error {
	size := b.size.Load()
	switch {
	case off >= 0 && n >= 0 && off <= size && n <= size-off:
		return fmt.Errorf("%w: %d bytes at %d, where %s has %d of the %d bytes served", ErrPastFileEnd, n, off, b.path, end, size)
	case write:
		return fmt.Errorf("%w: %d bytes at %d of %d: %w", ErrOutOfRange, n, off, size, syscall.ENOSPC)
	}
	return fmt.Errorf("%w: %d bytes at %d of %d: %w", ErrOutOfRange, n, off, size, syscall.EINVAL)
}

// ReadAt reads exactly len(p) bytes at off.
func (b *Backend) ReadAt(p []byte, off int64) error {
	if err := b.check(off, int64(len(p)), false); err != nil {
		return err
	}
	n, err := b.f.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		// The file shrank under us: never hand back a short read.
		return fmt.Errorf("blockdev: short read of %d bytes at %d: %w", n, off, syscall.EIO)
	}
	return err
}

// WriteAt writes all of p at off; with fua, or on a write-through
// backend, the data is durable when it returns (an O_DSYNC write).
func (b *Backend) WriteAt(p []byte, off int64, fua bool) error {
	defer b.endWrite(b.beginWrite())
	if err := b.check(off, int64(len(p)), true); err != nil {
		return err
	}
	_, err := b.writer(fua).WriteAt(p, off)
	if err == nil {
		b.allocated(off, int64(len(p)))
	}
	return err
}

// writer is the descriptor a write goes through.
func (b *Backend) writer(fua bool) *os.File {
	if fua || b.wt {
		return b.fsync
	}
	return b.f
}

// WriteThrough reports whether every write is durable when it completes.
func (b *Backend) WriteThrough() bool { return b.wt }

// settle makes a discard or write-zeroes that succeeded durable on a
// write-through backend.
func (b *Backend) settle(err error) error {
	if err != nil || !b.wt {
		return err
	}
	return unix.Fdatasync(int(b.f.Fd()))
}

// Flush makes every write that completed before it durable, and
// stamps the file's mtime for them.
func (b *Backend) Flush() error {
	if b.ro {
		return nil
	}
	b.stampMtime(false)
	return unix.Fdatasync(int(b.f.Fd()))
}

// Discard deallocates n bytes at off; reads of them return zeros after.
func (b *Backend) Discard(off, n int64) error {
	defer b.endWrite(b.beginWrite())
	if err := b.check(off, n, true); err != nil || n == 0 {
		return err
	}
	if !b.caps.Discard {
		return ErrNotSupported
	}
	b.mayPunch(off, n)
	if b.kind == KindBlockDevice {
		return b.settle(ioctlRange(b.f, unix.BLKDISCARD, off, n))
	}
	return b.settle(unix.Fallocate(int(b.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n))
}

// WriteZeroes makes n bytes at off read as zeros. With noUnmap the space
// stays allocated (FALLOC_FL_ZERO_RANGE, or zeros written); without it the
// range may be deallocated (a hole punched) when that is supported.
func (b *Backend) WriteZeroes(off, n int64, noUnmap bool) error {
	defer b.endWrite(b.beginWrite())
	if err := b.check(off, n, true); err != nil || n == 0 {
		return err
	}
	if !noUnmap {
		b.mayPunch(off, n)
	}
	return b.settle(b.writeZeroes(off, n, noUnmap))
}

func (b *Backend) writeZeroes(off, n int64, noUnmap bool) error {
	fd := int(b.f.Fd())
	if !noUnmap && b.caps.Discard {
		// A hole reads as zeros; on a block device this is a write
		// zeroes that may unmap, without falling back to writing.
		if unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n) == nil {
			return nil
		}
	}
	if b.caps.ZeroRange {
		if b.kind == KindBlockDevice {
			return ioctlRange(b.f, unix.BLKZEROOUT, off, n)
		}
		if !b.noZeroRange.Load() {
			err := unix.Fallocate(fd, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, n)
			if err == nil {
				return nil
			}
			if errors.Is(err, unix.EOPNOTSUPP) {
				b.noZeroRange.Store(true) // this file system cannot
			}
		}
	}
	return b.writeZeros(off, n)
}

// zeroBuf is the source of emulated write-zeroes; it is never written.
var zeroBuf = make([]byte, 1<<20)

func (b *Backend) writeZeros(off, n int64) error {
	for n > 0 {
		c := min(n, int64(len(zeroBuf)))
		if _, err := b.f.WriteAt(zeroBuf[:c], off); err != nil {
			return err
		}
		off += c
		n -= c
	}
	return nil
}

// SecureErase is BLKSECDISCARD on a block device; files cannot.
func (b *Backend) SecureErase(off, n int64) error {
	defer b.endWrite(b.beginWrite())
	if err := b.check(off, n, true); err != nil || n == 0 {
		return err
	}
	if b.kind != KindBlockDevice {
		return ErrNotSupported
	}
	return b.settle(ioctlRange(b.f, unix.BLKSECDISCARD, off, n))
}

// ioctlUint64 issues an ioctl that returns a u64 (BLKGETSIZE64).
func ioctlUint64(f *os.File, req uint) (uint64, error) {
	var v uint64
	_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(req), uintptr(unsafe.Pointer(&v)))
	runtime.KeepAlive(f)
	if e != 0 {
		return 0, e
	}
	return v, nil
}

// ioctlRange issues a block ioctl that takes a {start, length} range in
// bytes (BLKDISCARD, BLKZEROOUT, BLKSECDISCARD).
func ioctlRange(f *os.File, req uint, off, n int64) error {
	r := [2]uint64{uint64(off), uint64(n)}
	_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(req), uintptr(unsafe.Pointer(&r)))
	runtime.KeepAlive(&r)
	runtime.KeepAlive(f)
	if e != 0 {
		return e
	}
	return nil
}
