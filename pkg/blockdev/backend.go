package blockdev

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

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
	sizeSeq  uint64
	want     int64
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

// maxZeroBytes bounds one discard or write-zeroes request on a file.
const maxZeroBytes = 1 << 30

// Open opens path, a regular file or a block device.
func Open(path string, opts Options) (*Backend, error) {
	return openWith(path, opts, func(flags int) (*os.File, error) {
		return os.OpenFile(path, flags, 0)
	})
}

// ErrEscapes is returned by OpenBeneath for a name that leads out of its
// directory: through "..", an absolute symlink, or a symlink to outside.
var ErrEscapes = fmt.Errorf("blockdev: path leads out of its directory: %w", syscall.EINVAL)

// OpenBeneath opens name inside dir and refuses, atomically, any name
// that resolves to something outside dir (openat2 with RESOLVE_BENEATH):
// no "..", no symlink that leaves dir, no /proc magic links. Leading
// slashes of name are dropped: "/dev/x" means dir/dev/x, as the kernel's
// dev_search_path concatenation does.
func OpenBeneath(dir, name string, opts Options) (*Backend, error) {
	name = strings.TrimLeft(name, "/")
	if name == "" {
		return nil, fmt.Errorf("blockdev: empty name: %w", syscall.EINVAL)
	}
	d, err := os.OpenFile(dir, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	full := filepath.Join(dir, name)
	return openWith(full, opts, func(flags int) (*os.File, error) {
		how := unix.OpenHow{Flags: uint64(flags), Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS}
		fd, err := unix.Openat2(int(d.Fd()), name, &how)
		if err == unix.EXDEV {
			return nil, fmt.Errorf("%s: %w", full, ErrEscapes)
		}
		if err != nil {
			return nil, &os.PathError{Op: "open", Path: full, Err: err}
		}
		return os.NewFile(uintptr(fd), full), nil
	})
}

func openWith(path string, opts Options, open func(flags int) (*os.File, error)) (*Backend, error) {
	flags := os.O_RDWR
	if opts.ReadOnly {
		flags = os.O_RDONLY
	}
	if opts.Direct {
		flags |= syscall.O_DIRECT
	}
	f, err := openChecked(path, flags|syscall.O_CLOEXEC, open)
	if err != nil {
		return nil, err
	}
	b := &Backend{path: path, f: f, ro: opts.ReadOnly}
	if err := b.probe(opts); err != nil {
		f.Close()
		return nil, fmt.Errorf("blockdev: %s: %w", path, err)
	}
	if !opts.Direct {
		// Without O_DIRECT the page cache is a volatile write cache,
		// whatever the device's own (a brd, a RAID controller with a
		// battery report "write through").
		b.caps.WriteCache = true
	}
	b.caps.FUA = b.caps.WriteCache
	if opts.WriteThrough {
		// Read-only, it still reports no cache: what a reader is told
		// of the device should not depend on its own access mode.
		b.wt = !b.ro
		b.caps.WriteCache, b.caps.FUA = false, false
	}
	b.probeNowait(opts.Direct)
	if !b.ro {
		// A second descriptor of the same file with O_DSYNC serves
		// FUA writes. Reopened through the first, never by path, so
		// it is the very same file; named by the path, so that its
		// errors name the export's file, not /proc/self/fd/N.
		fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), flags|syscall.O_DSYNC|syscall.O_CLOEXEC, 0)
		runtime.KeepAlive(f)
		if err != nil {
			f.Close()
			return nil, &os.PathError{Op: "open", Path: path, Err: err}
		}
		b.fsync = os.NewFile(uintptr(fd), path)
	}
	b.mapInit(opts.Direct)
	return b, nil
}

// ErrNotBlockLike is returned for a path that is neither a regular file
// nor a block device.
var ErrNotBlockLike = fmt.Errorf("blockdev: not a regular file or block device: %w", syscall.EINVAL)

