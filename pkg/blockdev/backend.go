package blockdev

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// Kind is what a backend stores its data in.
type Kind int

const (
	KindFile Kind = iota
	KindBlockDevice
)

func (k Kind) String() string {
	if k == KindBlockDevice {
		return "blockdev"
	}
	return "file"
}

// Options tune how a backend is opened.
type Options struct {
	// ReadOnly opens the backend for reading only.
	ReadOnly bool
	// Direct bypasses the page cache (O_DIRECT): IO must then be aligned
	// to the logical block size, which the RNBD server enforces anyway.
	Direct bool
	// LogicalBlockSize and PhysicalBlockSize apply to files (defaults 512
	// and 4096; with Direct, the logical size defaults to the alignment
	// O_DIRECT needs on the file's storage, 4096 on a 4Kn disk); a block
	// device reports its own.
	LogicalBlockSize  int
	PhysicalBlockSize int
	// WriteThrough makes every write durable when it completes (O_DSYNC),
	// and every discard and write-zeroes (fdatasync after it): the
	// backend then has no volatile write cache to report, and clients
	// need not flush.
	WriteThrough bool
}

// Caps are what a backend can do, as OPEN_RSP reports them.
type Caps struct {
	// Discard deallocates; MaxDiscardBytes is the largest single request.
	Discard            bool
	MaxDiscardBytes    uint64
	DiscardGranularity uint32
	DiscardAlignment   uint32
	// WriteZeroes is always available (emulated by writing zeros where
	// the system cannot); ZeroRange tells whether it avoids writing (on
	// a file: whether it tries FALLOC_FL_ZERO_RANGE first).
	MaxWriteZeroesBytes uint64
	ZeroRange           bool
	// SecureErase is BLKSECDISCARD on a device that supports it.
	SecureErase bool
	// WriteCache: a completed write may still be lost in a crash until
	// a flush (the page cache, a file's block allocation, the device's
	// own cache). False only for write-through backends and block
	// devices without a cache opened with O_DIRECT.
	WriteCache bool
	// FUA: a single write can be made durable (O_DSYNC); reported along
	// with WriteCache, as the kernel reads it only then.
	FUA bool
	// MaxIOBytes and MaxSegments bound a single read or write.
	MaxIOBytes  uint32
	MaxSegments uint16
}

// Backend is an exported file or block device. All methods are safe for
// concurrent use; IO to overlapping ranges is not ordered among itself.
type Backend struct {
	path  string
	kind  Kind
	f     *os.File // for reads, writes, fallocate and ioctls
	fsync *os.File // the same file opened O_DSYNC: FUA writes
	wt    bool     // write-through: every write goes to fsync
	// size is the size served, what OPEN_RSP tells clients. end is
	// where IO stops: size, or less while a file is shorter than that
	// (cut behind the server's back: PollSize), so that IO past the
	// file's end fails and a write there does not grow the file back.
	// end <= size at every instant; both change under sizeMu.
	size atomic.Int64
	end  atomic.Int64
	lbs  int
	pbs  int
	ro   bool
	caps Caps
	dev  uint64 // st_dev and st_ino (st_rdev for a device): identity
	ino  uint64
	fs   uint32 // a file's file system (statfs f_type), 0 if unknown
	nw   nowaitState
	mp   mapState
	// noZeroRange: FALLOC_FL_ZERO_RANGE failed with EOPNOTSUPP on this
	// file; write-zeroes writes zeros.
	noZeroRange atomic.Bool

	// sizeMu orders Refresh and PollSize with Cap and Uncap: a size
	// poll must not serve the old size of a file being cut. capOwner
	// (under sizeMu) is the cut under way (0: none), capped the most it
	// serves; sizeSeq counts the caps and uncaps, so that a Refresh
	// whose fstat one overtook reads again. want (under sizeMu) is the
	// size served but for a cap.
	sizeMu   sync.Mutex
	capOwner uint64
	capped   int64
	// +checklocks:sizeMu
	sizeSeq uint64
	want    int64
	// capMu serializes the caps. The writes in flight are counted by
	// the generation (wgen's low bit) they began in, so that a cap
	// waits for the writes that began before it, not for those after.
	capMu sync.Mutex
	wgen  atomic.Uint32
	wcnt  [2]atomic.Int64

	closeOnce sync.Once
}

// ErrOutOfRange is returned for IO past the end of the backend; it wraps
// EINVAL for reads and ENOSPC for writes, as NBD reports them.
var ErrOutOfRange = errors.New("blockdev: IO past the end of the device")

// ErrPastFileEnd is returned, wrapping EIO, for IO inside the size served
// but past the end of a file that shrank behind the server's back
// (PollSize).
var ErrPastFileEnd = fmt.Errorf("blockdev: IO past the end of a file that shrank behind the server: %w", syscall.EIO)

// ErrNotSupported is returned for an operation the backend cannot do.
var ErrNotSupported = fmt.Errorf("blockdev: operation not supported: %w", syscall.EOPNOTSUPP)

// Path is the path the backend was opened from.
func (b *Backend) Path() string { return b.path }

// Kind is file or block device.
func (b *Backend) Kind() Kind { return b.kind }

// LogicalBlockSize and PhysicalBlockSize are in bytes.
func (b *Backend) LogicalBlockSize() int  { return b.lbs }
func (b *Backend) PhysicalBlockSize() int { return b.pbs }

// ReadOnly reports whether the backend was opened read-only.
func (b *Backend) ReadOnly() bool { return b.ro }

// Caps returns what the backend can do.
func (b *Backend) Caps() Caps { return b.caps }

// ID identifies the storage: device and inode of a file, the device
// number of a block device. Two opens of one backend have the same ID.
func (b *Backend) ID() string {
	if b.kind == KindBlockDevice {
		return fmt.Sprintf("blk:%d:%d", unix.Major(b.dev), unix.Minor(b.dev))
	}
	return fmt.Sprintf("file:%d:%d", b.dev, b.ino)
}

// FileID is the ID (Backend.ID) a backend of the regular file fi has;
// false if fi is not a regular file's stat(2).
func FileID(fi os.FileInfo) (string, bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || !fi.Mode().IsRegular() {
		return "", false
	}
	return fmt.Sprintf("file:%d:%d", st.Dev, st.Ino), true
}

// Close closes the backend.
func (b *Backend) Close() error {
	var err error
	b.closeOnce.Do(func() {
		b.stampMtime(true)
		b.unmap()
		err = b.f.Close()
		if b.fsync != nil {
			if e := b.fsync.Close(); err == nil {
				err = e
			}
		}
	})
	return err
}