// openChecked opens what open finds with flags only once it is known to
// be a regular file or a block device: first as a bare path (O_PATH: no
// open of the object itself, so a FIFO cannot block and a character
// device's open has no effect), then, the type checked on that very
// inode, for IO through the descriptor's /proc link.
func openChecked(path string, flags int, open func(flags int) (*os.File, error)) (*os.File, error) {
	p, err := open(unix.O_PATH | unix.O_CLOEXEC)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(p.Fd()), &st); err != nil {
		return nil, &os.PathError{Op: "fstat", Path: path, Err: err}
	}
	if t := st.Mode & unix.S_IFMT; t != unix.S_IFREG && t != unix.S_IFBLK {
		return nil, fmt.Errorf("%s: %w", path, ErrNotBlockLike)
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", p.Fd()), flags, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

func (b *Backend) probe(opts Options) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(b.f.Fd()), &st); err != nil {
		return err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		b.kind = KindFile
		b.size.Store(st.Size)
		b.dev, b.ino = st.Dev, st.Ino
		b.lbs, b.pbs = opts.LogicalBlockSize, opts.PhysicalBlockSize
		if opts.Direct {
			// O_DIRECT IO must be aligned as the file's storage
			// wants: 4 KiB on a 4Kn disk, where 512 fails EINVAL.
			if a := dioAlign(b.f, st.Dev); a > max(b.lbs, 512) {
				switch {
				case b.lbs == 0:
					b.lbs = a
				default:
					return fmt.Errorf("logical block size %d: O_DIRECT IO on this file must be aligned to %d bytes: %w", b.lbs, a, syscall.EINVAL)
				}
			}
		}
		if b.lbs == 0 {
			b.lbs = 512
		}
		if b.pbs == 0 {
			b.pbs = max(4096, b.lbs)
		}
		if !validBlockSize(b.lbs) || !validBlockSize(b.pbs) || b.pbs < b.lbs {
			return fmt.Errorf("block sizes %d/%d: want powers of two from 512 to 65536, physical >= logical: %w", b.lbs, b.pbs, syscall.EINVAL)
		}
		var fs unix.Statfs_t
		if unix.Fstatfs(int(b.f.Fd()), &fs) == nil {
			b.fs = uint32(fs.Type)
		}
		b.probeFile()
	case unix.S_IFBLK:
		b.kind = KindBlockDevice
		b.dev, b.ino = st.Rdev, 0
		if err := b.probeDevice(); err != nil {
			return err
		}
	default:
		return fmt.Errorf("not a regular file or block device: %w", syscall.EINVAL)
	}
	// The tail that is not a whole block cannot be addressed.
	b.size.Store(b.size.Load() &^ int64(b.lbs-1))
	b.end.Store(b.size.Load())
	b.want = b.size.Load()
	return nil
}

// dioAlign is the offset and length alignment O_DIRECT IO on f needs, as
// far as the disk its file system lies on (fsdev, st_dev) makes it: the
// smaller of statx's STATX_DIOALIGN (Linux 6.1) and that disk's logical
// block size, either where the other is unknown, 0 where both are. A file
// system's own larger alignment is left out: f2fs says its block size and
// serves smaller O_DIRECT IO through the page cache, and an export that
// served 512-byte blocks must keep serving them (a client's partition
// table and file system are laid out in them).
func dioAlign(f *os.File, fsdev uint64) int {
	stx := 0
	var x unix.Statx_t
	if unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &x) == nil &&
		x.Mask&unix.STATX_DIOALIGN != 0 {
		stx = int(x.Dio_offset_align)
	}
	disk := 0
	_, d := sysfsDirs("/sys/dev/block", fsdev)
	if s, err := os.ReadFile(filepath.Join(d, "queue", "logical_block_size")); err == nil {
		disk, _ = strconv.Atoi(strings.TrimSpace(string(s)))
	}
	switch {
	case stx > 0 && disk > 0:
		return min(stx, disk)
	case stx > 0:
		return stx
	}
	return disk
}

func validBlockSize(n int) bool { return n >= 512 && n <= 65536 && n&(n-1) == 0 }

// probeFile learns what the file's filesystem can do, without changing
// its data: a hole punched past the end with KEEP_SIZE frees nothing,
// and fails with EOPNOTSUPP where holes cannot be punched. It does move
// the file's mtime (ext4, tmpfs), which is left so: putting the old
// one back could hide a write made meanwhile from a backup. tmpfs
// punches holes (since Linux 3.5), so it is not asked.
func (b *Backend) probeFile() {
	b.caps = Caps{
		MaxIOBytes:          8 << 20,
		MaxSegments:         256,
		WriteCache:          true, // block allocation is metadata until fdatasync, even with O_DIRECT
		MaxWriteZeroesBytes: maxZeroBytes,
	}
	if b.ro {
		return
	}
	// Zero range is not probed: past the end it allocates an unwritten
	// extent (ext4, XFS) that stays; the first write-zeroes finds out.
	b.caps.ZeroRange = true
	if b.fs == tmpfsMagic || unix.Fallocate(int(b.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, b.size.Load()+1<<20, 4096) == nil {
		b.caps.Discard = true
		b.caps.MaxDiscardBytes = maxZeroBytes
		b.caps.DiscardGranularity = uint32(b.pbs)
	}
}

func (b *Backend) probeDevice() error {
	fd := int(b.f.Fd())
	size, err := ioctlUint64(b.f, unix.BLKGETSIZE64)
	if err != nil {
		return fmt.Errorf("BLKGETSIZE64: %w", err)
	}
	b.size.Store(int64(size))
	if b.lbs, err = unix.IoctlGetInt(fd, unix.BLKSSZGET); err != nil {
		return fmt.Errorf("BLKSSZGET: %w", err)
	}
	if b.pbs, err = unix.IoctlGetInt(fd, unix.BLKPBSZGET); err != nil {
		return fmt.Errorf("BLKPBSZGET: %w", err)
	}
	ro, err := unix.IoctlGetInt(fd, unix.BLKROGET)
	if err != nil {
		return fmt.Errorf("BLKROGET: %w", err)
	}
	if ro != 0 && !b.ro {
		return fmt.Errorf("device is read-only: %w", syscall.EROFS)
	}
	dir, disk := sysfsDirs("/sys/dev/block", b.dev)
	num := func(path string) uint64 {
		s, err := os.ReadFile(path)
		if err != nil {
			return 0
		}
		n, _ := strconv.ParseUint(strings.TrimSpace(string(s)), 10, 64)
		return n
	}
	q := filepath.Join(disk, "queue")
	wc, _ := os.ReadFile(filepath.Join(q, "write_cache"))
	b.caps = Caps{
		MaxDiscardBytes:     num(filepath.Join(q, "discard_max_bytes")),
		DiscardGranularity:  uint32(num(filepath.Join(q, "discard_granularity"))),
		DiscardAlignment:    uint32(num(filepath.Join(dir, "discard_alignment"))),
		MaxWriteZeroesBytes: num(filepath.Join(q, "write_zeroes_max_bytes")),
		WriteCache:          strings.TrimSpace(string(wc)) == "write back",
		MaxIOBytes:          uint32(min(num(filepath.Join(q, "max_hw_sectors_kb"))<<10, 1<<31)),
		MaxSegments:         uint16(min(num(filepath.Join(q, "max_segments")), 65535)),
	}
	b.caps.Discard = b.caps.MaxDiscardBytes > 0 && !b.ro
	b.caps.ZeroRange = b.caps.MaxWriteZeroesBytes > 0
	if b.caps.MaxWriteZeroesBytes == 0 {
		b.caps.MaxWriteZeroesBytes = maxZeroBytes // emulated
	}
	if b.caps.MaxIOBytes == 0 {
		b.caps.MaxIOBytes = 128 << 10
	}
	if b.caps.MaxSegments == 0 {
		b.caps.MaxSegments = 128
	}
	return nil
}

// sysfsDirs returns the sysfs directory of block device dev (under root,
// /sys/dev/block) and that of the disk whose request queue serves it: a
// partition has no queue of its own — its disk's limits and write cache
// are its own — and is a subdirectory of its disk's.
func sysfsDirs(root string, dev uint64) (dir, disk string) {
	dir = filepath.Join(root, fmt.Sprintf("%d:%d", unix.Major(dev), unix.Minor(dev)))
	if _, err := os.Stat(filepath.Join(dir, "partition")); err != nil {
		return dir, dir
	}
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return dir, dir
	}
	return dir, filepath.Dir(real)
}

// Path is the path the backend was opened from.
func (b *Backend) Path() string { return b.path }

// Kind is file or block device.
func (b *Backend) Kind() Kind { return b.kind }

// Size is the addressable size in bytes, a multiple of the logical block.
func (b *Backend) Size() int64 { return b.size.Load() }

// Refresh reads the size again — a file grown or cut by the server
// itself (rnbd-server resize), a block device resized (lvextend) — and
// serves that size from then on, at most a Cap under way, grown or
// shrunk. It returns the size served before and after. A size poll uses
// PollSize, which does not take a file's shrink for a resize.
func (b *Backend) Refresh() (was, now int64, err error) {
	return b.reread(true)
}

// PollSize reads the size again for a size poll (a client's OPEN of a
// device it has open, the health loop): a grow is served from then on as
// Refresh serves it, and a block device's new size whatever it is; but a
// file found shorter than the size served — cut behind the server's
// back: a cut of the server's own is capped first (Cap) — is not. The
// size served stays, IO past the file's end fails with ErrPastFileEnd
// (EIO), so that no write grows the file back, and PollSize returns a
// *ShrinkError; until a poll finds the file back at the size served, or
// a Refresh serves the size it has. It returns the size served before
// and after.
func (b *Backend) PollSize() (was, now int64, err error) {
	return b.reread(b.kind != KindFile)
}

func (b *Backend) reread(follow bool) (was, now int64, err error) {
	for {
		// The size is read without the lock (fstat may wait on its
		// file system), and served only if no cap or uncap came
		// between: else it may be from before a cut.
		b.sizeMu.Lock()
		seq := b.sizeSeq
		b.sizeMu.Unlock()
		has, err := b.readSize()
		if err != nil {
			return 0, 0, err
		}
		b.sizeMu.Lock()
		if seq != b.sizeSeq {
			b.sizeMu.Unlock()
			continue
		}
		want := has
		if !follow && has < b.want {
			want = b.want // a shrink behind the server's back: an error, not a resize
		}
		was, now = b.serve(want, has)
		b.sizeMu.Unlock()
		b.remap(now)
		if has < now {
			return was, now, &ShrinkError{Path: b.path, Served: now, Size: has}
		}
		return was, now, nil
	}
}

// serve sets the size served but for a cap (want), and with it the size
// served and where IO ends, for a file that has bytes now (whole
// logical blocks); sizeMu is held. It returns the size served before
// and after.
func (b *Backend) serve(want, has int64) (was, now int64) {
	b.want = want
	now = want
	if b.capOwner != 0 && now > b.capped {
		now = b.capped
	}
	end := min(now, has)
	was, old := b.size.Load(), b.end.Load()
	b.resized(old, end) // before a grow is served
	// end <= size at every instant: whichever moves down goes first.
	if end < old {
		b.end.Store(end)
		b.size.Store(now)
	} else {
		b.size.Store(now)
		b.end.Store(end)
	}
	return was, now
}

// ShrinkError is a file found shorter than the size its clients are
// served: cut behind the server's back (PollSize, HealthCheck).
type ShrinkError struct {
	Path         string
	Served, Size int64 // bytes, Size in whole logical blocks
}

func (e *ShrinkError) Error() string {
	return fmt.Sprintf("blockdev: %s shrank from %d to %d bytes, not by rnbd-server resize: clients keep the size they were told, "+
		"and IO past the file's end fails with EIO until the file is grown back or resized with --force", e.Path, e.Served, e.Size)
}

// readSize is the size the file or device has now, in whole logical
// blocks.
func (b *Backend) readSize() (int64, error) {
	var now int64
	switch b.kind {
	case KindFile:
		var st unix.Stat_t
		if err := unix.Fstat(int(b.f.Fd()), &st); err != nil {
			return 0, fmt.Errorf("blockdev: %s: %w", b.path, err)
		}
		now = st.Size
	default:
		n, err := ioctlUint64(b.f, unix.BLKGETSIZE64)
		if err != nil {
			return 0, fmt.Errorf("blockdev: %s: BLKGETSIZE64: %w", b.path, err)
		}
		now = int64(n)
	}
	return now &^ int64(b.lbs-1), nil
}

// Cap prepares a cut of the file to size for owner (not 0; a later cap
// takes over): from its call on, the backend serves at most size bytes
// (writes past it fail with ENOSPC, Refresh and PollSize keep to it),
// and it returns when every write that began before has ended, so that
// none lands past size once the caller cuts the file — or fails with
// ETIMEDOUT after timeout (a write hung on its storage). Uncap(owner)
// ends the cap, done or not.
func (b *Backend) Cap(size int64, timeout time.Duration, owner uint64) error {
	b.capMu.Lock()
	defer b.capMu.Unlock()
	size &^= int64(b.lbs - 1)
	b.sizeMu.Lock()
	b.capOwner, b.capped = owner, size
	b.sizeSeq++
	if b.end.Load() > size {
		b.end.Store(size) // first: end <= size
	}
	if b.size.Load() > size {
		b.size.Store(size)
	}
	b.sizeMu.Unlock()
	deadline := time.Now().Add(timeout)
	cur := b.wgen.Load()
	// First the writes of older generations that an earlier cap gave
	// up on (they count in the counter the flip makes the new one)...
	if err := b.drain((cur+1)&1, deadline, timeout); err != nil {
		return err
	}
	// ...then those of this generation. One that began before the
	// flip is counted in cur's when we look, or checks its range after
	// the end stored above (beginWrite).
	b.wgen.Store(cur + 1)
	return b.drain(cur&1, deadline, timeout)
}

// drain waits until no write counts in generation g, or the deadline.
func (b *Backend) drain(g uint32, deadline time.Time, timeout time.Duration) error {
	for b.wcnt[g].Load() != 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("blockdev: %s: %d writes in flight did not end in %v: %w", b.path, b.wcnt[g].Load(), timeout, syscall.ETIMEDOUT)
		}
		time.Sleep(time.Millisecond)
	}
	return nil
}

// Uncap ends owner's Cap, if it is still the one in force; the caller
// then Refreshes to serve the file's size (or, if nothing was cut, polls
// it: PollSize).
func (b *Backend) Uncap(owner uint64) {
	b.sizeMu.Lock()
	if b.capOwner == owner {
		b.capOwner = 0
		b.sizeSeq++
	}
	b.sizeMu.Unlock()
}

// beginWrite counts a write (or discard, write-zeroes) in flight for
// Cap, before its range is checked; endWrite, with what it returned,
// when it is done. A write counts in the generation that is current
// after it counted itself: one that read the generation, then waited
// while a cap flipped it (once or more), counts again in the new one.
func (b *Backend) beginWrite() uint32 {
	for {
		g := b.wgen.Load()
		b.wcnt[g&1].Add(1)
		if b.wgen.Load() == g {
			return g & 1
		}
		b.wcnt[g&1].Add(-1)
	}
}

func (b *Backend) endWrite(g uint32) { b.wcnt[g].Add(-1) }

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

// Health reports what happened to a file backend behind the server's
// back: deleted (IO then goes to an unlinked inode nobody else sees),
// replaced (its path now names another file), or shrunk below the size
// clients were told (a *ShrinkError: reads past the file's end fail with
// EIO, and writes there too once PollSize has seen it). nil if none; a
// block device is always healthy here. It waits as long as the file's
// file system takes to answer: see NewHealthCheck.
func (b *Backend) Health() error {
	h, err := b.NewHealthCheck()
	if err != nil {
		return err
	}
	return h.Run()
}

// HealthCheck is Health on a descriptor of its own: once made, it needs
// the backend no more, so it can be left waiting on a mount that does not
// answer while the backend is closed.
type HealthCheck struct {
	f    *os.File // nil: nothing to check (a block device)
	path string
	size int64 // served
	lbs  int64
}

// NewHealthCheck prepares a Health check; the backend must stay open
// until it returns, not while the check runs.
func (b *Backend) NewHealthCheck() (*HealthCheck, error) {
	h := &HealthCheck{path: b.path, size: b.size.Load(), lbs: int64(b.lbs)}
	if b.kind != KindFile {
		return h, nil
	}
	fd, err := unix.FcntlInt(b.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	runtime.KeepAlive(b.f)
	if err != nil {
		return nil, fmt.Errorf("blockdev: %s: %w", b.path, err)
	}
	h.f = os.NewFile(uintptr(fd), b.path)
	return h, nil
}

// Run does the check once and releases the descriptor.
func (h *HealthCheck) Run() error {
	if h.f == nil {
		return nil
	}
	defer h.f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(h.f.Fd()), &st); err != nil {
		return fmt.Errorf("blockdev: %s: %w", h.path, err)
	}
	if st.Nlink == 0 {
		return fmt.Errorf("blockdev: %s was deleted: IO goes to a file nobody else sees", h.path)
	}
	var pst unix.Stat_t
	if err := unix.Stat(h.path, &pst); err == nil && (pst.Dev != st.Dev || pst.Ino != st.Ino) {
		return fmt.Errorf("blockdev: %s was replaced by another file: IO goes to the old one", h.path)
	}
	if st.Size < h.size {
		return &ShrinkError{Path: h.path, Served: h.size, Size: st.Size &^ (h.lbs - 1)}
	}
	return nil
}

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
